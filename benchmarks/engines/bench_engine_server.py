"""`calm engine` on CPU, two ways side by side in one run: its memory allocator (glibc, or tcmalloc preloaded), or its
KV-cache block size (vLLM's CPU default of 128 tokens, or 32, the prefix cache's unit).

A gateway in upstream mode sends every request through the served version's LoRA adapter (vLLM run-time LoRA) and
names its head, so the engine runs vLLM's CPU LoRA kernels on every step, and scores options token by token: a request
per option token, each re-reading the question. Per round and way (interleaved): `calm engine` as a user starts it (no
OMP_NUM_THREADS: its team is every core) with the way's setting, a gateway in front of it (`calm serve`,
CALM_ENGINE=upstream), then through the gateway:
- multiple choice: MMLU questions with their four options, 8 at a time, raw confidence on (the default);
- free form: PopQA questions, greedy, at most 24 tokens, 4 at a time.
Each workload is timed and charged the engine's user and kernel CPU seconds and minor page faults (its process tree).
Both ways must give the same answers and option probabilities.

    python benchmarks/engines/bench_engine_server.py --compare allocator   -> benchmarks/results/engine_allocator.{json,md}
    python benchmarks/engines/bench_engine_server.py --compare block-size  -> benchmarks/results/engine_block_size.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from adapters.hosting.allocator import tcmalloc_library  # noqa: E402
from calm_core.data import load_mc, load_open  # noqa: E402
from tests.memory_budget import stat_fields  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

SHARED_DATA = REPO.parent / "shared" / "data"
RESULTS = REPO / "benchmarks" / "results"
# Per comparison: the baseline way first, each way's engine environment, and what the ways vary.
COMPARISONS = {
    "allocator": ({"system": {"CALM_ENGINE_ALLOCATOR": "system", "CALM_BLOCK_SIZE": "128"},
                   "tcmalloc": {"CALM_ENGINE_ALLOCATOR": "tcmalloc", "CALM_BLOCK_SIZE": "128"}}, "allocator"),
    "block-size": ({"128": {"CALM_BLOCK_SIZE": "128"}, "32": {"CALM_BLOCK_SIZE": "32"}}, "block size (tokens)"),
}
FREE_TOKENS = 24
MODEL = "calm-smollm2-135m"


def engine_usage(pid: int) -> dict[str, float]:
    """User and kernel CPU seconds and minor page faults of the process tree so far (/proc/PID/stat)."""
    total, ticks = {"user_s": 0.0, "system_s": 0.0, "minor_faults": 0.0}, os.sysconf("SC_CLK_TCK")
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            fields = stat_fields(proc.pid)
        except OSError:
            continue
        total["minor_faults"] += int(fields[7])
        total["user_s"] += int(fields[11]) / ticks
        total["system_s"] += int(fields[12]) / ticks
    return total


def timed(pid: int, concurrency: int, fn, items: list) -> tuple[dict, list]:
    before, t0 = engine_usage(pid), time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(fn, items))
    after = engine_usage(pid)
    return {"s": time.monotonic() - t0, **{k: after[k] - before[k] for k in after}}, results


def chat(base: str, body: dict) -> dict:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=900, json={"model": MODEL, "temperature": 0, **body})
    r.raise_for_status()
    return r.json()["choices"][0]


def multiple_choice(base: str, question) -> list[float]:
    choice = chat(base, {"messages": [{"role": "user", "content": question.question}], "options": question.choices})
    return [o["probability"] for o in choice["calibration"]["options"]]


def free_form(base: str, question: str) -> tuple[str, float]:
    choice = chat(base, {"messages": [{"role": "user", "content": question}], "max_tokens": FREE_TOKENS})
    return choice["message"]["content"], choice["calibration"]["confidence"]


def one_run(way: str, way_env: dict, questions: list, open_questions: list[str], work: Path) -> dict:
    engine_port, gateway_port = free_port(), free_port()
    registry = {"CALM_REGISTRY_DIR": str(work / "registry"), "HF_HUB_OFFLINE": "1"}
    engine_env = {**registry, **way_env}
    gateway_env = {**registry, "CALM_ENGINE": "upstream", "CALM_UPSTREAM_URLS": f'["http://127.0.0.1:{engine_port}"]',
                   "CALM_UPSTREAM_TIMEOUT_S": "900", "CALM_DB_PATH": str(work / f"{way}.db")}
    base = f"http://127.0.0.1:{gateway_port}"
    with running(calm_argv("engine", "--port", str(engine_port)), f"http://127.0.0.1:{engine_port}/health",
                 work / f"engine-{way}.log", engine_env, timeout=600) as engine, \
         running(calm_argv("serve", "--port", str(gateway_port)), f"{base}/health/ready", work / f"gateway-{way}.log",
                 gateway_env, timeout=600):
        preloaded = "tcmalloc" in Path(f"/proc/{engine.pid}/maps").read_text()
        multiple_choice(base, questions[0])  # loads the version's adapter
        mc, probabilities = timed(engine.pid, 8, lambda q: multiple_choice(base, q), questions)
        ff, answers = timed(engine.pid, 4, lambda q: free_form(base, q), open_questions)
    return {"way": way, "tcmalloc_mapped": preloaded, "multiple_choice": mc, "free_form": ff,
            "probabilities": probabilities, "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compare", choices=sorted(COMPARISONS), required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--questions", type=int, default=8, help="per workload")
    args = parser.parse_args()
    os.environ.pop("OMP_NUM_THREADS", None)  # the engine's team: every core, as a user starts it
    if tcmalloc_library() is None:
        sys.exit("tcmalloc is not installed (Debian: apt-get install libtcmalloc-minimal4)")
    questions = load_mc("mmlu", "test", root=SHARED_DATA)[:args.questions]
    open_questions = [q.question for q in load_open("popqa", "test", root=SHARED_DATA)[:args.questions]]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        ways, _ = COMPARISONS[args.compare]
        for round_ in range(args.rounds):
            for way, way_env in ways.items():
                run = one_run(way, way_env, questions, open_questions, Path(tmp))
                print(f"round {round_ + 1} {way}: multiple choice {run['multiple_choice']['s']:.1f} s, free form "
                      f"{run['free_form']['s']:.1f} s (tcmalloc mapped: {run['tcmalloc_mapped']})", flush=True)
                runs.append(run)
    summary = summarise(runs, args)
    out = RESULTS / f"engine_{args.compare.replace('-', '_')}"
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    out.with_suffix(".md").write_text(markdown(summary))
    print(markdown(summary))


def summarise(runs: list[dict], args) -> dict:
    ways = list(COMPARISONS[args.compare][0])
    by = {w: [r for r in runs if r["way"] == w] for w in ways}
    keys = ("s", "user_s", "system_s", "minor_faults")
    median = {w: {work: {k: statistics.median(r[work][k] for r in by[w]) for k in keys}
                  for work in ("multiple_choice", "free_form")} for w in ways}
    reference = by[ways[0]][0]
    diff = max(abs(p - q) for r in runs for a, b in zip(r["probabilities"], reference["probabilities"])
               for p, q in zip(a, b))
    same_answers = all([a for a, _ in r["answers"]] == [a for a, _ in reference["answers"]] for r in runs)
    confidence_diff = max(abs(c - d) for r in runs for (_, c), (_, d) in zip(r["answers"], reference["answers"]))
    return {"compare": args.compare, "ways": ways, "rounds": args.rounds, "questions": args.questions,
            "free_tokens": FREE_TOKENS, "median": median,
            "tcmalloc_mapped": {w: [r["tcmalloc_mapped"] for r in by[w]] for w in ways},
            "max_probability_difference": diff, "same_answers": same_answers,
            "max_confidence_difference": confidence_diff,
            "runs": [{k: v for k, v in r.items() if k not in ("probabilities", "answers")} for r in runs]}


def markdown(summary: dict) -> str:
    median, n, (first, second) = summary["median"], summary["questions"], summary["ways"]
    varied = COMPARISONS[summary["compare"]][1]
    lines = [f"`python benchmarks/engines/bench_engine_server.py --compare {summary['compare']}` (one run): `calm engine` on "
             f"CPU (every core, as a user starts it) behind a gateway in upstream mode, each way in "
             f"{summary['rounds']} interleaved rounds (medians); every request through the shipped version's "
             f"run-time LoRA adapter, options scored token by token. Multiple choice: {n} MMLU questions, four "
             f"options, 8 at a time, raw confidence on; free form: {n} PopQA questions, greedy, at most "
             f"{summary['free_tokens']} tokens, 4 at a time. CPU and page faults are the engine's process tree.", "",
             f"| {varied} | workload | time (s) | user CPU (s) | kernel CPU (s) | minor page faults per second |",
             "|---|---|---:|---:|---:|---:|"]
    for way in (first, second):
        for work, label in (("multiple_choice", "multiple choice"), ("free_form", "free form")):
            m = median[way][work]
            lines.append(f"| {way} | {label} | {m['s']:.1f} | {m['user_s']:.1f} | {m['system_s']:.1f} | "
                         f"{m['minor_faults'] / m['s']:,.0f} |")
    ratio = {w: median[first][w]["s"] / median[second][w]["s"] for w in ("multiple_choice", "free_form")}
    mapped = "; ".join(f"{w} {summary['tcmalloc_mapped'][w]}" for w in (first, second))
    lines += ["", f"{varied} {second} against {first}: multiple choice {ratio['multiple_choice']:.2f}x as fast, "
              f"free form {ratio['free_form']:.2f}x. Largest option-probability difference "
              f"{summary['max_probability_difference']:.1e}; the same free-form answers: "
              f"{'yes' if summary['same_answers'] else 'NO'} (largest confidence difference "
              f"{summary['max_confidence_difference']:.1e}). tcmalloc in the engine's memory map, per round: {mapped}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
