"""The KV-cache block size on CPU (the prefix cache's unit), side by side in one run: vLLM's CPU default (128 tokens)
against 32 (the smallest its CPU attention takes), on the shipped gateway in-process.

    python benchmarks/engines/bench_block_size.py --out benchmarks/results

Two gateways, one per block size, both started before the first request, asked the same things in interleaved rounds:
  multiple choice   MMLU (validation), ARC-Challenge and MedMCQA questions as they come, four options, concurrency 8,
                    raw pass off: one-pass cloze scoring reads the question once from the prefix cache when it fills
                    a block, so at 32 most questions are read once, at 128 only the longest ones
  free form         PopQA questions, greedy, at most ANSWER_TOKENS tokens, concurrency 8 (decode-bound: the block
                    size should not matter)
Questions/s and tokens/s (medians of the rounds), latency, and the largest option-probability difference between the
two gateways. Results: block_size.json / .md in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.scoring.bench_long_mc import cloze_prompt_tokens  # noqa: E402
from benchmarks.scoring.bench_one_pass import MODEL, ask_all, percentile  # noqa: E402
from calm_core.answers import ANSWER_TOKENS  # noqa: E402
from calm_core.data import load_mc, load_open  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

CONCURRENCY = 8
BLOCKS = (128, 32)


async def answer_all(url: str, questions: list[str], concurrency: int) -> tuple[int, float]:
    """Greedy free-form answers: generated tokens and wall time."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(question: str) -> int:
            async with limit:
                r = await client.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": question}],
                                                  "max_tokens": ANSWER_TOKENS, "temperature": 0})
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(q) for q in questions)))
        return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--per-set", type=int, default=32, help="multiple-choice questions per round from each set")
    parser.add_argument("--free-form", type=int, default=32, help="free-form questions per round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sets = [[q for q in (load_mc(name, split) if split else load_mc(name)) if len(q.choices) == 4]
            for name, split in (("mmlu", "val"), ("arc_challenge", "test"), ("medmcqa", None))]
    rounds_mc = [[q for s in sets for q in s[r * args.per_set:(r + 1) * args.per_set]] for r in range(args.rounds)]
    popqa = [q.question for q in load_open("popqa", "test")]
    rounds_ff = [popqa[r * args.free_form:(r + 1) * args.free_form] for r in range(args.rounds)]
    sizes = cloze_prompt_tokens([q for r in rounds_mc for q in r])
    body = lambda q: {"model": MODEL, "messages": [{"role": "user", "content": q.question}],  # noqa: E731
                      "options": list(q.choices), "calm": {"raw_confidence": False}}
    runs = {b: {"mc": [], "ff": [], "latencies": [], "probs": []} for b in BLOCKS}
    ports = {b: free_port() for b in BLOCKS}
    urls = {b: f"http://127.0.0.1:{ports[b]}" for b in BLOCKS}
    with running(*gateway(BLOCKS[0], ports[BLOCKS[0]], logs)), running(*gateway(BLOCKS[1], ports[BLOCKS[1]], logs)):
        for b in BLOCKS:
            health = httpx.get(f"{urls[b]}/health", headers={"Authorization": "Bearer dev-admin-key"}).json()
            assert health["engine"]["block_size"] == b, health["engine"]
            asyncio.run(ask_all(f"{urls[b]}/v1/chat/completions", [body(q) for q in sets[0][-4:]], 4))  # warm-up
        for r in range(args.rounds):
            for b in BLOCKS if r % 2 == 0 else reversed(BLOCKS):  # alternate who goes first
                probs, latencies, wall = asyncio.run(ask_all(f"{urls[b]}/v1/chat/completions",
                                                             [body(q) for q in rounds_mc[r]], CONCURRENCY))
                tokens, ff_wall = asyncio.run(answer_all(f"{urls[b]}/v1/chat/completions", rounds_ff[r], CONCURRENCY))
                runs[b]["mc"].append(len(rounds_mc[r]) / wall)
                runs[b]["ff"].append(tokens / ff_wall)
                runs[b]["latencies"] += latencies
                runs[b]["probs"] += probs
                print(f"block {b}, round {r}: {len(rounds_mc[r]) / wall:.2f} questions/s, {tokens / ff_wall:.1f} "
                      "free-form tokens/s", flush=True)
    a, b = (runs[x]["probs"] for x in BLOCKS)
    diff = max(abs(x - y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))
    results = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "concurrency": CONCURRENCY,
               "prompt_tokens": {"min": min(sizes), "median": statistics.median(sizes), "max": max(sizes),
                                 "at_least_32": sum(s >= 32 for s in sizes) / len(sizes),
                                 "at_least_128": sum(s >= 128 for s in sizes) / len(sizes)},
               "blocks": {x: {"questions_per_s": statistics.median(runs[x]["mc"]),
                              "p50_ms": 1000 * percentile(runs[x]["latencies"], 0.5),
                              "p90_ms": 1000 * percentile(runs[x]["latencies"], 0.9),
                              "free_form_tokens_per_s": statistics.median(runs[x]["ff"]), "rounds": runs[x]["mc"]}
                          for x in BLOCKS},
               "max_abs_probability_difference": diff}
    (args.out / "block_size.json").write_text(json.dumps(results, indent=2))
    (args.out / "block_size.md").write_text(markdown(results))
    print(markdown(results))


def gateway(block: int, port: int, logs: Path) -> tuple:
    """`running` arguments for a shipped gateway with this block size on this port."""
    env = {"CALM_DB_PATH": str(logs / f"block-{block}.sqlite3"), "CALM_BLOCK_SIZE": str(block)}
    return calm_argv("serve", "--port", str(port)), f"http://127.0.0.1:{port}/health", logs / f"block-{block}.log", env


def markdown(r: dict) -> str:
    p, base = r["prompt_tokens"], r["blocks"][BLOCKS[0]]
    lines = [f"`python benchmarks/engines/bench_block_size.py` (one run): the shipped gateway in-process at two KV-cache block "
             f"sizes, both running, asked the same questions in {r['args']['rounds']} interleaved rounds (medians): "
             f"{3 * r['args']['per_set']} four-option questions per round (MMLU, ARC-Challenge, MedMCQA; cloze prompts "
             f"{p['min']}-{p['max']} tokens, median {p['median']:.0f}; {p['at_least_32']:.0%} fill a 32-token block, "
             f"{p['at_least_128']:.0%} a 128-token one) at concurrency {r['concurrency']}, raw pass off; "
             f"{r['args']['free_form']} PopQA questions per round answered greedily at concurrency {r['concurrency']}.",
             "", "| block size (tokens) | multiple choice questions/s | p50 ms | p90 ms | vs 128 | free-form tokens/s | vs 128 |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for block, x in r["blocks"].items():
        lines.append(f"| {block} | {x['questions_per_s']:.2f} | {x['p50_ms']:.0f} | {x['p90_ms']:.0f} | "
                     f"{x['questions_per_s'] / base['questions_per_s']:.2f} | {x['free_form_tokens_per_s']:.1f} | "
                     f"{x['free_form_tokens_per_s'] / base['free_form_tokens_per_s']:.2f} |")
    lines += ["", f"Largest option-probability difference between the two: {r['max_abs_probability_difference']:.1e}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
