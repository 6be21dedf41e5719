"""Run a command and say which of its processes used the CPU: every process of its tree sampled once a second, then a
table of each one's CPU seconds, lifetime and command line (the last second of a process that ends between two
samples is not counted).

    python scripts/process_cpu.py --out /tmp/ffl.json -- .venv/bin/pytest -q tests/test_retrain_loop_free_form.py

Where a slow test's CPU goes on the 2-core machines, where both cores are busy and CPU is what a file costs the run:
the gateway, its engine cores (forked from its forkserver), the worker and its judging engines, each on its own row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.memory_budget import tree_cpu_s  # noqa: E402


def sample(pid: int, seen: dict) -> None:
    """Each process's CPU so far (`tests/memory_budget.tree_cpu_s`, as the test runs' CPU table counts it), with its
    command line the first time it is seen."""
    for (proc_pid, started), cpu_s in tree_cpu_s(pid).items():
        row = seen.get((proc_pid, started))
        if row is None:
            try:
                proc = psutil.Process(proc_pid)
                command, parent = " ".join(proc.cmdline()).replace("\n", " ")[:300], proc.ppid()
            except psutil.Error:  # ended meanwhile
                continue
            row = seen[(proc_pid, started)] = {"command": command, "started": started, "pid": proc_pid,
                                               "ppid": parent}
        row["cpu_s"], row["last_seen"] = cpu_s, time.clock_gettime(time.CLOCK_BOOTTIME)  # the clock of `started`


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the rows as JSON")
    parser.add_argument("--min-cpu-s", type=float, default=2.0, help="rows with less CPU are summed, not listed")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    proc = subprocess.Popen(command)
    seen: dict = {}
    while proc.poll() is None:
        sample(proc.pid, seen)
        time.sleep(1.0)
    rows = sorted(seen.values(), key=lambda r: r["started"])
    t0 = rows[0]["started"] if rows else 0.0
    print(f"\n{sum(r['cpu_s'] for r in rows):.0f} CPU s in {len(rows)} processes; exit {proc.returncode}")
    print("| started (s) | lived (s) | CPU (s) | command |\n|---:|---:|---:|---|")
    for r in rows:
        if r["cpu_s"] >= args.min_cpu_s:
            print(f"| {r['started'] - t0:.0f} | {r['last_seen'] - r['started']:.0f} | {r['cpu_s']:.1f} | "
                  f"`{r['command'][:120]}` |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
