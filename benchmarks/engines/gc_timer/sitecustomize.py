"""Times CPython's cyclic collector in every Python process started with this folder on PYTHONPATH (Python imports
`sitecustomize` at start-up): at exit each process writes its CPU seconds, those spent in collections per generation and
the collections run, as one JSON line in $GC_TIMER_OUT/<pid>.json. How the numbers in docs/testing.md's *Issue 62,
fourth part* were taken:

    mkdir -p /tmp/gc && PYTHONPATH=benchmarks/engines/gc_timer GC_TIMER_OUT=/tmp/gc pytest -m "not slow" -n 2 -q
    python benchmarks/engines/gc_timer/summary.py /tmp/gc

A process that ends without running its exit handlers (SIGKILL, os._exit: a gateway's engine cores) writes nothing.
"""

import atexit
import gc
import json
import os
import sys
import time

_spent = [0.0, 0.0, 0.0]
_runs = [0, 0, 0]
_began = [0.0]


def _timer(phase: str, info: dict) -> None:
    if phase == "start":
        _began[0] = time.process_time()
    else:
        _spent[info["generation"]] += time.process_time() - _began[0]
        _runs[info["generation"]] += 1


def _write() -> None:
    folder = os.environ.get("GC_TIMER_OUT")
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump({"argv": " ".join(sys.argv)[:200], "cpu_s": time.process_time(), "collector_s": _spent,
                       "collections": _runs}, f)


def _forked() -> None:  # a forked child counts its own
    _spent[:] = [0.0, 0.0, 0.0]
    _runs[:] = [0, 0, 0]


gc.callbacks.append(_timer)
atexit.register(_write)
os.register_at_fork(after_in_child=_forked)
