"""scripts/machine_probe.py: the CPU named from /proc/cpuinfo, and its matmul number from torch."""

from __future__ import annotations

from scripts.machine_probe import describe_cpu, matmul_gflops

# Two processors of the slow kind's /proc/cpuinfo (2026-12-05), flags shortened; only the first block is read.
ZEN1 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx fma avx2 sha_ni

processor\t: 1
model name\t: something else
flags\t\t: avx512f
"""
SAPPHIRE_RAPIDS = """processor\t: 0
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
"""


def test_the_cpu_is_named_with_its_vector_extensions_from_the_first_processor():
    assert describe_cpu(ZEN1) == "AMD EPYC (family 23, model 1), AVX2, no AVX-512"
    assert describe_cpu(SAPPHIRE_RAPIDS) == ("Intel(R) Xeon(R) Platinum 8481C (family 6, model 143), avx512f, "
                                             "avx512_bf16, amx_tile")
    assert describe_cpu("") == "unknown CPU (family ?, model ?), no AVX2"


def test_the_matmul_number_is_a_rate_of_a_real_product():
    gflops = matmul_gflops(size=(64, 64, 64), repeats=2)
    assert 0.01 < gflops < 10_000
