"""`calm serve` (the default: embedded model, shipped artifact, 3 engines) with vLLM's two CPU executors side by side:
"mp" (vLLM's CPU default: each engine core spawns a worker process that runs the model) and "uni" (the model runs in
the engine-core process; our CPU default). Per round and executor, interleaved: seconds from launch to the first 200
on /health, then seconds for 64 ARC-Easy multiple-choice questions at concurrency 8 and the option probabilities
(the two executors must give the same numbers).

    python benchmarks/bench_engine_start.py [--rounds 2]    -> benchmarks/results/engine_start.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from calm_core.data import load_mc  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

EXECUTORS = ("mp", "uni")
SHARED_DATA = REPO.parent / "shared" / "data"


def ask(base: str, q) -> list[float]:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
        "model": "calm-smollm2-135m", "messages": [{"role": "user", "content": q.question}],
        "options": list(q.choices), "calm": {"raw_confidence": False}})
    r.raise_for_status()
    return [o["probability"] for o in r.json()["choices"][0]["calibration"]["options"]]


def one_run(executor: str, questions, work: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"CALM_EXECUTOR": executor, "CALM_DB_PATH": str(work / f"{executor}.sqlite3"), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    with running(calm_argv("serve", "--port", str(port)), f"{base}/health", work / f"{executor}.log", env, timeout=600):
        ready = time.monotonic() - t0
        ask(base, questions[0])  # the first request starts vLLM's output handlers
        t1 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            probabilities = list(pool.map(lambda q: ask(base, q), questions))
        answered = time.monotonic() - t1
    return {"executor": executor, "ready_s": ready, "questions_s": answered, "probabilities": probabilities}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "engine_start")
    args = parser.parse_args()
    questions = load_mc("arc_easy", "test", root=SHARED_DATA)[:64]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for executor in EXECUTORS:
                run = one_run(executor, questions, Path(tmp))
                print(f"round {round_ + 1} {executor}: ready after {run['ready_s']:.1f} s, "
                      f"64 questions in {run['questions_s']:.1f} s", flush=True)
                runs.append(run)
    by = {e: [r for r in runs if r["executor"] == e] for e in EXECUTORS}
    median = {e: {k: statistics.median(r[k] for r in by[e]) for k in ("ready_s", "questions_s")} for e in EXECUTORS}
    diff = max(abs(a - b) for ra, rb in zip(by["mp"], by["uni"])
               for pa, pb in zip(ra["probabilities"], rb["probabilities"]) for a, b in zip(pa, pb))
    summary = {"rounds": args.rounds, "median": median, "max_probability_difference": diff,
               "ready_ratio_uni_over_mp": median["uni"]["ready_s"] / median["mp"]["ready_s"],
               "throughput_ratio_uni_over_mp": median["mp"]["questions_s"] / median["uni"]["questions_s"],
               "runs": [{k: v for k, v in r.items() if k != "probabilities"} for r in runs]}
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    lines = ["# vLLM's CPU executors under `calm serve` (`python benchmarks/bench_engine_start.py`)", "",
             f"The shipped gateway (3 engines), {args.rounds} interleaved rounds, medians; 64 ARC-Easy questions at "
             "concurrency 8, OMP_NUM_THREADS=1.", "",
             "| executor | launch to /health 200 (s) | 64 questions (s) |", "|---|---:|---:|"]
    lines += [f"| {e} | {median[e]['ready_s']:.1f} | {median[e]['questions_s']:.1f} |" for e in EXECUTORS]
    lines += ["", f"Start-up uni / mp: {summary['ready_ratio_uni_over_mp']:.2f}; throughput uni / mp: "
              f"{summary['throughput_ratio_uni_over_mp']:.2f}; largest option-probability difference: {diff:.1e}."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
