"""What token confidence adds to a greedy free-form answer, in one run (in-process vLLM, the shipped free-form mode).

    python benchmarks/scoring/bench_token_confidence.py --out benchmarks/results

The engine `calm serve` starts for free-form answers (the shipped artifact's free-form mode: its weights, its α head in
the logits processor) answers the same TriviaQA questions one at a time, interleaved, two ways:
    plain              greedy, α head switched off for the request, no log-probs returned (a bare vLLM answer)
    token confidence   greedy, α head applied, each token's calibrated log-prob returned, and the confidence
                       computed from them (calm_core.scoring.sequence_confidence), as the gateway does
The head is a scalar: both ways generate the same tokens, so the latencies compare like for like.
Results: token_confidence.json / .md in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from calm_core.data import load_open  # noqa: E402
from calm_core.scoring import sequence_confidence  # noqa: E402


async def run(questions: list[str], max_tokens: int) -> dict[str, list[float]]:
    from vllm import SamplingParams

    from adapters.clients.inprocess import InProcessVLLMEngine
    from adapters.vllm_plugins.common import OPT_OUT_KEY
    from calm_cli.serving import engine_config, load_checked, default_artifact
    from calm_core.models import resolve_model
    from gateway.settings import GatewaySettings
    from training.generative import free_form_prompt

    settings = GatewaySettings()
    model = resolve_model(settings.model, "float32")
    path = default_artifact(model)
    tokenizer, artifact = load_checked(model, path)
    if artifact.free_form is None or artifact.free_form.head.kind.value != "scalar":
        raise SystemExit("the shipped artifact has no scalar-head free-form mode")
    engine = InProcessVLLMEngine(engine_config(settings, model, path, artifact, inprocess=True))
    await engine.start()
    llm = engine._engines["free_form"]  # the engine free-form requests go to
    modes = {
        "plain": SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={OPT_OUT_KEY: False}),
        "token confidence": SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0),
    }
    latencies: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list[tuple[int, ...]]] = {m: [] for m in modes}

    async def answer(prompt: str, mode: str, rid: str) -> float:
        start = time.perf_counter()
        ids, logprobs = [], []
        async for out in llm.generate(prompt, modes[mode], rid):
            c = out.outputs[0]
            ids = list(c.token_ids)
            logprobs = [float(p[t].logprob) for t, p in zip(c.token_ids, c.logprobs or [])]
        if mode == "token confidence":
            sequence_confidence(logprobs)
        tokens[mode].append(tuple(ids))
        return time.perf_counter() - start

    prompts = [free_form_prompt(tokenizer, q) for q in questions]
    await answer(prompts[0], "plain", "warm-0")
    await answer(prompts[0], "token confidence", "warm-1")
    for m in modes:
        tokens[m].clear()
    for i, prompt in enumerate(prompts):  # interleaved, order alternating, so both see the same machine state
        order = list(modes) if i % 2 == 0 else list(reversed(modes))
        for mode in order:
            latencies[mode].append(await answer(prompt, mode, f"{mode}-{i}"))
    await engine.close()
    same = sum(a == b for a, b in zip(tokens["plain"], tokens["token confidence"]))
    return {"latencies": latencies, "same_answers": same, "mean_tokens": statistics.mean(map(len, tokens["plain"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    questions = [q.question for q in load_open("triviaqa")[: args.questions]]
    result = asyncio.run(run(questions, args.max_tokens))
    lat = result["latencies"]
    base = statistics.median(lat["plain"])
    rows = {m: {"p50_ms": 1000 * statistics.median(v), "mean_ms": 1000 * statistics.mean(v),
                "ratio_p50": statistics.median(v) / base, "ratio_mean": statistics.mean(v) / statistics.mean(lat["plain"])}
            for m, v in lat.items()}
    lines = ["| free-form greedy answer | p50 ms | mean ms | p50 vs plain | mean vs plain |", "|---|---|---|---|---|"]
    lines += [f"| {m} | {r['p50_ms']:.1f} | {r['mean_ms']:.1f} | {r['ratio_p50']:.3f} | {r['ratio_mean']:.3f} |"
              for m, r in rows.items()]
    lines.append(f"\n{len(questions)} TriviaQA questions, concurrency 1, max {args.max_tokens} tokens (mean "
                 f"{result['mean_tokens']:.1f}), in-process vLLM on the shipped free-form mode; the same tokens in "
                 f"{result['same_answers']}/{len(questions)} answers.")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "token_confidence.json").write_text(json.dumps({"questions": len(questions), "modes": rows,
                                                                "same_answers": result["same_answers"]}, indent=2))
    (args.out / "token_confidence.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
