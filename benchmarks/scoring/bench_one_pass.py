"""One-pass against per-token cloze scoring of multiple choice, side by side in one run (gateway in-process).

    python benchmarks/scoring/bench_one_pass.py --out benchmarks/results

The shipped artifact (cloze, scalar head, LoRA adapter) answers the same MedMCQA and MMLU questions at concurrency 8,
raw-model pass off, served two ways:
  per-token  one engine request per option token through the α-head logits processor (CALM_ONE_PASS_SCORING=false);
  one-pass   one request per option on weights with the head folded into the LM head, read from prompt log-probs.
Both gateways are asked the same questions; the table gives throughput, latency and the largest difference between
their option probabilities. Results: one_pass.json / .md in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from calm_core.data import load_mc  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

MODEL = "calm-smollm2-135m"
CONCURRENCY = 8


async def ask_all(url: str, bodies: list[dict], concurrency: int) -> tuple[list[list[float]], list[float], float]:
    """Every body answered (option probabilities, latency each) and the wall time."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(body):
            async with limit:
                start = time.perf_counter()
                r = await client.post(url, json=body)
                r.raise_for_status()
                options = r.json()["choices"][0]["calibration"]["options"]
                return [o["probability"] for o in options], time.perf_counter() - start

        start = time.perf_counter()
        done = await asyncio.gather(*(one(b) for b in bodies))
        return [p for p, _ in done], [t for _, t in done], time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--per-set", type=int, default=32, help="questions from each of MedMCQA and MMLU")
    args = parser.parse_args()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    questions = load_mc("medmcqa")[: args.per_set] + load_mc("mmlu", "val")[: args.per_set]
    bodies = [{"model": MODEL, "messages": [{"role": "user", "content": q.question}], "options": list(q.choices),
               "calm": {"raw_confidence": False}} for q in questions]
    results: dict = {"questions": len(questions), "concurrency": CONCURRENCY, "paths": {}}
    probs = {}
    for name, one_pass in (("per-token", "false"), ("one-pass", "true")):
        port = free_port()
        env = {"CALM_DB_PATH": str(logs / f"one-pass-{name}.sqlite3"), "CALM_ONE_PASS_SCORING": one_pass}
        with running(calm_argv("serve", "--port", str(port)), f"http://127.0.0.1:{port}/health",
                     logs / f"one-pass-{name}.log", env=env, timeout=300):
            health = httpx.get(f"http://127.0.0.1:{port}/health", headers={"Authorization": "Bearer dev-admin-key"}).json()
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            asyncio.run(ask_all(url, bodies[:4], 4))  # warm-up
            probs[name], latencies, wall = asyncio.run(ask_all(url, bodies, CONCURRENCY))
        results["paths"][name] = {"scoring": health["scoring"]["multiple_choice"], "rps": len(bodies) / wall,
                                  "p50_ms": 1000 * percentile(latencies, 0.5), "p90_ms": 1000 * percentile(latencies, 0.9)}
        print(f"{name}: {results['paths'][name]}", flush=True)
    diff = max(abs(a - b) for pa, pb in zip(probs["per-token"], probs["one-pass"]) for a, b in zip(pa, pb))
    results["max_abs_probability_difference"] = diff
    base = results["paths"]["per-token"]["rps"]
    lines = ["| multiple-choice scoring | questions/s | p50 ms | p90 ms | throughput vs per-token |", "|---|---|---|---|---|"]
    for name, r in results["paths"].items():
        lines.append(f"| {name}: {r['scoring']} | {r['rps']:.2f} | {r['p50_ms']:.0f} | {r['p90_ms']:.0f} | "
                     f"{r['rps'] / base:.2f} |")
    lines.append(f"\n{len(questions)} questions (MedMCQA and MMLU, {args.per_set} each), concurrency {CONCURRENCY}, raw "
                 f"pass off; largest option-probability difference between the two paths: {diff:.1e}.")
    (args.out / "one_pass.json").write_text(json.dumps(results, indent=2))
    (args.out / "one_pass.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
