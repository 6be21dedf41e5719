"""How CALM's processes run CPython's cyclic garbage collector.

A `calm` command, the gateway and the engine-core server import torch, transformers and vLLM: millions of objects
that live as long as the process. At CPython's setting (a young-generation pass every 700 net allocations) the imported
objects reach the oldest generation quickly, and a full pass runs each time that generation has grown by a quarter:
while the modules load, 9 full passes walk the growing heap. A young pass every 20,000 allocations runs none, and
importing a gateway's modules takes 7.39 CPU s instead of 8.68 (in the collector 0.71 s instead of 1.84;
`python benchmarks/engines/bench_collector.py`: benchmarks/results/collector.md). Serving keeps it: a request's objects
die young (reference counting frees them), and in the gateway the default's frequent passes only rescanned the objects
of requests in flight (61 µs of a request's CPU at its ceiling, ~5 %; 0.7 µs at 20,000; a pass then takes ~2 ms on the
slowest machine measured; docs/performance.md).
"""

from __future__ import annotations

import gc

YOUNG_GENERATION_THRESHOLD = 20_000
# The interpreter's own: this module is imported before anything changes them (a `calm` command's, the server's first).
THRESHOLDS_AT_START = gc.get_threshold()


def collect_young_less_often() -> None:
    """The young generation collected every YOUNG_GENERATION_THRESHOLD net allocations; the older ones as CPython's."""
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, *gc.get_threshold()[1:])


def collect_as_cpython() -> None:
    gc.set_threshold(*THRESHOLDS_AT_START)
