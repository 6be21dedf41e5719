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


def sample(root: psutil.Process, seen: dict) -> None:
    for proc in [root, *root.children(recursive=True)]:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                row = seen.setdefault((proc.pid, proc.create_time()), {
                    "command": " ".join(proc.cmdline())[:300], "started": proc.create_time()})
                row["cpu_s"], row["last_seen"] = times.user + times.system, time.time()
        except psutil.Error:  # ended meanwhile
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="the rows as JSON")
    parser.add_argument("--min-cpu-s", type=float, default=2.0, help="rows with less CPU are summed, not listed")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    proc = subprocess.Popen(command)
    root, seen = psutil.Process(proc.pid), {}
    while proc.poll() is None:
        sample(root, seen)
        time.sleep(1.0)
    rows = sorted(seen.values(), key=lambda r: r["started"])
    t0 = rows[0]["started"] if rows else time.time()
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
