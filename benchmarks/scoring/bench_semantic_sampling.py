"""At which temperature, with or without the α head, do sampled answers tell right greedy answers from wrong ones?

    python benchmarks/scoring/bench_semantic_sampling.py --questions 60 --out benchmarks/results

The shipped free-form mode answers TriviaQA (held-out) and PopQA questions greedily, as served; then 8 answers are
sampled per question at each setting (through the head at 1.0, the old semantic mode's samples; without it at 0.5, 0.7
and 1.0), seeded as the gateway seeds a question's samples (`samples_seed`, from the prompt), so a rerun draws the
same ones. For each setting: the AUROC of the share of samples that agree with the greedy answer
(calm_core/answers.agreement ≥ 1/2) against alias-match correctness, next to the token confidence's AUROC on the same
answers, and the mean share. Results: semantic_sampling.json / .md in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from adapters.clients.inprocess import artifact_engine  # noqa: E402
from calm_cli.serving import DEFAULT_ARTIFACTS  # noqa: E402
from calm_core.answers import agreement, is_correct  # noqa: E402
from calm_core.artifact import load_artifact  # noqa: E402
from calm_core.engine import EngineRequest, generate_choices  # noqa: E402
from calm_core.metrics import auroc  # noqa: E402
from calm_core.models import EMBEDDED_ID, resolve_model  # noqa: E402
from calm_core.scorers.free_form import samples_seed  # noqa: E402
from calm_core.scoring import sequence_confidence  # noqa: E402
from training.evaluate import DatasetSpec, sample_questions  # noqa: E402
from training.free_form_eval import MAX_TOKENS  # noqa: E402
from training.generative import free_form_prompt  # noqa: E402
from training.scoring import load_tokenizer  # noqa: E402

SETS = ("triviaqa:sample@0.8-0.86667", "popqa:test@0-0.2")
SETTINGS = {"head, T=1.0": (True, 1.0), "raw, T=0.5": (False, 0.5), "raw, T=0.7": (False, 0.7),
            "raw, T=1.0": (False, 1.0)}
SAMPLES = 8


async def answer_all(engine, tokenizer, questions) -> list[dict]:
    async def one(i: int, q) -> dict:
        prompt = free_form_prompt(tokenizer, q.question)
        greedy_request = EngineRequest(request_id=f"g{i}", prompt=prompt, max_tokens=MAX_TOKENS)
        greedy = (await generate_choices(engine, greedy_request))[0]
        record = {"question": q.question, "greedy": greedy.text, "correct": is_correct(greedy.text, q.answers, q.question),
                  "token_confidence": sequence_confidence(greedy.token_logprobs)}
        for name, (head, temperature) in SETTINGS.items():
            # Seeded as the gateway seeds a question's samples: the same numbers on every run.
            sampled = replace(greedy_request, request_id=f"g{i}-{name}", n=SAMPLES, temperature=temperature,
                              calibrated=head, seed=samples_seed(greedy_request))
            texts = [o.text for o in await generate_choices(engine, sampled)]
            record[name] = sum(agreement(greedy.text, t, prompt) >= 0.5 for t in texts) / SAMPLES
        return record

    return await asyncio.gather(*(one(i, q) for i, q in enumerate(questions)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=60, help="per set")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    resolved, mode = resolve_model(None), load_artifact(DEFAULT_ARTIFACTS[EMBEDDED_ID]).free_form
    tokenizer = load_tokenizer(str(resolved.path))

    async def run() -> dict[str, list[dict]]:
        records = {}
        async with artifact_engine(str(resolved.path), str(mode.path)) as engine:
            for s in SETS:
                records[s] = await answer_all(engine, tokenizer,
                                              sample_questions(DatasetSpec.parse(s).load(), args.questions, 0))
                print(f"{s}: {len(records[s])} questions answered and sampled", file=sys.stderr, flush=True)
        return records

    records = asyncio.run(run())
    rows = []
    for label, recs in records.items():
        correct = np.array([r["correct"] for r in recs], dtype=float)
        row = {"set": label, "n": len(recs), "accuracy": float(correct.mean()),
               "token_auroc": auroc(np.array([r["token_confidence"] for r in recs]), correct)}
        for name in SETTINGS:
            share = np.array([r[name] for r in recs])
            row[name] = {"auroc": auroc(share, correct), "mean_share": float(share.mean())}
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "semantic_sampling.json").write_text(json.dumps({"rows": rows, "records": records}, indent=1))
    lines = ["| set | n | accuracy | token AUROC | " + " | ".join(f"{n}: AUROC (mean share)" for n in SETTINGS) + " |",
             "|---|---|---|---|" + "---|" * len(SETTINGS)]
    for row in rows:
        lines.append(f"| {row['set']} | {row['n']} | {row['accuracy']:.3f} | {row['token_auroc']:.3f} | " + " | ".join(
            f"{row[n]['auroc']:.3f} ({row[n]['mean_share']:.3f})" for n in SETTINGS) + " |")
    lines += ["", f"{SAMPLES} samples per question and setting, seeded per question as the gateway seeds them; share: "
              "samples whose new words agree with the greedy answer's (word F1 ≥ 1/2); the shipped free-form mode; "
              "`python benchmarks/scoring/bench_semantic_sampling.py`."]
    (args.out / "semantic_sampling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
