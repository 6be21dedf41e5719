"""What reading a free-form answer back through the head costs, beside the path it replaced, in one run (in-process
vLLM, the shipped free-form mode, the gateway's own scorer).

    python benchmarks/scoring/bench_read_back.py --out benchmarks/results

The same TriviaQA questions, one at a time, interleaved, greedy and sampled (temperature 0.8, a seed per question):
    through the head   (the path before 2026-12-06) the answer drawn with the α head applied, its confidence from the
                       processed log-probs vLLM returned while drawing (which carry the request's temperature)
    read back          (the gateway's path) the answer drawn from the served weights with the head off, then read
                       back through the head one greedy token per answer token (calm_core/scorers/free_form.py)
Per answer: latency (p50, mean) and answer tokens per second of wall time. Results: read_back.json / .md in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from calm_core.data import load_open  # noqa: E402
from calm_core.engine import EngineRequest, generate_choices  # noqa: E402
from calm_core.prompts import PreparedPrompt  # noqa: E402
from calm_core.scorers.base import ScoringJob  # noqa: E402
from calm_core.scorers.free_form import TokenScorer  # noqa: E402
from calm_core.scoring import sequence_confidence  # noqa: E402

PATHS = ("through the head", "read back")
SAMPLINGS = {"greedy": {}, "sampled at 0.8": {"temperature": 0.8}}


async def run(questions: list[str], max_tokens: int) -> dict:
    from adapters.clients.inprocess import InProcessVLLMEngine
    from calm_cli.serving import default_artifact, engine_config, load_checked
    from calm_core.models import resolve_model
    from gateway.settings import GatewaySettings
    from training.generative import free_form_prompt

    settings = GatewaySettings()
    model = resolve_model(settings.model, "float32")
    path = default_artifact(model)
    tokenizer, artifact = load_checked(model, path)
    engine = InProcessVLLMEngine(engine_config(settings, model, path, artifact, inprocess=True))
    await engine.start()
    scorer = TokenScorer(engine, tokenizer)

    async def answer(path: str, request: EngineRequest) -> tuple[float, int]:
        start = time.perf_counter()
        if path == "through the head":
            (out,) = await generate_choices(engine, request)
            sequence_confidence(out.token_logprobs)
        else:
            (choice,) = (await scorer.score(ScoringJob(PreparedPrompt(request.prompt, None), request))).choices
            out = choice.output
        return time.perf_counter() - start, len(out.token_ids)

    results = {(p, s): [] for p in PATHS for s in SAMPLINGS}
    prompts = [free_form_prompt(tokenizer, q) for q in questions]
    base = EngineRequest(request_id="warm", prompt=prompts[0], max_tokens=max_tokens, top_logprobs=5, free_form=True)
    for p in PATHS:
        await answer(p, base)
    for i, prompt in enumerate(prompts):  # interleaved, order alternating, so all see the same machine state
        for sampling, params in SAMPLINGS.items():
            for p in PATHS if i % 2 == 0 else reversed(PATHS):
                request = replace(base, request_id=f"{p}-{sampling}-{i}", prompt=prompt, seed=i, **params)
                results[(p, sampling)].append(await answer(p, request))
    await engine.close()
    return results


def table(results: dict, questions: int, max_tokens: int) -> tuple[list[str], dict]:
    rows, lines = {}, ["| answer | path | p50 ms | mean ms | answer tokens / s | mean tokens |", "|---|---|---:|---:|---:|---:|"]
    for (path, sampling), runs in results.items():
        seconds, tokens = [s for s, _ in runs], [t for _, t in runs]
        rows[f"{sampling} / {path}"] = row = dict(p50_ms=1000 * statistics.median(seconds),
                                                  mean_ms=1000 * statistics.mean(seconds),
                                                  tokens_per_s=sum(tokens) / sum(seconds),
                                                  mean_tokens=statistics.mean(tokens))
        lines.append(f"| {sampling} | {path} | {row['p50_ms']:.0f} | {row['mean_ms']:.0f} | {row['tokens_per_s']:.1f} | "
                     f"{row['mean_tokens']:.1f} |")
    for sampling in SAMPLINGS:
        before, now = rows[f"{sampling} / through the head"], rows[f"{sampling} / read back"]
        lines.append(f"\n{sampling}: read back / through the head, mean latency {now['mean_ms'] / before['mean_ms']:.2f}x")
    lines.append(f"\n{questions} TriviaQA questions, concurrency 1, at most {max_tokens} tokens, in-process vLLM on the "
                 "shipped free-form mode (the answers of the two paths differ where sampled: one draws through the head)")
    return lines, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    questions = [q.question for q in load_open("triviaqa")[: args.questions]]
    lines, rows = table(asyncio.run(run(questions, args.max_tokens)), len(questions), args.max_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "read_back.json").write_text(json.dumps({"questions": len(questions), "rows": rows}, indent=2))
    (args.out / "read_back.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
