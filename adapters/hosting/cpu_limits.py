"""How many cores this process may keep busy: its affinity mask (a container's cpuset, `taskset`) and its cgroup's CPU
quota (`docker run --cpus`, a Kubernetes CPU limit), the smaller of the two. A quota does not show in the mask: a pod
limited to 4 cores on a 64-core node sees 64, and engines that sized their thread teams to 64 would be throttled."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def quota_cores(quota: str, period: str) -> float | None:
    """Cores a quota allows per period (cgroup v2 `cpu.max` "max 100000" or "400000 100000"; v1 cpu.cfs_quota_us -1
    or microseconds); None when unlimited."""
    if quota.strip() in ("max", "-1"):
        return None
    return int(quota) / int(period)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ancestors(leaf: Path, top: Path) -> list[Path]:
    """`leaf` and its parents up to `top` (a quota anywhere above a cgroup limits it too)."""
    chain = [leaf]
    while chain[-1] != top and top in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def cgroup_cpu_limit(proc_cgroup: str, root: Path = CGROUP_ROOT) -> float | None:
    """The tightest CPU quota of this process's cgroup and its ancestors, in cores; None when there is none.
    `proc_cgroup`: the text of /proc/self/cgroup (v2: "0::/path"; v1: "N:cpu,cpuacct:/path")."""
    limits = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: cpu.max in the unified hierarchy
            for folder in _ancestors(root / path.lstrip("/"), root):
                text = _read(folder / "cpu.max")
                if text:
                    limits.append(quota_cores(*text.split()))
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own hierarchy
            top = root / "cpu"
            for folder in _ancestors(top / path.lstrip("/"), top):
                quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
                if quota and period:
                    limits.append(quota_cores(quota, period))
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def usable_cpus() -> int:
    """The cores this process may keep busy: its affinity mask, capped by its cgroup's quota (whole cores, at least
    one)."""
    cores = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit(_read(Path("/proc/self/cgroup")) or "")
    return max(1, min(cores, math.floor(limit))) if limit is not None else cores


def omp_threads_set() -> int | None:
    """OMP_NUM_THREADS where the environment sets a positive count (an operator's or a test's choice, kept for every
    engine), else None."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def process_threads() -> int:
    """Intra-op threads for this process's own torch work (`calm train`, `calm report`): OMP_NUM_THREADS where set, else
    the usable cores (torch's own default counts the machine's cores and ignores a quota)."""
    return omp_threads_set() or usable_cpus()
