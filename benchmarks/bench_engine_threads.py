"""OpenMP threads per in-process engine, side by side: the shipped gateway (`calm serve`, its three CPU engines) with
the usable cores split among its engines (the default: adapters/engine_settings.py `engine_threads`) and with every
engine a team as wide as the machine (CALM_ENGINE_THREADS = the usable cores: what each engine ran before, torch's
own default, as no OMP_NUM_THREADS was set).

Neither way sets OMP_NUM_THREADS (the benchmark removes it, as a plain `make serve` has none). Per round and way,
interleaved, three workloads, each timed and charged the gateway's process-tree CPU seconds it used:
- multiple choice: 32 MedMCQA and 32 MMLU questions, 8 at a time, as a client sends them (raw confidence on);
- free form: 32 PopQA questions as chat, greedy, at most 32 tokens, 8 at a time;
- mixed: both at once (the multiple-choice questions 8 at a time beside the free-form ones 8 at a time).
Both ways must give the same answers (the option probabilities to 1e-4, the same free-form text).

    python benchmarks/bench_engine_threads.py [--rounds 2]   -> benchmarks/results/engine_threads.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from adapters.cpu_limits import usable_cpus  # noqa: E402
from benchmarks.bench_stock_engine import timed  # noqa: E402
from calm_core.data import load_mc, load_open  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

SHARED_DATA = REPO.parent / "shared" / "data"
OUT = REPO / "benchmarks" / "results" / "engine_threads"
MODEL = "calm-smollm2-135m"
FREE_TOKENS, CONCURRENCY = 32, 8
WAYS = {"split (default)": {}, "machine-wide (before)": {"CALM_ENGINE_THREADS": str(usable_cpus())}}


def option_probabilities(base: str, question) -> list[float]:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
        "model": MODEL, "messages": [{"role": "user", "content": question.question}],
        "options": list(question.choices)})
    r.raise_for_status()
    return [o["probability"] for o in r.json()["choices"][0]["calibration"]["options"]]


def free_answer(base: str, question) -> tuple[str, int]:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
        "model": MODEL, "messages": [{"role": "user", "content": question.question}], "max_tokens": FREE_TOKENS,
        "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]


def mixed(base: str, mc: list, ff: list) -> tuple[list, list]:
    """The multiple-choice questions and the free-form ones at once, each CONCURRENCY at a time."""
    with ThreadPoolExecutor(CONCURRENCY) as mc_pool, ThreadPoolExecutor(CONCURRENCY) as ff_pool:
        options = mc_pool.map(lambda q: option_probabilities(base, q), mc)
        answers = ff_pool.map(lambda q: free_answer(base, q), ff)
        return list(options), list(answers)


def one_run(way: str, mc: list, ff: list, work: Path, index: int) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**WAYS[way], "CALM_DB_PATH": str(work / f"gateway-{index}.sqlite3")}
    with running(calm_argv("serve", "--port", str(port)), f"{base}/health/ready", work / f"gateway-{index}.log", env,
                 timeout=600) as proc:
        threads = httpx.get(f"{base}/health").json()["engine"]["threads"]
        option_probabilities(base, mc[0]), free_answer(base, ff[0])  # warm-up
        mc_s, mc_cpu, probabilities = timed(proc.pid, CONCURRENCY, lambda q: option_probabilities(base, q), mc)
        ff_s, ff_cpu, answers = timed(proc.pid, CONCURRENCY, lambda q: free_answer(base, q), ff)
        mixed_s, mixed_cpu, [(mixed_probabilities, mixed_answers)] = timed(proc.pid, 1, lambda _: mixed(base, mc, ff),
                                                                          [None])
    return {"way": way, "threads": threads, "mc_s": mc_s, "mc_cpu_s": mc_cpu, "ff_s": ff_s, "ff_cpu_s": ff_cpu,
            "ff_tokens": sum(n for _, n in answers), "mixed_s": mixed_s, "mixed_cpu_s": mixed_cpu,
            "mixed_ff_tokens": sum(n for _, n in mixed_answers), "probabilities": probabilities + mixed_probabilities,
            "answers": [a for a, _ in answers + mixed_answers]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.pop("OMP_NUM_THREADS", None)  # as a plain `make serve` runs
    mc = load_mc("medmcqa", root=SHARED_DATA)[:32] + load_mc("mmlu", "val", root=SHARED_DATA)[:32]
    ff = load_open("popqa", "test", root=SHARED_DATA)[:32]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for way in WAYS:
                run = one_run(way, mc, ff, Path(tmp), len(runs))
                print(f"round {round_ + 1} {way}: {run['threads']} thread(s) per engine; multiple choice "
                      f"{run['mc_s']:.1f} s ({run['mc_cpu_s']:.1f} CPU s); free form {run['ff_s']:.1f} s "
                      f"({run['ff_cpu_s']:.1f} CPU s); mixed {run['mixed_s']:.1f} s ({run['mixed_cpu_s']:.1f} CPU s)",
                      flush=True)
                runs.append(run)
    keys = ("threads", "mc_s", "mc_cpu_s", "ff_s", "ff_cpu_s", "ff_tokens", "mixed_s", "mixed_cpu_s",
            "mixed_ff_tokens")
    by = {w: [r for r in runs if r["way"] == w] for w in WAYS}
    median = {w: {k: statistics.median(r[k] for r in by[w]) for k in keys} for w in WAYS}
    pairs = list(zip(*by.values()))
    diff = max(abs(x - y) for a, b in pairs for pa, pb in zip(a["probabilities"], b["probabilities"])
               for x, y in zip(pa, pb))
    same = min(sum(x == y for x, y in zip(a["answers"], b["answers"])) for a, b in pairs)
    summary = {"rounds": args.rounds, "cpus": usable_cpus(), "questions": {"multiple_choice": len(mc),
               "free_form": len(ff)}, "median": median, "max_probability_difference": diff,
               "same_free_form_answers": same, "free_form_answers": 2 * len(ff),
               "runs": [{k: v for k, v in r.items() if k not in ("probabilities", "answers")} for r in runs]}
    OUT.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    OUT.with_suffix(".md").write_text(markdown(summary))
    print(markdown(summary))


def markdown(summary: dict) -> str:
    n_mc, n_ff = summary["questions"]["multiple_choice"], summary["questions"]["free_form"]
    split, wide = summary["median"].values()
    lines = [f"`python benchmarks/bench_engine_threads.py` (one run): the shipped gateway in-process "
             f"({summary['cpus']} usable cores, no OMP_NUM_THREADS), its engines' OpenMP threads set each way, "
             f"{summary['rounds']} interleaved rounds (medians); CPU is the gateway's process tree. Multiple choice: {n_mc} MedMCQA and "
             f"MMLU questions, {CONCURRENCY} at a time, raw confidence on; free form: {n_ff} PopQA questions, greedy, "
             f"at most {FREE_TOKENS} tokens, {CONCURRENCY} at a time; mixed: both at once.", "",
             "| OpenMP threads | per engine | multiple choice q/s | its CPU (s) | free form tokens/s | its CPU (s) | "
             "mixed: q/s | tokens/s | its CPU (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for way, m in summary["median"].items():
        lines.append(f"| {way} | {m['threads']:.0f} | {n_mc / m['mc_s']:.2f} | {m['mc_cpu_s']:.1f} | "
                     f"{m['ff_tokens'] / m['ff_s']:.1f} | {m['ff_cpu_s']:.1f} | {n_mc / m['mixed_s']:.2f} | "
                     f"{m['mixed_ff_tokens'] / m['mixed_s']:.1f} | {m['mixed_cpu_s']:.1f} |")
    lines += ["", f"split / machine-wide: multiple choice {wide['mc_s'] / split['mc_s']:.2f}x the questions/s at "
              f"{split['mc_cpu_s'] / wide['mc_cpu_s']:.2f}x the CPU; free form "
              f"{(split['ff_tokens'] / split['ff_s']) / (wide['ff_tokens'] / wide['ff_s']):.2f}x the tokens/s at "
              f"{split['ff_cpu_s'] / wide['ff_cpu_s']:.2f}x the CPU; mixed {wide['mixed_s'] / split['mixed_s']:.2f}x "
              f"the pace at {split['mixed_cpu_s'] / wide['mixed_cpu_s']:.2f}x the CPU. Largest option-probability "
              f"difference {summary['max_probability_difference']:.1e}; the same free-form answer in "
              f"{summary['same_free_form_answers']} of {summary['free_form_answers']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
