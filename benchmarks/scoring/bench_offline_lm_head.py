"""Offline multiple-choice scoring (`calm eval --artifact`, the retraining gate) with the LM head run only where
option log-probs are read, against the LM head over every position of the packed question; side by side in one run.

    python benchmarks/scoring/bench_offline_lm_head.py --out benchmarks/results

The shipped artifact (cloze, one pass, α head folded) scores the same MedMCQA and ARC-Easy questions both ways on the
offline engine (training/offline_engine.py); the arms alternate, each timed by this process's CPU time (one thread:
OMP_NUM_THREADS=1, as the test suite runs). Results: offline_lm_head.json / .md in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import training.offline_engine as offline  # noqa: E402
from calm_cli.serving import default_artifact  # noqa: E402
from calm_core.artifact import load_artifact  # noqa: E402
from calm_core.data import load_mc  # noqa: E402
from calm_core.models import resolve_model  # noqa: E402
from training.artifact_scoring import load_served_model, option_probabilities  # noqa: E402
from training.scoring import load_tokenizer  # noqa: E402

READ_ONLY, EVERY_POSITION = "LM head where read", "LM head at every position"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--per-set", type=int, default=60, help="questions from each of MedMCQA and ARC-Easy")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_info = resolve_model(None, "float32")
    artifact = load_artifact(default_artifact(model_info))
    model = load_served_model(str(model_info.path), artifact.adapter_dir)
    tokenizer = load_tokenizer(str(model_info.path))
    sets = {"medmcqa": load_mc("medmcqa", "dev")[: args.per_set], "arc_easy": load_mc("arc_easy", "test")[: args.per_set]}
    read_row = offline.first_read_row

    def score(arm: str, questions) -> tuple[np.ndarray, float]:
        offline.first_read_row = read_row if arm == READ_ONLY else (lambda request, length: 0)
        start = time.process_time()
        probs = option_probabilities(model, tokenizer, questions, "cloze", artifact.head)
        return probs, time.process_time() - start

    score(READ_ONLY, sets["arc_easy"][:4])  # warm-up
    cpu = {(name, arm): [] for name in sets for arm in (READ_ONLY, EVERY_POSITION)}
    diff = {}
    for r in range(args.rounds):
        for name, questions in sets.items():
            arms = (READ_ONLY, EVERY_POSITION) if r % 2 == 0 else (EVERY_POSITION, READ_ONLY)
            probs = {}
            for arm in arms:
                probs[arm], seconds = score(arm, questions)
                cpu[(name, arm)].append(seconds)
                print(f"round {r + 1} {name} {arm}: {seconds:.1f} CPU s", flush=True)
            diff[name] = max(diff.get(name, 0.0), float(np.abs(probs[READ_ONLY] - probs[EVERY_POSITION]).max()))
    rows = []
    for name, questions in sets.items():
        fast, slow = (float(np.median(cpu[(name, arm)])) for arm in (READ_ONLY, EVERY_POSITION))
        rows.append({"set": name, "questions": len(questions), "read_only_cpu_s": fast, "every_position_cpu_s": slow,
                     "ratio": slow / fast, "max_probability_difference": diff[name]})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "offline_lm_head.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [f"Offline cloze scoring of the shipped artifact, one thread, median of {args.rounds} rounds "
             "(`python benchmarks/scoring/bench_offline_lm_head.py`):", "",
             f"| set | questions | CPU s, {READ_ONLY} | CPU s, {EVERY_POSITION} | ratio | largest probability difference |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['set']} | {r['questions']} | {r['read_only_cpu_s']:.1f} | {r['every_position_cpu_s']:.1f} | "
              f"{r['ratio']:.2f}x | {r['max_probability_difference']:.1e} |" for r in rows]
    (args.out / "offline_lm_head.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
