"""The cores shared step by step among in-process CPU engines (adapters/hosting/core_share.py, adapters/vllm_plugins/core_share.py):
the sizing rule, the board the engines share, and the logits processor that re-sizes an engine core's team. The
shipped gateway's engines doing it for real: tests/test_gateway_default.py."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch

from adapters.hosting.core_share import (BETWEEN_STEPS_S, ENDED, LONGEST_STEP_S, PREFIX, SLOTS, STARTED, CoreBoard, CoreShares,
                                 busy_engines, remove_orphans, team_size)


def test_an_engine_gets_its_share_of_the_cores_among_the_busy_ones():
    assert team_size(2, busy=1) == 2  # alone: the machine
    assert team_size(2, busy=2) == 1  # a multiple-choice question's two passes
    assert team_size(2, busy=3) == 1  # never less than one thread
    assert team_size(16, busy=3) == 5
    assert team_size(16, busy=0) == 16  # its own step always counts; 0 only before anything ran


def rows(*engines: tuple[float, float]) -> np.ndarray:
    out = np.zeros((SLOTS, 3))
    for i, (started, ended) in enumerate(engines):
        out[i, STARTED], out[i, ENDED] = started, ended
    return out


def test_an_engine_counts_as_busy_in_a_step_and_between_the_steps_of_a_burst():
    now = 1000.0
    assert busy_engines(rows(), now) == 0
    assert busy_engines(rows((now - 1.0, now - 2.0)), now) == 1  # in a step started a second ago
    assert busy_engines(rows((now - 0.15, now - 0.1)), now) == 1  # between two steps
    assert busy_engines(rows((now - 5.0, now - 2 * BETWEEN_STEPS_S)), now) == 0  # its burst is over
    assert busy_engines(rows((now - LONGEST_STEP_S - 1, now - LONGEST_STEP_S - 2)), now) == 0  # a step never ended
    assert busy_engines(rows((now - 1.0, now - 2.0), (now - 0.1, now - 0.05), (now - 9, now - 8)), now) == 2


def test_engines_see_each_other_on_the_board_and_a_freed_row_is_cleared(tmp_path):
    board = CoreBoard(tmp_path / "board", create=True)
    other = CoreBoard(board.path)  # an engine core maps the same file
    a, b = board.take_slot(), board.take_slot()
    assert a != b and board.team(a) is None
    assert other.step_started(a, 100.0, cpus=2) == 2  # alone
    assert other.step_started(b, 100.1, cpus=2) == 1  # a is mid-step: half each
    assert board.team(a) == 2 and board.team(b) == 1
    other.step_ended(a, 100.2)
    other.went_idle(a)  # its batch emptied: b is alone from its next step
    assert other.step_started(b, 100.3, cpus=2) == 2
    board.free_slot(b)  # its engine stopped: the row is cleared for the next one
    assert board.team(b) is None and busy_engines(board.rows, 100.3) == 0
    board.close()
    assert not board.path.exists()


def test_engines_beyond_the_boards_rows_get_none_and_a_dead_processs_board_is_removed(tmp_path):
    board = CoreBoard(tmp_path / "board", create=True)
    assert len({board.take_slot() for _ in range(SLOTS)}) == SLOTS
    assert board.take_slot() is None  # that engine keeps the team it starts with
    dead = 2**22 + 1  # above Linux's default pid_max: no such process
    orphan, alive = tmp_path / f"{PREFIX}{dead}-x", tmp_path / f"{PREFIX}{os.getpid()}-y"
    orphan.touch(), alive.touch()
    remove_orphans(tmp_path)
    assert not orphan.exists() and alive.exists()


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_processor_resizes_its_engines_team_before_each_step_and_leaves_the_logits_alone(tmp_path, torch_threads,
                                                                                              monkeypatch):
    """What runs inside the engine core at each step: update_state (before the forward pass) takes the share and sets
    torch's threads; apply (after it) marks the step ended and returns the logits unchanged."""
    from vllm.v1.sample.logits_processor import BatchUpdate

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM's CPU worker makes of it

    from adapters.vllm_plugins.common import CORE_SHARE_KEY
    from adapters.vllm_plugins.core_share import CoreShareLogitsProcessor

    board = CoreBoard(tmp_path / "board", create=True)
    mine, theirs = board.take_slot(), board.take_slot()

    def processor(slot):
        config = types.SimpleNamespace(additional_config={CORE_SHARE_KEY: {"path": str(board.path), "slot": slot,
                                                                           "cpus": 4}})
        return CoreShareLogitsProcessor(config, torch.device("cpu"), False)

    engine, other = processor(mine), processor(theirs)
    assert not engine.is_argmax_invariant()  # vLLM must call it at every step, greedy ones too
    one_request = BatchUpdate(batch_size=1, removed=[], added=[], moved=[])
    engine.update_state(one_request)
    assert torch.get_num_threads() == 4 and board.team(mine) == 4  # alone
    logits = torch.randn(1, 8)
    assert engine.apply(logits) is logits
    other.update_state(one_request)  # the other engine starts a step: it and then this one get half
    engine.update_state(None)
    assert torch.get_num_threads() == 2 and board.team(mine) == 2
    other.update_state(BatchUpdate(batch_size=0, removed=[(0,)], added=[], moved=[]))  # its batch emptied
    engine.update_state(None)
    assert torch.get_num_threads() == 4

    unconfigured = CoreShareLogitsProcessor(types.SimpleNamespace(additional_config={}), torch.device("cpu"), False)
    assert unconfigured.is_argmax_invariant()  # `calm engine`, fixed teams: a no-op vLLM may skip
    unconfigured.update_state(one_request)
    assert unconfigured.apply(logits) is logits and torch.get_num_threads() == 4


def test_a_process_hands_its_engines_rows_and_removes_the_board_with_the_last(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr("os.path.isdir", lambda path: False)  # no /dev/shm: the board goes to the temporary folder
    shares = CoreShares()
    first, second = shares.config("a", cpus=2), shares.config("b", cpus=2)
    assert first["path"] == second["path"] and first["slot"] != second["slot"] and first["cpus"] == 2
    board = CoreBoard(first["path"])
    board.step_started(first["slot"], 1.0, cpus=2)
    assert shares.team("a") == 2 and shares.team("b") is None and shares.team("c") is None
    shares.release("a")
    assert os.path.exists(first["path"])  # b still runs
    shares.release("b")
    assert not os.path.exists(first["path"])
