"""How much of this machine's memory comes at full speed now. One process takes fresh memory a step at a time (an
anonymous map, every page written once) and times each step, with the kernel and steal time the machine spent
meanwhile; it stops at the first slow step (`--slow` times the fastest step so far, or over `--slow-s-per-gb` seconds
per GB: a machine already past the line is slow from its first step), or before the free memory would fall under
`--keep` GB. In use = MemTotal - MemFree when the step began (page cache included).

    python scripts/memory_ceiling.py [--step-gb 0.5] [--slow 4] [--slow-s-per-gb 2] [--keep 1.5]

Why: the 2-core CI-kind machines are Firecracker VMs (23.5 GiB) that hand memory back to the host: the kernel pages out
page cache idle for a minute (a DAMON `pageout` scheme, /sys/kernel/mm/damon/admin/kdamonds/0) and reports free memory
(virtio-balloon free page reporting, /sys/module/page_reporting/parameters/reported_kib). A page the host no longer
backs costs ~25x to touch (1 GB in ~10 s of kernel and steal time instead of 0.4 s), so how much memory is fast depends
on what the machine has freed lately and on the host, not on MemTotal: 18.7 GB in use after a test-suite run (its page
cache still held), 10.0 GB minutes after `echo 3 > /proc/sys/vm/drop_caches` had freed 20 GB. Every process slows while
it lasts: a gateway's second promotion in benchmarks/engines/bench_hot_swap.py, parts of the test suite.
"""

from __future__ import annotations

import argparse
import mmap
import time
from dataclasses import dataclass
from pathlib import Path

PAGE = mmap.PAGESIZE


def meminfo_mb() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return {line.split(":")[0]: int(line.split()[1]) // 1024 for line in f}


def in_use_gb() -> float:
    """Memory in use now, page cache included (MemTotal - MemFree)."""
    info = meminfo_mb()
    return (info["MemTotal"] - info["MemFree"]) / 1024


def cpu_ticks() -> dict[str, int]:
    """Machine-wide CPU ticks by kind (/proc/stat's first line)."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return {"user": user, "system": system, "steal": steal}


def touch(size: int) -> mmap.mmap:
    block = mmap.mmap(-1, size)
    for offset in range(0, size, PAGE):
        block[offset] = 1
    return block


@dataclass(frozen=True)
class Step:
    size_gb: float
    held_gb: float
    in_use_gb: float  # MemTotal - MemFree when the step began
    seconds: float
    kernel_ticks: int
    steal_ticks: int


@dataclass(frozen=True)
class Probe:
    total_gb: float
    steps: list[Step]
    fast_until_gb: float | None  # in use when the first slow step began; None: no step was slow

    def markdown(self) -> str:
        lines = ["| held (GB) | in use before (GB) | seconds | kernel ticks | steal ticks |",
                 "|---:|---:|---:|---:|---:|"]
        lines += [f"| {s.held_gb:.1f} | {s.in_use_gb:.1f} | {s.seconds:.2f} | {s.kernel_ticks} | {s.steal_ticks} |"
                  for s in self.steps]
        if self.fast_until_gb is not None:
            fastest = min(s.seconds / s.size_gb for s in self.steps)
            last = self.steps[-1].seconds / self.steps[-1].size_gb
            lines += ["", f"full speed up to ~{self.fast_until_gb:.1f} GB in use of {self.total_gb:.1f} GiB: the step "
                          f"from there took {last:.1f} s per GB (the fastest {fastest:.2f})"]
        else:
            lines += ["", "full speed throughout (stopped before the free memory ran low)"]
        return "\n".join(lines)


def is_slow(step: Step, fastest_s_per_gb: float, slow: float, slow_s_per_gb: float) -> bool:
    """A step is slow against the fastest one so far, or on its own: a machine already past the line is slow from its
    first step, and comparing with that step alone would never find the line."""
    s_per_gb = step.seconds / step.size_gb
    return s_per_gb > slow * fastest_s_per_gb or s_per_gb > slow_s_per_gb


def probe(step_gb: float = 0.5, slow: float = 4.0, slow_s_per_gb: float = 2.0, keep_gb: float = 1.5,
          on_step=None) -> Probe:
    """Take memory step by step until a step is slow (`slow` times the fastest so far, or over `slow_s_per_gb`: first
    touches run at ~0.4 s per GB here, 25x that past the line) or the free memory would fall under `keep_gb`; all of
    it is given back on return."""
    step = int(step_gb * 2**30)
    held, steps = [], []
    total = meminfo_mb()["MemTotal"]
    try:
        while meminfo_mb()["MemFree"] - step / 2**20 >= keep_gb * 1024:
            in_use = in_use_gb()
            ticks, started = cpu_ticks(), time.perf_counter()
            held.append(touch(step))
            seconds = time.perf_counter() - started
            spent = {k: v - ticks[k] for k, v in cpu_ticks().items()}
            steps.append(Step(step_gb, len(held) * step_gb, in_use, seconds, spent["system"], spent["steal"]))
            if on_step:
                on_step(steps[-1])
            if is_slow(steps[-1], min(s.seconds / s.size_gb for s in steps), slow, slow_s_per_gb):
                return Probe(total / 1024, steps, in_use)
        return Probe(total / 1024, steps, None)
    finally:
        for block in held:
            block.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-gb", type=float, default=0.5)
    parser.add_argument("--slow", type=float, default=4.0, help="a step this many times the fastest is slow")
    parser.add_argument("--slow-s-per-gb", type=float, default=2.0, help="a step slower than this per GB is slow")
    parser.add_argument("--keep", type=float, default=1.5, help="GB of free memory never taken")
    args = parser.parse_args()
    reported = Path("/sys/module/page_reporting/parameters/reported_kib")
    reporting = f"; free pages reported to the host so far: {int(reported.read_text()) / 2**20:.0f} GB" \
        if reported.is_file() else ""
    print(f"MemTotal {meminfo_mb()['MemTotal'] / 1024:.1f} GiB; steps of {args.step_gb} GB{reporting}", flush=True)
    result = probe(args.step_gb, args.slow, args.slow_s_per_gb, args.keep,
                   on_step=lambda s: print(f"  {s.held_gb:.1f} GB held: {s.seconds:.2f} s", flush=True))
    print("\n" + result.markdown())


if __name__ == "__main__":
    main()
