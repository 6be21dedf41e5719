"""Which CPU this run got, in one line: its model, its vector extensions, and what torch computes on one of its cores.

    python scripts/machine_probe.py

Why: the 2-core machines this project runs on are not all alike. `make test` ran its tests in 15-20 min on some and
in 64-74 min on others (`benchmarks/results/test-runs.md`). One of the slow ones, measured on 2026-12-05, is an AMD EPYC
of the first Zen generation (family 23, model 1) with AVX2 and no AVX-512, where this probe reads 32-33 GFLOPS; on it
the tests of vLLM serving ran ~3.5x slower and those of torch training and bf16 5-7x (docs/testing.md).
scripts/test.sh prints this line before the tests and the time table at their end repeats it, so a slow run can be
read against the machine it ran on. The number is torch's float32 matrix product on one thread, a training-sized
shape, the best of five: about a second.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# What torch and vLLM's CPU kernels use when present: AVX-512 (and its bf16 instructions) and Intel AMX.
EXTENSIONS = ("avx512f", "avx512_bf16", "amx_tile")


def describe_cpu(cpuinfo: str) -> str:
    """'<model> (family F, model M), <vector extensions>' from /proc/cpuinfo's first processor."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    vector = [f for f in EXTENSIONS if f in flags]
    if not vector:
        vector = ["AVX2, no AVX-512"] if "avx2" in flags else ["no AVX2"]
    model = fields.get("model name", "unknown CPU")
    return f"{model} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}), {', '.join(vector)}"


def matmul_gflops(size: tuple[int, int, int] = (512, 576, 1536), repeats: int = 5) -> float:
    """torch's float32 (m x k) @ (k x n) on one thread, the best of `repeats` (the embedded model's hidden size 576)."""
    import torch

    torch.set_num_threads(1)
    m, k, n = size
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * m * k * n / best / 1e9


def this_cpu() -> str:
    """describe_cpu of this machine (what a benchmark's results record beside their date)."""
    return describe_cpu(Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").exists() else "unknown CPU"


def main() -> None:
    print(f"{this_cpu()}; {os.cpu_count()} cores; torch float32 matmul on one thread: {matmul_gflops():.1f} GFLOPS")


if __name__ == "__main__":
    main()
