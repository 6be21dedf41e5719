"""The fleet's stock vLLM engine on CPU, started two ways side by side: as vLLM's CPU platform runs it by default
("mp": it replaces `--distributed-executor-backend uni` by a worker process per engine, and the engine core polls
that worker's shared-memory queue while it computes) and with VLLM_ENABLE_V1_MULTIPROCESSING=0, which keeps "uni"
(the model runs in the engine-core process; `calm serve` and `calm engine` already run this way).

The engine is the fleet's (tests/fleet.py: the same flags and plugins), on the embedded model. Per round and way,
interleaved: seconds from launch to /health 200 and the process tree's CPU seconds by then; then two workloads, each
timed and charged the tree's CPU seconds it used:
- free form: 48 PopQA questions as chat, 32 tokens each (EOS ignored, so both ways generate the same number), 4 at a
  time, with the chosen tokens' log-probs;
- options: 32 MMLU questions x 4 options, each a one-token request for the top 20 log-probs after the question and
  the option (what token-by-token option scoring sends upstream), 8 at a time.
Both ways must give the same tokens and log-probs.

    python benchmarks/engines/bench_stock_engine.py [--rounds 2]   -> benchmarks/results/stock_engine.{json,md}
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
import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from calm_core.data import load_mc, load_open  # noqa: E402
from calm_core.models import resolve_model  # noqa: E402
from tests.fleet import ENGINE_ENV, MODEL, engine_argv  # noqa: E402
from tests.memory_budget import cpu_used_s, tree_cpu_s  # noqa: E402
from tests.servers import free_port, running  # noqa: E402

SHARED_DATA = REPO.parent / "shared" / "data"
OUT = REPO / "benchmarks" / "results" / "stock_engine"
# vLLM's CPU default, then the fleet's: the only difference is the single-process switch.
WAYS = {"mp": {**ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "uni": ENGINE_ENV}
FREE_TOKENS = 32


def free_form(base: str, question: str) -> list[tuple[str, float]]:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=600, json={
        "model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": FREE_TOKENS,
        "temperature": 0, "ignore_eos": True, "logprobs": True})
    r.raise_for_status()
    return [(t["token"], t["logprob"]) for t in r.json()["choices"][0]["logprobs"]["content"]]


def option(base: str, prompt: str) -> list[float]:
    """One step of token-by-token option scoring: the next token's top log-probs after a prompt (prompt log-probs
    would crash an engine with LoRA enabled in mixed batches: docs/engines.md, "In-process and upstream")."""
    r = httpx.post(f"{base}/v1/completions", timeout=600, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 20})
    r.raise_for_status()
    return sorted(r.json()["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True)


def timed(pid: int, concurrency: int, fn, items: list) -> tuple[float, float, list]:
    cpu0, t0 = tree_cpu_s(pid), time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(fn, items))
    return time.monotonic() - t0, cpu_used_s(cpu0, tree_cpu_s(pid)), results


def one_run(way: str, model_dir: Path, questions: list[str], prompts: list[str], work: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**WAYS[way], "OMP_NUM_THREADS": "1", "CALM_REGISTRY_DIR": str(work / "registry"), "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    with running(engine_argv(model_dir, port), f"{base}/health", work / f"{way}.log", env, timeout=600) as proc:
        ready, ready_cpu = time.monotonic() - t0, sum(tree_cpu_s(proc.pid).values())
        processes = 1 + len(psutil.Process(proc.pid).children(recursive=True))
        free_form(base, questions[0])  # the first request starts the server's output handling
        ff_s, ff_cpu, tokens = timed(proc.pid, 4, lambda q: free_form(base, q), questions)
        opt_s, opt_cpu, logprobs = timed(proc.pid, 8, lambda p: option(base, p), prompts)
    return {"way": way, "processes": processes, "ready_s": ready, "ready_cpu_s": ready_cpu,
            "free_form_s": ff_s, "free_form_cpu_s": ff_cpu, "options_s": opt_s, "options_cpu_s": opt_cpu,
            "tokens": tokens, "option_logprobs": logprobs}


def largest_difference(a: dict, b: dict) -> tuple[bool, float]:
    same_tokens = all([t for t, _ in x] == [t for t, _ in y] for x, y in zip(a["tokens"], b["tokens"]))
    diffs = [abs(p - q) for x, y in zip(a["tokens"], b["tokens"]) for (_, p), (_, q) in zip(x, y)]
    diffs += [abs(p - q) for x, y in zip(a["option_logprobs"], b["option_logprobs"]) for p, q in zip(x, y)]
    return same_tokens, max(diffs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model_dir = resolve_model(None).path
    questions = [q.question for q in load_open("popqa", "test", root=SHARED_DATA)[:48]]
    prompts = [f"{q.question}\nAnswer: {choice}" for q in load_mc("mmlu", "test", root=SHARED_DATA)[:32]
               for choice in q.choices]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "registry").mkdir()
        for round_ in range(args.rounds):
            for way in WAYS:
                run = one_run(way, model_dir, questions, prompts, Path(tmp))
                print(f"round {round_ + 1} {way}: {run['processes']} processes, ready after {run['ready_s']:.1f} s "
                      f"({run['ready_cpu_s']:.1f} CPU s); free form {run['free_form_s']:.1f} s "
                      f"({run['free_form_cpu_s']:.1f} CPU s); options {run['options_s']:.1f} s "
                      f"({run['options_cpu_s']:.1f} CPU s)", flush=True)
                runs.append(run)
    keys = ("processes", "ready_s", "ready_cpu_s", "free_form_s", "free_form_cpu_s", "options_s", "options_cpu_s")
    by = {w: [r for r in runs if r["way"] == w] for w in WAYS}
    median = {w: {k: statistics.median(r[k] for r in by[w]) for k in keys} for w in WAYS}
    checks = [largest_difference(a, b) for a, b in zip(by["mp"], by["uni"])]
    same_tokens, diff = all(s for s, _ in checks), max(d for _, d in checks)
    n_tokens = len(questions) * FREE_TOKENS
    ratio = {k: median["uni"][k] / median["mp"][k] for k in keys if k != "processes"}
    summary = {"rounds": args.rounds, "median": median, "uni_over_mp": ratio, "same_tokens": same_tokens,
               "max_logprob_difference": diff, "free_form_tokens": n_tokens, "option_requests": len(prompts),
               "runs": [{k: v for k, v in r.items() if k not in ("tokens", "option_logprobs")} for r in runs]}
    OUT.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    OUT.with_suffix(".md").write_text(markdown(summary))
    print(markdown(summary))


def markdown(summary: dict) -> str:
    median, ratio, n_tokens = summary["median"], summary["uni_over_mp"], summary["free_form_tokens"]
    lines = [f"`python benchmarks/engines/bench_stock_engine.py` (one run): the engine of tests/fleet.py on the embedded model, "
             f"started each way in {summary['rounds']} interleaved rounds (medians), OMP_NUM_THREADS=1; CPU is the "
             f"engine's process tree. Free form: 48 PopQA questions as chat, {FREE_TOKENS} tokens each ({n_tokens} in "
             f"all), 4 at a time; options: {summary['option_requests']} one-token requests for the top 20 log-probs "
             "(32 MMLU questions x 4 options), 8 at a time.", "",
             "| executor | processes | launch to /health 200 (s) | CPU by then (s) | free form (s) | its CPU (s) | "
             "CPU per token (ms) | options (s) | their CPU (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w, m in median.items():
        lines.append(f"| {w} | {m['processes']:.0f} | {m['ready_s']:.1f} | {m['ready_cpu_s']:.1f} | "
                     f"{m['free_form_s']:.1f} | {m['free_form_cpu_s']:.1f} | "
                     f"{1000 * m['free_form_cpu_s'] / n_tokens:.1f} | {m['options_s']:.1f} | {m['options_cpu_s']:.1f} |")
    lines += ["", f"uni / mp: start-up {ratio['ready_s']:.2f} (CPU {ratio['ready_cpu_s']:.2f}); free form time "
              f"{ratio['free_form_s']:.2f}, CPU {ratio['free_form_cpu_s']:.2f}; options time {ratio['options_s']:.2f}, "
              f"CPU {ratio['options_cpu_s']:.2f}. Same tokens: {'yes' if summary['same_tokens'] else 'NO'}; largest "
              f"log-prob difference {summary['max_logprob_difference']:.1e}."]
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
