"""Load suite: many concurrent clients against the gateway on the embedded model, then the checks that matter under
load. One command:

    python benchmarks/load/load_suite.py --users 200 --duration 120 --out benchmarks/results     # docs/configuration.md's run
    python benchmarks/load/load_suite.py --users 20 --duration 20 --out /tmp/load                 # CI's quick form

1. `calm serve` starts (in-process vLLM, the shipped artifact, a fresh SQLite database).
2. Locust (benchmarks/load/locustfile.py) runs `--users` clients for `--duration` seconds: multiple choice, short free-form
   answers, feedback on their own answers, and now and then a policy change through the admin API.
3. Checks: every answer was a 200 or a 429; every feedback and policy write the clients saw acknowledged is in the
   database (counted back); the gateway's memory (its process and its engine processes) after warm-up and at the end.
Results: load.json and load.md in --out (latency percentiles and throughput per request kind, from Locust's stats).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from calm_core.data import load_mc  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402


def questions(n: int = 200) -> list[dict]:
    """Science and medicine questions (bundled or shared data), as the clients send them."""
    out = []
    for dataset, domain in (("arc_easy", "science"), ("medmcqa", "medicine")):
        for q in load_mc(dataset)[: n // 2]:
            out.append({"question": q.question, "choices": list(q.choices)[:4], "domain": domain})
    return out


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """Resident memory in MiB of the gateway process itself and of all its children (the vLLM engine processes)."""
    try:
        root = psutil.Process(pid)
        children = root.children(recursive=True)
        own = root.memory_info().rss
    except psutil.NoSuchProcess:
        return float("nan"), float("nan")
    engines = 0
    for p in children:
        try:
            engines += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return own / 2**20, engines / 2**20


def sample_memory(pid: int, every_s: float, stop: threading.Event, out: list) -> None:
    """(seconds, total MiB, gateway process MiB, engine processes MiB) every `every_s`."""
    start = time.monotonic()
    while not stop.wait(every_s):
        own, engines = tree_rss_mb(pid)
        out.append((round(time.monotonic() - start, 1), round(own + engines, 1), round(own, 1), round(engines, 1)))


def read_stats(prefix: Path) -> dict[str, dict]:
    rows = {}
    with open(f"{prefix}_stats.csv") as f:
        for row in csv.DictReader(f):
            rows[row["Name"]] = {"requests": int(row["Request Count"]), "failures": int(row["Failure Count"]),
                                 "p50_ms": float(row["50%"]), "p99_ms": float(row["99%"]),
                                 "rps": float(row["Requests/s"])}
    return rows


def run(users: int, duration: int, out: Path, warmup_s: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    # The gateway's database, registry, logs and Locust's CSVs: a scratch folder (only load.json / load.md are results).
    work = Path(tempfile.mkdtemp(prefix="calm-load-"))
    (work / "questions.json").write_text(json.dumps(questions()))
    db = work / "gateway.sqlite3"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The policy writes go to a domain of their own, which requests may name (a policy elsewhere would be refused).
    env = {"CALM_DB_PATH": str(db), "CALM_REGISTRY_DIR": str(work / "registry"), "CALM_DOMAINS": '["load"]'}
    with running(calm_argv("serve", "--port", str(port)), f"{url}/health", work / "gateway.log", env) as gateway:
        samples: list = []
        stop = threading.Event()
        # Every 2 s: the quick form's 10 s after warm-up still give the memory check 5 samples to compare.
        sampler = threading.Thread(target=sample_memory, args=(gateway.pid, 2.0, stop, samples), daemon=True)
        sampler.start()
        locust_env = {**os.environ, "LOAD_QUESTIONS": str(work / "questions.json"), "LOAD_COUNTS": str(work / "counts.json")}
        argv = [sys.executable, "-m", "locust", "-f", str(REPO / "benchmarks" / "load" / "locustfile.py"), "--headless",
                "--users", str(users), "--spawn-rate", str(max(users // 10, 1)), "--run-time", f"{duration}s",
                "--host", url, "--csv", str(work / "locust"), "--only-summary", "--stop-timeout", "60"]
        started = time.monotonic()
        proc = subprocess.run(argv, env=locust_env, capture_output=True, text=True, cwd=REPO)
        elapsed = time.monotonic() - started
        stop.set()
        sampler.join()
        stats = read_stats(work / "locust")
        counts = json.loads((work / "counts.json").read_text())
        from gateway.records.store import Store

        store = Store(db)
        with store.engine.connect() as c:
            feedback_rows = c.exec_driver_sql("SELECT count(*) FROM feedback").scalar()
        policy = store.get_policy("load")
        audit = len(store.audit_log("load", 100000))
        store.close()
    warm = [total for t, total, _, _ in samples if t >= warmup_s]
    own = [g for t, _, g, _ in samples if t >= warmup_s]
    result = {
        "users": users, "duration_s": duration, "wall_s": round(elapsed, 1), "locust_exit": proc.returncode,
        "stats": stats, "feedback_acknowledged": counts["feedback"], "feedback_rows": feedback_rows,
        "policy_puts_acknowledged": counts["policy_puts"], "policy_version": policy[1] if policy else 0,
        "policy_audit_entries": audit,
        "rss_mb_after_warmup": warm[0] if warm else None, "rss_mb_end": warm[-1] if warm else None,
        "rss_mb_max": max(warm) if warm else None, "memory_samples": samples, "work_dir": str(work),
        "gateway_process_mb_after_warmup": own[0] if own else None, "gateway_process_mb_end": own[-1] if own else None,
    }
    result["checks"] = {
        "only 200 and 429": all(s["failures"] == 0 for s in stats.values()),
        "feedback counted back": counts["feedback"] == feedback_rows,
        "policy writes counted back": counts["policy_puts"] == result["policy_version"] == audit,
        # The gateway's own process: where a leak of ours (per request state kept) would show. The engine processes
        # are reported beside it (vLLM's allocator grows with the batch shapes it has seen; see docs/configuration.md).
        # What it can see is bounded by the run: at least 3 samples after warm-up (fewer would compare a sample with
        # itself), and a growth over 5% + 20 MiB within the run; a slow leak needs the long form's hours of requests.
        f"gateway process memory: the last of {len(own)} samples after warm-up within 5% + 20 MiB of the first "
        f"(at least 3 samples)": len(own) >= 3 and own[-1] <= 1.05 * own[0] + 20,
    }
    (out / "load.json").write_text(json.dumps(result, indent=1))
    (out / "load.md").write_text(markdown(result))
    if proc.returncode not in (0, 1):  # locust exits 1 when a request failed; that is reported by the checks
        raise RuntimeError(f"locust failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return result


def markdown(r: dict) -> str:
    lines = [f"{r['users']} clients for {r['duration_s']} s against `calm serve` on the embedded model (2-core CPU, "
             "in-process vLLM, shipped artifact)", "",
             "| request | count | failures | requests/s | p50 ms | p99 ms |", "|---|---|---|---|---|---|"]
    for name, s in r["stats"].items():
        lines.append(f"| {name} | {s['requests']} | {s['failures']} | {s['rps']:.2f} | {s['p50_ms']:.0f} | {s['p99_ms']:.0f} |")
    lines += ["", f"Feedback acknowledged {r['feedback_acknowledged']}, rows in the database {r['feedback_rows']}; "
              f"policy writes acknowledged {r['policy_puts_acknowledged']}, policy version {r['policy_version']}, "
              f"audit entries {r['policy_audit_entries']}.",
              f"Gateway memory (process + engines): {r['rss_mb_after_warmup']} MiB after warm-up, {r['rss_mb_end']} MiB "
              f"at the end, {r['rss_mb_max']} MiB at most; the gateway process alone {r['gateway_process_mb_after_warmup']} "
              f"→ {r['gateway_process_mb_end']} MiB.", ""]
    lines += [f"- {name}: {'pass' if ok else 'FAIL'}" for name, ok in r["checks"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--duration", type=int, default=120)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before memory counts as warmed up")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    result = run(args.users, args.duration, args.out, args.warmup)
    print((args.out / "load.md").read_text())
    sys.exit(0 if all(result["checks"].values()) else 1)


if __name__ == "__main__":
    main()
