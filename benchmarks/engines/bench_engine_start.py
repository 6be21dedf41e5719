"""`calm serve` (the default: embedded model, shipped artifact, 3 engines) started two ways side by side.

`--compare executor`: vLLM's two CPU executors, "mp" (vLLM's CPU default: each engine core spawns a worker process
that runs the model) and "uni" (the model runs in the engine-core process; our CPU default).
`--compare start`: how the engine-core processes start (both "uni"), "spawn" (vLLM's CPU default: a fresh interpreter
per engine) and "forkserver" (forked from one server that imported vLLM once; our CPU default).
`--compare answers`: CALM_ANSWERS "all" (the default: the free-form mode's engine too) and "multiple_choice" (no engine
for free form; a free-form request is refused with a 400, checked here).
`--compare revision --revision REV`: the same gateway from a worktree of commit REV and from this checkout (a change to
how engines start, measured side by side: e.g. the engine cores' frozen heap, REV c65772a).

Per round and way, interleaved: seconds from launch to the first 200 on /health and the CPU seconds the gateway's
process tree had used by then, the tree's CPU and memory (PSS) once one multiple-choice answer is served, the share of
a core it uses idle over the next 30 s (the engines' background threads), then seconds for 64 ARC-Easy multiple-choice
questions at concurrency 8, the tree's CPU and memory after them, the engines /health
names, and the option probabilities (both ways must give the same numbers).

    python benchmarks/engines/bench_engine_start.py [--compare executor|start|answers] [--rounds 2] [--omp-threads ""]
        -> benchmarks/results/engine_start.{json,md} (executor), engine_start_forkserver.{json,md} (start),
           engine_start_answers.{json,md} (answers), engine_start_revision.{json,md} (revision)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from calm_core.data import load_mc  # noqa: E402
from tests.memory_budget import tree_cpu_s, tree_pss_gb  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

# The ways compared: name -> the gateway's environment for it.
WAYS = {"executor": {"mp": {"CALM_EXECUTOR": "mp"}, "uni": {"CALM_EXECUTOR": "uni"}},
        "start": {"spawn": {"CALM_ENGINE_START": "spawn"}, "forkserver": {"CALM_ENGINE_START": "forkserver"}},
        "answers": {"all": {"CALM_ANSWERS": "all"}, "multiple_choice": {"CALM_ANSWERS": "multiple_choice"}}}
OUT = {"executor": "engine_start", "start": "engine_start_forkserver", "answers": "engine_start_answers",
       "revision": "engine_start_revision"}
ADMIN = {"Authorization": "Bearer dev-admin-key"}  # /health names the engines to the admin only
IDLE_S = 30


def ask(base: str, q) -> list[float]:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
        "model": "calm-smollm2-135m", "messages": [{"role": "user", "content": q.question}],
        "options": list(q.choices), "calm": {"raw_confidence": False}})
    r.raise_for_status()
    return [o["probability"] for o in r.json()["choices"][0]["calibration"]["options"]]


def one_run(way: str, env: dict, questions, work: Path, cwd: Path = REPO, omp_threads: str = "1") -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # "" is unset to OpenMP and to the gateway (its engines then share the cores step by step, as under `make serve`)
    env = {**env, "CALM_DB_PATH": str(work / f"{way}.sqlite3"), "OMP_NUM_THREADS": omp_threads}
    t0 = time.monotonic()
    with running(calm_argv("serve", "--port", str(port)), f"{base}/health", work / f"{way}.log", env,
                 timeout=600, cwd=cwd) as proc:  # `python -m calm_cli` runs the code of the folder it starts in
        # User + system CPU of the gateway and its live processes (none of them has ended by then).
        ready, ready_cpu = time.monotonic() - t0, sum(tree_cpu_s(proc.pid).values())
        ask(base, questions[0])  # the first request starts vLLM's output handlers
        first_cpu, first_pss = sum(tree_cpu_s(proc.pid).values()), tree_pss_gb(proc.pid)
        time.sleep(5)  # then idle: what the gateway and its engines use while nothing is asked
        before, t_idle = sum(tree_cpu_s(proc.pid).values()), time.monotonic()
        time.sleep(IDLE_S)
        idle_core_pct = 100 * (sum(tree_cpu_s(proc.pid).values()) - before) / (time.monotonic() - t_idle)
        t1 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            probabilities = list(pool.map(lambda q: ask(base, q), questions))
        answered = time.monotonic() - t1
        cpu, pss = sum(tree_cpu_s(proc.pid).values()), tree_pss_gb(proc.pid)
        engines = httpx.get(f"{base}/health", headers=ADMIN, timeout=30).json()["engine"]["engines"]
        started = next(line.strip() for line in (work / f"{way}.log").read_text().splitlines() if "vLLM engines" in line)
        # Last, so that a free-form answer's work is in none of the numbers above.
        free_form = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
            "model": "calm-smollm2-135m", "max_tokens": 1, "messages": [{"role": "user", "content": "Say yes."}]})
    return {"way": way, "ready_s": ready, "ready_cpu_s": ready_cpu, "first_answer_cpu_s": first_cpu,
            "first_answer_pss_gb": first_pss, "idle_core_pct": idle_core_pct, "questions_s": answered, "cpu_s": cpu,
            "pss_gb": pss, "engines": engines,
            "start_line": started,
            "free_form_status": free_form.status_code, "free_form_error": free_form.json().get("error"),
            "probabilities": probabilities}


def checkout_state() -> str:
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                             check=True).stdout.strip()
    return f"{head} with uncommitted changes" if changed else head


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compare", choices=sorted([*WAYS, "revision"]), default="executor")
    parser.add_argument("--revision", help="with --compare revision: the commit to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--omp-threads", default="1", help='OMP_NUM_THREADS of the gateways; "" leaves it unset, as '
                                                          "`make serve` does (the suite sets 1)")
    args = parser.parse_args()
    if (args.compare == "revision") != (args.revision is not None):
        parser.error("--revision goes with --compare revision, and only there")
    out = args.out or REPO / "benchmarks" / "results" / OUT[args.compare]
    questions = load_mc("arc_easy", "test")[:64]  # from $CALM_DATA_DIR, else the checkout's ../shared/data
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.compare == "revision":
            old = Path(tmp) / "worktree"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), args.revision], check=True,
                           capture_output=True)
            ways, folders = {args.revision: {}, "checkout": {}}, {args.revision: old}
        else:
            ways, folders = WAYS[args.compare], {}
        (a, b) = ways  # the default of vLLM's CPU platform (or the older commit), then ours
        try:
            for round_ in range(args.rounds):
                for way, env in ways.items():
                    run = one_run(way, env, questions, Path(tmp), folders.get(way, REPO), args.omp_threads)
                    print(f"round {round_ + 1} {way}: ready after {run['ready_s']:.1f} s "
                          f"({run['ready_cpu_s']:.1f} CPU s), "
                          f"one answer: {run['first_answer_cpu_s']:.1f} CPU s, {run['first_answer_pss_gb']:.2f} GB; "
                          f"idle: {run['idle_core_pct']:.2f} % of a core; "
                          f"64 questions in {run['questions_s']:.1f} s, {run['cpu_s']:.1f} CPU s, "
                          f"{run['pss_gb']:.2f} GB; engines {', '.join(run['engines'])}; "
                          f"free form: {run['free_form_status']}\n  {run['start_line']}",
                          flush=True)
                    runs.append(run)
        finally:
            if folders:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
    keys = ("ready_s", "ready_cpu_s", "first_answer_cpu_s", "first_answer_pss_gb", "idle_core_pct", "questions_s",
            "cpu_s", "pss_gb")
    by = {w: [r for r in runs if r["way"] == w] for w in ways}
    median = {w: {k: statistics.median(r[k] for r in by[w]) for k in keys} for w in ways}
    diff = max(abs(x - y) for ra, rb in zip(by[a], by[b])
               for pa, pb in zip(ra["probabilities"], rb["probabilities"]) for x, y in zip(pa, pb))
    summary = {"compare": args.compare, "rounds": args.rounds, "median": median, "max_probability_difference": diff,
               f"ready_ratio_{b}_over_{a}": median[b]["ready_s"] / median[a]["ready_s"],
               f"ready_cpu_ratio_{b}_over_{a}": median[b]["ready_cpu_s"] / median[a]["ready_cpu_s"],
               f"throughput_ratio_{b}_over_{a}": median[a]["questions_s"] / median[b]["questions_s"],
               "runs": [{k: v for k, v in r.items() if k != "probabilities"} for r in runs]}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    what = {"executor": "vLLM's CPU executors", "start": "How engine-core processes start",
            "answers": "The answers a gateway serves (CALM_ANSWERS)",
            "revision": f"The same gateway at commit {a} and in this checkout ({checkout_state()})"}[args.compare]
    omp_note = (f"OMP_NUM_THREADS={args.omp_threads}" if args.omp_threads
                else "no OMP_NUM_THREADS (as `make serve`: the engines share the cores step by step)")
    lines = [f"# {what} under `calm serve` (`python benchmarks/engines/bench_engine_start.py --compare {args.compare}`)", "",
             f"The shipped gateway, {args.rounds} interleaved rounds, medians; 64 ARC-Easy questions at "
             f"concurrency 8, {omp_note}. CPU: the gateway's process tree from launch (user + system); memory: "
             "its PSS.", "",
             f"| {args.compare} | engines | launch to /health 200 (s) | CPU by then (s) | CPU, one answer served (s) | "
             f"PSS then (GB) | idle, then {IDLE_S} s (% of a core) | 64 questions (s) | CPU after them (s) | "
             "PSS after them (GB) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {w} | {', '.join(by[w][0]['engines'])} | {m['ready_s']:.1f} | {m['ready_cpu_s']:.1f} | "
              f"{m['first_answer_cpu_s']:.1f} | {m['first_answer_pss_gb']:.2f} | {m['idle_core_pct']:.2f} | "
              f"{m['questions_s']:.1f} | "
              f"{m['cpu_s']:.1f} | {m['pss_gb']:.2f} |" for w, m in median.items()]
    lines += ["", "A free-form request (1 token): " + "; ".join(
        f"{w} {by[w][0]['free_form_status']}" + (f" ({by[w][0]['free_form_error']['code']})"
                                                 if by[w][0]["free_form_error"] else "") for w in ways) + "."]
    lines += ["", f"Start-up {b} / {a}: {summary[f'ready_ratio_{b}_over_{a}']:.2f} (CPU "
              f"{summary[f'ready_cpu_ratio_{b}_over_{a}']:.2f}); throughput {b} / {a}: "
              f"{summary[f'throughput_ratio_{b}_over_{a}']:.2f}; largest option-probability difference: {diff:.1e}."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
