"""A memory budget shared by pytest-xdist's workers, for test modules whose stacks take a large part of the machine.

Two workers run two files at a time. A few files start whole stacks: the free-form loop's gateway holds four vLLM
engines at its end while its worker has had two more; the default gateway's file runs `calm eval` offline (one more
engine) beside a gateway with three. Each engine of the embedded model is ~1.9 GB (imports 0.46, fp32 weights 0.54, KV
cache, the rest), so two such files together need most of a 24 GiB machine: in CI's run of 42181d1 they failed at one
moment (an engine died, a request stalled past 300 s). A module marked `memory_gb(N)` (its peak as measured: every run
prints each file's peak, `PeakMemory`) starts only when N fits beside what the marked modules running on other workers
declared; otherwise it waits until one of them ends. tests/conftest.py orders the files so that this rarely happens: the largest marked file first, beside
unmarked ones, the other marked files last.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

# Left for the operating system and pytest's controller. With two workers an unmarked module runs beside at most one
# marked module (the largest unmarked files, the load and fuzz suites, peaked at 8.0 GB: beside the free-form loop's
# 12 they fit), so the marks alone decide which marked modules may run together.
RESERVE_GB = 2.5


def machine_capacity_gb(reserve_gb: float = RESERVE_GB) -> float:
    """What the marked modules may declare together: the machine's memory less the reserve (CALM_TEST_MEMORY_GB
    overrides, e.g. for a machine shared with something else)."""
    if os.environ.get("CALM_TEST_MEMORY_GB"):
        return float(os.environ["CALM_TEST_MEMORY_GB"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return total - reserve_gb


@dataclass(frozen=True)
class MemoryBudget:
    ledger: Path  # JSON {holder: {"pid", "gb"}}, beside a lock file; one per test run
    capacity_gb: float

    @contextmanager
    def _locked(self) -> Iterator[dict]:
        with open(self.ledger.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                held = json.loads(self.ledger.read_text()) if self.ledger.is_file() else {}
                # A worker that died (killed by pytest-timeout, a crash) leaves no claim behind.
                held = {h: c for h, c in held.items() if psutil.pid_exists(c["pid"])}
                yield held
                self.ledger.write_text(json.dumps(held))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def try_acquire(self, holder: str, gb: float) -> dict | None:
        """Claim `gb` if it fits beside the other claims (or if there are none: a module larger than the whole budget
        still runs, alone). Returns None on success, else the claims in the way."""
        with self._locked() as held:
            others = {h: c for h, c in held.items() if h != holder}
            if others and sum(c["gb"] for c in others.values()) + gb > self.capacity_gb:
                return others
            held[holder] = {"pid": os.getpid(), "gb": gb}
            return None

    def acquire(self, holder: str, gb: float, on_wait: Callable[[dict], None] = lambda held: None,
                poll_s: float = 1.0) -> float:
        """Claim `gb`, waiting while it does not fit. Returns the seconds waited."""
        started = time.monotonic()
        in_the_way = self.try_acquire(holder, gb)
        if in_the_way is not None:
            on_wait(in_the_way)
        while in_the_way is not None:
            time.sleep(poll_s)  # the ledger changes when another worker's module ends; nothing else to wait on
            in_the_way = self.try_acquire(holder, gb)
        return time.monotonic() - started

    def release(self, holder: str) -> None:
        with self._locked() as held:
            held.pop(holder, None)


def tree_pss_gb(pid: int | None = None) -> float:
    """Proportional set size of a process and its descendants (shared pages split among their users, so the sum over
    processes is what they take together). Not cheap: the kernel walks each process's page tables, ~20 ms of CPU per
    vLLM process."""
    total = 0
    for proc in _tree(pid):
        try:
            total += proc.memory_full_info().pss
        except psutil.Error:  # ended meanwhile
            pass
    return total / 2**30


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def start_and_cpu_s(pid: int) -> tuple[float, float]:
    """From one read of /proc/PID/stat: seconds from boot to the process's start (starttime; compare
    time.clock_gettime(time.CLOCK_BOOTTIME)) and the CPU seconds it has used (utime + stime, as psutil's cpu_times()).
    The start, not psutil's create_time(): that adds the boot time as the wall clock puts it at the call, which moves by
    a second now and then while the clock is adjusted, and then a process is a new one to every later sample:
    fresh-clone runs of d01f3a1 counted 59.7 CPU minutes in 21 minutes on 2 cores."""
    return _start_and_cpu_s(stat_fields(pid))


def _start_and_cpu_s(fields: list[bytes]) -> tuple[float, float]:
    return int(fields[19]) / _CLOCK_TICKS, (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def stat_fields(pid: int) -> list[bytes]:
    """/proc/PID/stat after the command's closing parenthesis: [0] is field 3 (the state), [7] minflt, [11] utime,
    [12] stime, [19] starttime, [21] rss (pages)."""
    return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()


def tree_cpu_s(pid: int | None = None) -> dict[tuple[int, float], float]:
    """CPU seconds used so far by each process of the tree, keyed by pid and start (`start_and_cpu_s`; cheap: one stat
    file each)."""
    return tree_cpu_and_rss(pid)[0]


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def tree_cpu_and_rss(pid: int | None = None) -> tuple[dict[tuple[int, float], float], float]:
    """`tree_cpu_s`, and the tree's resident set size summed (GB; shared pages counted by every process that maps
    them), from the same stat files (field 24, rss, in pages)."""
    cpu, rss_pages = {}, 0
    for proc in _tree(pid):
        try:
            fields = stat_fields(proc.pid)
        except OSError:  # ended meanwhile
            continue
        started, used = _start_and_cpu_s(fields)
        cpu[(proc.pid, started)] = used
        rss_pages += int(fields[21])
    return cpu, rss_pages * _PAGE_BYTES / 2**30


def cpu_used_s(before: dict[tuple[int, float], float], after: dict[tuple[int, float], float]) -> float:
    """CPU seconds the tree used between two `tree_cpu_s` reads (a process started meanwhile counts whole; one that
    ended meanwhile is missing from `after`, its last seconds with it)."""
    return sum(seconds - before.get(key, 0.0) for key, seconds in after.items())


def _tree(pid: int | None) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


class PeakMemory:
    """The peak of `tree_pss_gb()` for this process while the block runs, sampled in a thread every `pss_every_s` (what
    a module's servers and their engines took at most: the numbers the `memory_gb` marks come from; their plateaus last
    minutes), and the CPU seconds the tree used meanwhile, sampled every `every_s` (`cpu_s`; a process's last seconds
    before it ends between two samples are not counted): on a machine whose cores are busy, the time a module costs the
    whole run. PSS is not cheap (`tree_pss_gb`): every 2 s it cost the worker 6-12 % of a core beside a gateway stack,
    every 10 s ~58 CPU s of a whole run (py-spy of a suite run, 2026-12-07). So it is read every 20 s, and only while
    the tree's RSS, free from the stat files the CPU comes from, exceeds the peak so far: a process's PSS is at most
    its RSS, so below that no sample could be a new peak."""

    BUSY_S = 5.0  # a process this busy counts in `busy_processes` (each interpreter that imports vLLM takes ~9.5)

    def __init__(self, every_s: float = 2.0, pss_every_s: float = 20.0, busy_s: float = BUSY_S):
        self.every_s, self.pss_every_s, self.busy_s, self.peak_gb = every_s, pss_every_s, busy_s, 0.0
        self.pss_reads = 0
        self._cpu: dict[tuple[int, float], float] = {}
        self._cpu_at_start: dict[tuple[int, float], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="peak-memory")

    @property
    def cpu_s(self) -> float:
        return cpu_used_s(self._cpu_at_start, self._cpu)

    @property
    def busy_processes(self) -> int:
        """Processes that used `busy_s` CPU seconds or more in the block."""
        return sum(seconds >= self.busy_s for seconds in self._used().values())

    def _used(self) -> dict[tuple[int, float], float]:
        return {key: seconds - self._cpu_at_start.get(key, 0.0) for key, seconds in self._cpu.items()}

    def _take(self, pss: bool) -> None:
        cpu, rss_gb = tree_cpu_and_rss()
        self._cpu.update(cpu)
        if pss and rss_gb > self.peak_gb:
            self.peak_gb = max(self.peak_gb, tree_pss_gb())
            self.pss_reads += 1

    def _sample(self) -> None:
        next_pss = time.monotonic()
        while True:
            pss = time.monotonic() >= next_pss
            self._take(pss)
            if pss:
                next_pss = time.monotonic() + self.pss_every_s
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> PeakMemory:
        self._cpu_at_start = tree_cpu_s()  # the worker's own seconds before the module are not the module's
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take(pss=True)
