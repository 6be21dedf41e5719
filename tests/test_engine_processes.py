"""Engine cores forked from a preloaded server (adapters/engine_processes.py): a forked child starts with the
server's environment, fixed when the server started; the process must carry its parent's, as spawn does."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest

from adapters.engine_processes import EngineCoreContext, EnvCarryingProcess
from tests.servers import REPO


def report_variable(name: str, queue) -> None:
    queue.put(os.environ.get(name))


@pytest.fixture
def context(monkeypatch):
    monkeypatch.delenv("CALM_TEST_SET_AFTER_THE_SERVER", raising=False)
    return EngineCoreContext()


def run_and_read(context, name: str) -> str | None:
    queue = context.Queue()
    proc = context.Process(target=report_variable, args=(name, queue))
    proc.start()
    value = queue.get(timeout=120)
    proc.join(120)
    assert proc.exitcode == 0
    return value


def test_a_variable_set_after_the_server_started_reaches_the_child(context, monkeypatch):
    # The server is running (started by this process's first forkserver child) before the variable exists.
    assert run_and_read(context, "CALM_TEST_SET_AFTER_THE_SERVER") is None
    monkeypatch.setenv("CALM_TEST_SET_AFTER_THE_SERVER", "carried")
    assert run_and_read(context, "CALM_TEST_SET_AFTER_THE_SERVER") == "carried"


def test_a_plain_forkserver_child_would_not_see_it(context, monkeypatch):
    """What the carrying is for: the same sequence with multiprocessing's own forkserver process misses the value."""
    assert run_and_read(context, "CALM_TEST_SET_AFTER_THE_SERVER") is None  # the server runs
    monkeypatch.setenv("CALM_TEST_SET_AFTER_THE_SERVER", "carried")
    plain = multiprocessing.get_context("forkserver")
    queue = plain.Queue()
    proc = plain.Process(target=report_variable, args=("CALM_TEST_SET_AFTER_THE_SERVER", queue))
    proc.start()
    assert queue.get(timeout=120) is None
    proc.join(120)


def test_the_context_makes_carrying_processes_and_forkserver_queues(context):
    assert isinstance(context.Process(target=print), EnvCarryingProcess)
    assert context.get_start_method() == "forkserver"


def report_threads(queue) -> None:
    import torch

    queue.put(torch.get_num_threads())


def test_a_forked_engine_core_runs_the_openmp_thread_count_its_parent_set():
    """The server has loaded torch (as it does vLLM's modules), so OpenMP read OMP_NUM_THREADS there, once; the
    engine's count, set later, reaches a carrying child's torch, and would not reach a plain forkserver child's. In a
    fresh interpreter: this process's forkserver may already run without torch, where the difference cannot show."""
    wanted = len(os.sched_getaffinity(0)) + 1  # not what torch picks by itself (the usable cores)
    script = textwrap.dedent(f"""
        import multiprocessing, os
        from adapters.engine_processes import EngineCoreContext
        from tests.test_engine_processes import report_threads as report

        if __name__ == "__main__":
            multiprocessing.set_forkserver_preload(["torch"])
            context = EngineCoreContext()
            queue = context.Queue()
            first = context.Process(target=report, args=(queue,))
            first.start(); before = queue.get(timeout=120); first.join(120)  # the server runs, torch loaded
            os.environ["OMP_NUM_THREADS"] = "{wanted}"
            results = []
            for process in (context.Process, multiprocessing.get_context("forkserver").Process):
                child = process(target=report, args=(queue,))
                child.start(); results.append(queue.get(timeout=120)); child.join(120)
            print(before, *results)
    """)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**env, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    before, carried, plain = map(int, out.stdout.split())
    assert carried == wanted
    assert plain == before != wanted  # what a forked engine core ran before: the server's count
