"""Long multiple-choice questions: one-pass cloze scoring with and without reading the question from vLLM's prefix
cache, side by side in one run (gateway in-process, shipped artifact).

    python benchmarks/scoring/bench_long_mc.py --out benchmarks/results [--questions 64]

The MMLU questions (test split) with four options whose cloze prompt (`Question: …\\nAnswer:`) is the longest, at
least 250 tokens: the 64 longest. Both gateways get the same questions at concurrency 8, raw-model pass off:
  one-pass           every option one request with the whole question, prompt log-probs (vLLM skips its prefix
                     cache for prompt log-probs, so each option re-reads the question): CALM_OPTION_PREFIX_REUSE=false
  one-pass, prefix   the first option alone, then the others reading the question's cached blocks: only their tails
                     are computed
Throughput, latency, and the largest difference between the two paths' option probabilities. Results:
long_mc.json / .md in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.scoring.bench_one_pass import MODEL, ask_all, percentile  # noqa: E402
from calm_core.data import load_mc  # noqa: E402
from calm_core.prompts import cloze_prompt  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

CONCURRENCY = 8
MIN_TOKENS = 250


def cloze_prompt_tokens(questions) -> list[int]:
    """Each question's cloze prompt (`Question: …\\nAnswer:`) in the embedded model's tokens."""
    from calm_core.models import resolve_model
    from training.scoring import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None, "float32").path)
    return [len(tokenizer(cloze_prompt(q.question), add_special_tokens=False)["input_ids"]) for q in questions]


def long_questions(n: int):
    four = [q for q in load_mc("mmlu", "test") if len(q.choices) == 4]
    sized = sorted(zip(cloze_prompt_tokens(four), four), key=lambda pair: -pair[0])
    chosen = [(size, q) for size, q in sized if size >= MIN_TOKENS][:n]
    if len(chosen) < n:
        raise SystemExit(f"only {len(chosen)} MMLU questions have {MIN_TOKENS}+ prompt tokens")
    return [q for _, q in chosen], [size for size, _ in chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--questions", type=int, default=64)
    args = parser.parse_args()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    questions, sizes = long_questions(args.questions)
    bodies = [{"model": MODEL, "messages": [{"role": "user", "content": q.question}], "options": list(q.choices),
               "calm": {"raw_confidence": False}} for q in questions]
    results: dict = {"questions": len(questions), "concurrency": CONCURRENCY, "prompt_tokens_min": min(sizes),
                     "prompt_tokens_median": sorted(sizes)[len(sizes) // 2], "paths": {}}
    probs = {}
    for name, reuse in (("one-pass", "false"), ("one-pass, prefix", "true")):
        port = free_port()
        env = {"CALM_DB_PATH": str(logs / f"long-mc-{reuse}.sqlite3"), "CALM_OPTION_PREFIX_REUSE": reuse}
        with running(calm_argv("serve", "--port", str(port)), f"http://127.0.0.1:{port}/health",
                     logs / f"long-mc-{reuse}.log", env=env, timeout=300):
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            scoring = httpx.get(f"http://127.0.0.1:{port}/health", headers={"Authorization": "Bearer dev-admin-key"}).json()["scoring"]["multiple_choice"]
            asyncio.run(ask_all(url, bodies[-4:], 4))  # warm-up (the shortest four, asked again below)
            probs[name], latencies, wall = asyncio.run(ask_all(url, bodies, CONCURRENCY))
        results["paths"][name] = {"scoring": scoring, "rps": len(bodies) / wall,
                                  "p50_ms": 1000 * percentile(latencies, 0.5), "p90_ms": 1000 * percentile(latencies, 0.9)}
        print(f"{name}: {results['paths'][name]}", flush=True)
    diff = max(abs(a - b) for pa, pb in zip(probs["one-pass"], probs["one-pass, prefix"]) for a, b in zip(pa, pb))
    results["max_abs_probability_difference"] = diff
    args.out.joinpath("long_mc.json").write_text(json.dumps(results, indent=2))
    args.out.joinpath("long_mc.md").write_text(markdown(results))
    print(markdown(results))


def markdown(r: dict) -> str:
    base = r["paths"]["one-pass"]["rps"]
    lines = [f"`python benchmarks/scoring/bench_long_mc.py` (one run): the {r['questions']} MMLU test questions with four options "
             f"and the longest cloze prompts ({r['prompt_tokens_min']}+ tokens, median {r['prompt_tokens_median']}), "
             f"concurrency {r['concurrency']}, raw pass off, shipped artifact, gateway in-process.", "",
             "| multiple-choice scoring | questions/s | p50 ms | p90 ms | throughput vs one-pass |", "|---|---:|---:|---:|---:|"]
    for name, x in r["paths"].items():
        lines.append(f"| {name} | {x['rps']:.2f} | {x['p50_ms']:.0f} | {x['p90_ms']:.0f} | {x['rps'] / base:.2f} |")
    lines.append("")
    lines.append(f"Largest option-probability difference between the two paths: {r['max_abs_probability_difference']:.1e}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
