"""How fast the shipped gateway's free-form engine answers at different client concurrencies, in one run.

    python benchmarks/scoring/bench_free_form_batching.py --out benchmarks/results

PopQA questions answered greedily through the gateway (at most ANSWER_TOKENS tokens, token confidence, as the
retraining loop's traffic and labels are), `--questions` per round at each concurrency, the concurrencies interleaved
over `--rounds` rounds; at the `--raw-at` concurrencies also with raw confidence asked for (`calm.raw_confidence`: a
second prefill of prompt + answer per answer, off by default). Generated tokens per second and the engine's CPU
seconds per answer (its process, from /proc). Results: free_form_batching.json / .md in --out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from calm_core.answers import ANSWER_TOKENS  # noqa: E402
from calm_core.data import load_open  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

MODEL = "calm-smollm2-135m"


def variant_name(variant: tuple[int, bool]) -> str:
    concurrency, raw = variant
    return f"{concurrency}{' raw' if raw else ''}"


def cpu_by_process(pid: int) -> dict[psutil.Process, float]:
    return {p: sum(p.cpu_times()[:2]) for p in psutil.Process(pid).children(recursive=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--raw-at", type=int, nargs="*", default=[32], help="concurrencies also run with raw confidence")
    args = parser.parse_args()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    questions = [q.question for q in load_open("popqa", "test")]
    random.Random(1).shuffle(questions)
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    def ask(question: str, raw: bool = False) -> int:
        r = httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
            "model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": ANSWER_TOKENS,
            "temperature": 0, "calm": {"raw_confidence": raw}})
        r.raise_for_status()
        assert (r.json()["choices"][0]["calibration"]["raw_confidence"] is not None) == raw
        return r.json()["usage"]["completion_tokens"]

    variants = [(c, False) for c in args.concurrency] + [(c, True) for c in args.raw_at]
    runs: dict[tuple[int, bool], list[dict]] = {v: [] for v in variants}
    with running(calm_argv("serve", "--port", str(port)), f"{base}/health", logs / "free-form-batching.log") as proc:
        before = cpu_by_process(proc.pid)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(ask, questions[:8]))  # warm-up
        after = cpu_by_process(proc.pid)  # the free-form engine core: the process the warm-up's answers kept busy
        engine = max(after, key=lambda p: after[p] - before.get(p, 0.0))
        offset = 8
        for _ in range(args.rounds):
            for c, raw in variants:
                batch, offset = questions[offset:offset + args.questions], offset + args.questions
                cpu0, t0 = sum(engine.cpu_times()[:2]), time.perf_counter()
                with ThreadPoolExecutor(c) as pool:
                    tokens = sum(pool.map(lambda q: ask(q, raw), batch))
                seconds, cpu = time.perf_counter() - t0, sum(engine.cpu_times()[:2]) - cpu0
                runs[c, raw].append({"seconds": seconds, "tokens": tokens, "engine_cpu_s": cpu})
                print(f"concurrency {variant_name((c, raw))}: {len(batch)} answers, {tokens} tokens in {seconds:.1f} s",
                      flush=True)
    rows = {v: {"tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in rs),
                "engine_cpu_s_per_answer": statistics.median(r["engine_cpu_s"] / args.questions for r in rs),
                "tokens_per_answer": statistics.median(r["tokens"] / args.questions for r in rs)}
            for v, rs in runs.items()}
    first = variants[0]
    (args.out / "free_form_batching.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
        "runs": {variant_name(v): r for v, r in runs.items()}, "medians": {variant_name(v): r for v, r in rows.items()}}, indent=1))
    lines = [f"`python benchmarks/scoring/bench_free_form_batching.py` (one run): free-form answers through the shipped gateway, "
             f"{args.questions} PopQA questions per round and client concurrency, {args.rounds} interleaved rounds, "
             f"medians; greedy, at most {ANSWER_TOKENS} tokens; the engine's CPU from its process.", "",
             "| concurrency | raw confidence | tokens/s | engine CPU s per answer | tokens per answer | tokens/s vs "
             f"{first[0]} |", "|---:|---|---:|---:|---:|---:|"]
    for (c, raw), r in rows.items():
        lines.append(f"| {c} | {'asked' if raw else 'off (default)'} | {r['tokens_per_s']:.1f} | "
                     f"{r['engine_cpu_s_per_answer']:.2f} | {r['tokens_per_answer']:.1f} | "
                     f"{r['tokens_per_s'] / rows[first]['tokens_per_s']:.2f} |")
    (args.out / "free_form_batching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
