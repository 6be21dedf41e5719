"""What an offline free-form pass costs the engine at different KV cache sizes, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/engines/bench_kv_cache_batching.py --out benchmarks/results

A retraining job's judging (training/free_form_eval.py `evaluate_served`, as the worker runs it) sends all its
questions at once; the engine runs as many as its KV cache holds (a greedy answer of at most 48 tokens after a ~80-token
prompt takes ~130 tokens of it, so 128 MB, ~2,900 tokens of the embedded model, holds ~22). Per `--kv-mb` size, the
shipped free-form mode answers `--questions` PopQA questions in a fresh process (CALM_KV_CACHE_MB set, the sizes
interleaved over `--rounds`); the engine core's CPU seconds (its process, sampled from /proc until it exits), the
wall time, and whether every size gave the same answers and confidences. Results: kv_cache_batching.json / .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def answer(questions: int) -> None:
    """In the child: the shipped free-form mode's records, printed as one JSON line."""
    from calm_cli.serving import default_artifact, offline_engines
    from calm_core.artifact import FREE_FORM_DIR
    from calm_core.data import load_open
    from calm_core.models import resolve_model
    from training.free_form_eval import evaluate_served

    model = resolve_model(None)
    asked = load_open("popqa", "test", root=REPO.parent / "shared" / "data")[:questions]
    start = time.monotonic()
    records = evaluate_served(offline_engines(), str(model.path), default_artifact(model) / FREE_FORM_DIR, asked, 0)
    print(json.dumps({"wall_s": time.monotonic() - start, "tokens": sum(r.n_tokens for r in records),
                      "answers": [[r.text, round(r.token_confidence, 6)] for r in records]}))


def engine_cpu_s(root: psutil.Process, seen: dict[int, tuple[str, float]]) -> None:
    for p in root.children(recursive=True):
        try:
            seen[p.pid] = (" ".join(p.cmdline()), sum(p.cpu_times()[:2]))
        except psutil.Error:
            pass


def one_run(kv_mb: int, questions: int) -> dict:
    env = {**os.environ, "CALM_KV_CACHE_MB": str(kv_mb)}
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(questions)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    root, seen = psutil.Process(proc.pid), {}
    while proc.poll() is None:
        engine_cpu_s(root, seen)
        time.sleep(0.5)
    out = json.loads(proc.stdout.read().strip().splitlines()[-1])
    # The engine core is the busiest child (the forkserver and its idle parent cost a few seconds).
    out["engine_cpu_s"] = max(cpu for _, cpu in seen.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-mb", default="128,256,512")
    parser.add_argument("--questions", type=int, default=210)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return answer(args.child)
    sizes = [int(s) for s in args.kv_mb.split(",")]
    runs: dict[int, list[dict]] = {s: [] for s in sizes}
    for r in range(args.rounds):
        for size in sizes if r % 2 == 0 else sizes[::-1]:
            runs[size].append(one_run(size, args.questions))
            print(f"round {r + 1}, {size} MB: engine {runs[size][-1]['engine_cpu_s']:.1f} CPU s, "
                  f"{runs[size][-1]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    same = all(run["answers"] == runs[sizes[0]][0]["answers"] for rs in runs.values() for run in rs)
    base = statistics.median(r["engine_cpu_s"] for r in runs[sizes[0]])
    rows = {s: {"engine_cpu_s": statistics.median(r["engine_cpu_s"] for r in rs),
                "wall_s": statistics.median(r["wall_s"] for r in rs), "tokens": rs[0]["tokens"],
                "rounds": [round(r["engine_cpu_s"], 1) for r in rs]} for s, rs in runs.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_cache_batching.json").write_text(json.dumps({"questions": args.questions, "same_answers": same,
                                                                 "sizes": rows}, indent=1))
    lines = [f"`OMP_NUM_THREADS=1 python benchmarks/engines/bench_kv_cache_batching.py` ({args.rounds} rounds, "
             f"medians): {args.questions} PopQA questions answered greedily at once (at most 48 tokens) by the shipped "
             f"free-form mode on one offline engine, as a retraining job's judging sends them; the engine core's CPU. "
             f"Same answers and confidences at every size: {'yes' if same else 'NO'}.", "",
             "| KV cache (MB) | engine CPU s | per answer | vs first | wall s | tokens | rounds (CPU s) |",
             "|---:|---:|---:|---:|---:|---:|---|"]
    for s, row in rows.items():
        lines.append(f"| {s} | {row['engine_cpu_s']:.1f} | {row['engine_cpu_s'] / args.questions:.3f} | "
                     f"{row['engine_cpu_s'] / base:.2f} | {row['wall_s']:.1f} | {row['tokens']} | "
                     f"{', '.join(map(str, row['rounds']))} |")
    (args.out / "kv_cache_batching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
