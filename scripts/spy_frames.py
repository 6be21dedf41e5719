"""Where a py-spy recording of a test run spent its CPU: seconds per kind of process, and the seconds whose stack holds
each named frame (a function name, matched as text), per kind of process.

    OMP_NUM_THREADS=1 CALM_HOME=$PWD/.calm HF_HUB_OFFLINE=1 .venv/bin/py-spy record --subprocesses --nonblocking \\
        --format raw --rate 10 -o /tmp/suite.raw -- .venv/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder
    python scripts/spy_frames.py /tmp/suite.raw --rate 10 --frame create_default_context --frame _parse_smaps_rollup

(scripts/test.sh's own steps before pytest are left out: under py-spy, its first command ends the recording.) A sample
is one thread's stack at one moment, so a process's seconds are its busy threads' (py-spy records idle threads only
with --idle). Found this way (2026-12-07): the pytest workers built an SSL context per test HTTP call (79 CPU s of a
run) and read PSS every 10 s (58 CPU s).
"""

from __future__ import annotations

import argparse
import collections
import re

KINDS = (("pytest worker", "python -u -c import sys"), ("calm serve", "calm_cli serve"),
         ("calm worker", "calm_cli worker"), ("calm eval", "calm_cli eval"), ("calm engine", "calm_cli engine"),
         ("engine server", "forkserver"), ("engine server", "spawn_main"))


def kind_of(process: str) -> str:
    return next((kind for kind, text in KINDS if text in process), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", help="py-spy's --format raw output")
    parser.add_argument("--rate", type=float, default=10.0, help="the recording's samples per second")
    parser.add_argument("--frame", action="append", default=[], help="a function name to count (repeatable)")
    args = parser.parse_args()
    total, framed = collections.Counter(), {frame: collections.Counter() for frame in args.frame}
    for line in open(args.raw):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        processes = [f for f in frames if f.startswith("process ")]
        kind = kind_of(processes[-1]) if processes else "other"
        total[kind] += int(count)
        for frame in args.frame:
            if any(re.match(rf"([\w.<>]*\.)?{re.escape(frame)} \(", f) for f in frames):
                framed[frame][kind] += int(count)
    print(f"{'CPU s':>8}  kind of process" + "".join(f"  {frame}" for frame in args.frame))
    for kind, samples in total.most_common():
        print(f"{samples / args.rate:8.1f}  {kind:15s}" + "".join(f"  {framed[f][kind] / args.rate:.1f}" for f in args.frame))


if __name__ == "__main__":
    main()
