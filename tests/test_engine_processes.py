"""Engine cores forked from a preloaded server (adapters/engine_processes.py): a forked child starts with the
server's environment, fixed when the server started; the process must carry its parent's, as spawn does."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from adapters.engine_processes import EngineCoreContext, EnvCarryingProcess


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
