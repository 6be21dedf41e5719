"""What semantic confidence costs next to a greedy answer with token confidence, in one run (gateway in-process).

    python benchmarks/scoring/bench_free_form.py --out benchmarks/results

The shipped gateway answers the same TriviaQA questions one at a time (concurrency 1, 24 tokens at most, raw pass
off): token confidence (one greedy answer) and semantic confidence with n = 8 samples in one engine call. Results:
free_form.json / .md in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from calm_core.data import load_open  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

MODEL = "calm-smollm2-135m"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    questions = [q.question for q in load_open("triviaqa")[: args.questions]]
    modes = {"token": {"confidence": "token"},
             f"semantic n={args.samples}": {"confidence": "semantic", "samples": args.samples}}
    latencies: dict[str, list[float]] = {m: [] for m in modes}
    port = free_port()
    with running(calm_argv("serve", "--port", str(port)), f"http://127.0.0.1:{port}/health", logs / "free-form.log",
                 env={"CALM_DB_PATH": str(logs / "free-form.sqlite3")}, timeout=300):
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        with httpx.Client(timeout=300) as client:
            def ask(question: str, calm: dict) -> float:
                start = time.perf_counter()
                r = client.post(url, json={"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": question}],
                                           "calm": {**calm, "raw_confidence": False}})
                r.raise_for_status()
                return time.perf_counter() - start

            ask(questions[0], modes["token"])  # warm-up
            for question in questions:  # interleaved: both modes see the same machine state
                for mode, calm in modes.items():
                    latencies[mode].append(ask(question, calm))
    base = statistics.median(latencies["token"])
    rows = {m: {"p50_ms": 1000 * statistics.median(v), "mean_ms": 1000 * statistics.mean(v),
                "ratio_p50": statistics.median(v) / base} for m, v in latencies.items()}
    lines = ["| free-form confidence | p50 ms | mean ms | p50 vs token |", "|---|---|---|---|"]
    lines += [f"| {m} | {r['p50_ms']:.0f} | {r['mean_ms']:.0f} | {r['ratio_p50']:.2f} |" for m, r in rows.items()]
    lines.append(f"\n{len(questions)} TriviaQA questions, concurrency 1, max 24 tokens, raw pass off, shipped gateway "
                 "(free form through the shipped artifact's free-form mode).")
    (args.out / "free_form.json").write_text(json.dumps({"questions": len(questions), "modes": rows}, indent=2))
    (args.out / "free_form.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
