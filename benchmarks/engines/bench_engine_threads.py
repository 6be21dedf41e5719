"""OpenMP threads of in-process engines, side by side: the shipped gateway (`calm serve`, its three CPU engines) with
- the cores shared step by step (the default: each engine re-sizes its team before every step to its share among the
  engines computing at that moment, adapters/hosting/core_share.py);
- the cores split among its engines, fixed (CALM_ENGINE_THREADS = cores // 3: the default before core sharing);
- every engine a fixed team as wide as the machine (CALM_ENGINE_THREADS = the cores), waiting passively at barriers
  (what the gateway sets for fixed teams that outnumber the cores: `engine_wait_policy`);
- the same spinning first as libgomp does by default (GOMP_SPINCOUNT=300000, its documented default): what every
  engine ran before the split, torch's own team size, as no OMP_NUM_THREADS was set.

No way sets OMP_NUM_THREADS (the benchmark removes it, as a plain `make serve` has none). Per round and way,
interleaved, three workloads, each timed and charged the gateway's process-tree CPU seconds it used:
- multiple choice: 32 MedMCQA and 32 MMLU questions, 8 at a time, as a client sends them (raw confidence on), and
  again with the raw pass off (`calm.raw_confidence: false`: one engine computes instead of two);
- free form: 32 PopQA questions as chat, greedy, at most 32 tokens, 8 at a time;
- mixed: both at once (the multiple-choice questions 8 at a time beside the free-form ones 8 at a time).
Every way must give the same answers (the option probabilities to 1e-4, the same free-form text).

    python benchmarks/engines/bench_engine_threads.py [--rounds 2]   -> benchmarks/results/engine_threads.{json,md}
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from adapters.hosting.cpu_limits import usable_cpus  # noqa: E402
from benchmarks.engines.bench_stock_engine import timed  # noqa: E402
from calm_core.data import load_mc, load_open  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

SHARED_DATA = REPO.parent / "shared" / "data"
OUT = REPO / "benchmarks" / "results" / "engine_threads"
MODEL = "calm-smollm2-135m"
FREE_TOKENS, CONCURRENCY = 32, 8
WIDE = {"CALM_ENGINE_THREADS": str(usable_cpus())}
WAYS = {"shared step by step (default)": {}, "split, fixed": {"CALM_ENGINE_THREADS": str(max(1, usable_cpus() // 3))},
        "machine-wide, passive wait": WIDE, "machine-wide, spinning": {**WIDE, "GOMP_SPINCOUNT": "300000"}}


def option_probabilities(base: str, question, raw: bool = True) -> list[float]:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
        "model": MODEL, "messages": [{"role": "user", "content": question.question}],
        "options": list(question.choices), "calm": {"raw_confidence": raw}})
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
        engine = httpx.get(f"{base}/health", headers={"Authorization": "Bearer dev-admin-key"}).json()["engine"]
        threads = engine["threads"] or "1-" + str(engine["core_share"]["cpus"])  # shared: a team per step
        policy = engine["omp_wait_policy"] or "libgomp default"
        option_probabilities(base, mc[0]), free_answer(base, ff[0])  # warm-up
        mc_s, mc_cpu, probabilities = timed(proc.pid, CONCURRENCY, lambda q: option_probabilities(base, q), mc)
        lone_s, lone_cpu, lone_probabilities = timed(proc.pid, CONCURRENCY,
                                                     lambda q: option_probabilities(base, q, raw=False), mc)
        ff_s, ff_cpu, answers = timed(proc.pid, CONCURRENCY, lambda q: free_answer(base, q), ff)
        mixed_s, mixed_cpu, [(mixed_probabilities, mixed_answers)] = timed(proc.pid, 1, lambda _: mixed(base, mc, ff),
                                                                          [None])
    return {"way": way, "threads": threads, "wait_policy": policy, "mc_s": mc_s, "mc_cpu_s": mc_cpu,
            "lone_s": lone_s, "lone_cpu_s": lone_cpu, "ff_s": ff_s, "ff_cpu_s": ff_cpu,
            "ff_tokens": sum(n for _, n in answers), "mixed_s": mixed_s, "mixed_cpu_s": mixed_cpu,
            "mixed_ff_tokens": sum(n for _, n in mixed_answers),
            "probabilities": probabilities + lone_probabilities + mixed_probabilities,
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
                print(f"round {round_ + 1} {way}: {run['threads']} thread(s) per engine ({run['wait_policy']}); "
                      f"multiple choice "
                      f"{run['mc_s']:.1f} s ({run['mc_cpu_s']:.1f} CPU s); raw pass off {run['lone_s']:.1f} s "
                      f"({run['lone_cpu_s']:.1f} CPU s); free form {run['ff_s']:.1f} s "
                      f"({run['ff_cpu_s']:.1f} CPU s); mixed {run['mixed_s']:.1f} s ({run['mixed_cpu_s']:.1f} CPU s)",
                      flush=True)
                runs.append(run)
    keys = ("mc_s", "mc_cpu_s", "lone_s", "lone_cpu_s", "ff_s", "ff_cpu_s", "ff_tokens", "mixed_s",
            "mixed_cpu_s", "mixed_ff_tokens")
    by = {w: [r for r in runs if r["way"] == w] for w in WAYS}
    median = {w: {k: statistics.median(r[k] for r in by[w]) for k in keys} for w in WAYS}
    pairs = [(shared, other) for shared, *others in zip(*by.values()) for other in others]  # each way vs the default
    diff = max(abs(x - y) for a, b in pairs for pa, pb in zip(a["probabilities"], b["probabilities"])
               for x, y in zip(pa, pb))
    same = min(sum(x == y for x, y in zip(a["answers"], b["answers"])) for a, b in pairs)
    policies = {w: by[w][0]["wait_policy"] for w in WAYS}
    threads = {w: by[w][0]["threads"] for w in WAYS}
    summary = {"rounds": args.rounds, "cpus": usable_cpus(), "questions": {"multiple_choice": len(mc),
               "free_form": len(ff)}, "median": median, "wait_policy": policies, "threads": threads,
               "max_probability_difference": diff,
               "same_free_form_answers": same, "free_form_answers": 2 * len(ff),
               "runs": [{k: v for k, v in r.items() if k not in ("probabilities", "answers")} for r in runs]}
    OUT.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    OUT.with_suffix(".md").write_text(markdown(summary))
    print(markdown(summary))


def markdown(summary: dict) -> str:
    n_mc, n_ff = summary["questions"]["multiple_choice"], summary["questions"]["free_form"]
    shared = summary["median"]["shared step by step (default)"]
    lines = [f"`python benchmarks/engines/bench_engine_threads.py` (one run): the shipped gateway in-process "
             f"({summary['cpus']} usable cores, no OMP_NUM_THREADS), its engines' OpenMP threads set each way, "
             f"{summary['rounds']} interleaved rounds (medians); CPU is the gateway's process tree. Multiple choice: "
             f"{n_mc} MedMCQA and MMLU questions, {CONCURRENCY} at a time, raw confidence on, and with the raw pass "
             f"off (one engine computes); free form: {n_ff} PopQA questions, greedy, at most {FREE_TOKENS} tokens, "
             f"{CONCURRENCY} at a time; mixed: both at once.", "",
             "| OpenMP threads | per engine | wait | multiple choice q/s | its CPU (s) | raw pass off: q/s "
             "| its CPU (s) | free form tokens/s | its CPU (s) | mixed: q/s | tokens/s | its CPU (s) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for way, m in summary["median"].items():
        lines.append(f"| {way} | {summary['threads'][way]} | {summary['wait_policy'][way]} | {n_mc / m['mc_s']:.2f} | "
                     f"{m['mc_cpu_s']:.1f} | {n_mc / m['lone_s']:.2f} | {m['lone_cpu_s']:.1f} | "
                     f"{m['ff_tokens'] / m['ff_s']:.1f} | {m['ff_cpu_s']:.1f} | "
                     f"{n_mc / m['mixed_s']:.2f} | {m['mixed_ff_tokens'] / m['mixed_s']:.1f} | "
                     f"{m['mixed_cpu_s']:.1f} |")
    lines.append("")
    for way, m in summary["median"].items():
        if m is shared:
            continue
        lines.append(f"shared / {way}: multiple choice {m['mc_s'] / shared['mc_s']:.2f}x the questions/s at "
                     f"{shared['mc_cpu_s'] / m['mc_cpu_s']:.2f}x the CPU; raw pass off "
                     f"{m['lone_s'] / shared['lone_s']:.2f}x "
                     f"at {shared['lone_cpu_s'] / m['lone_cpu_s']:.2f}x the CPU; free form "
                     f"{(shared['ff_tokens'] / shared['ff_s']) / (m['ff_tokens'] / m['ff_s']):.2f}x the tokens/s at "
                     f"{shared['ff_cpu_s'] / m['ff_cpu_s']:.2f}x the CPU; mixed "
                     f"{m['mixed_s'] / shared['mixed_s']:.2f}x "
                     f"the pace at {shared['mixed_cpu_s'] / m['mixed_cpu_s']:.2f}x the CPU.")
    lines += ["", "Largest option-probability difference from the default "
              f"{summary['max_probability_difference']:.1e}; "
              f"the same free-form answer in {summary['same_free_form_answers']} of {summary['free_form_answers']} "
              "(each way's round against the default's)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
