"""The test suite's memory budget (tests/memory_budget.py): claims fit, wait, and never outlive their process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from tests.memory_budget import MemoryBudget, cpu_used_s, machine_capacity_gb


def test_claims_that_fit_run_together_and_one_that_does_not_is_refused_until_a_release(tmp_path):
    budget = MemoryBudget(tmp_path / "ledger.json", capacity_gb=16)
    assert budget.try_acquire("a", 9) is None
    assert budget.try_acquire("b", 6) is None  # 15 of 16
    in_the_way = budget.try_acquire("c", 2)
    assert sorted(in_the_way) == ["a", "b"] and sum(c["gb"] for c in in_the_way.values()) == 15
    budget.release("a")
    assert budget.try_acquire("c", 2) is None
    assert sorted(json.loads((tmp_path / "ledger.json").read_text())) == ["b", "c"]


def test_a_module_larger_than_the_budget_runs_alone(tmp_path):
    budget = MemoryBudget(tmp_path / "ledger.json", capacity_gb=10)
    assert budget.try_acquire("huge", 30) is None
    assert budget.try_acquire("small", 1) is not None
    budget.release("huge")
    assert budget.try_acquire("small", 1) is None
    assert budget.try_acquire("huge", 30) is not None


def test_the_claim_of_a_process_that_died_is_dropped(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "ledger.json").write_text(json.dumps({"killed": {"pid": int(gone.stdout), "gb": 15}}))
    budget = MemoryBudget(tmp_path / "ledger.json", capacity_gb=16)
    assert budget.try_acquire("next", 12) is None
    assert sorted(json.loads((tmp_path / "ledger.json").read_text())) == ["next"]


def test_acquire_waits_for_the_release_it_needs(tmp_path):
    budget = MemoryBudget(tmp_path / "ledger.json", capacity_gb=16)
    budget.try_acquire("running", 12)
    waiting, waited = threading.Event(), []
    t = threading.Thread(target=lambda: waited.append(budget.acquire("next", 8, on_wait=lambda held: waiting.set(),
                                                                     poll_s=0.01)))
    t.start()
    assert waiting.wait(30)
    assert not waited and "next" not in json.loads((tmp_path / "ledger.json").read_text())
    budget.release("running")
    t.join(30)
    assert waited and waited[0] > 0 and sorted(json.loads((tmp_path / "ledger.json").read_text())) == ["next"]


def test_capacity_is_the_machine_less_the_reserve_unless_set(monkeypatch):
    monkeypatch.setenv("CALM_TEST_MEMORY_GB", "12.5")
    assert machine_capacity_gb() == 12.5
    monkeypatch.delenv("CALM_TEST_MEMORY_GB")
    total = machine_capacity_gb(reserve_gb=0)
    assert machine_capacity_gb(reserve_gb=7) == total - 7 and total > 1


def test_a_blocks_cpu_counts_its_children_and_not_what_came_before():
    import time

    from tests.memory_budget import PeakMemory

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\nimport time; time.sleep({hold})"
    end = time.process_time() + 3.0
    while time.process_time() < end:  # the worker's own CPU before the block
        pass
    with PeakMemory(every_s=0.1, busy_s=1.0) as footprint:  # PSS at the start and the end: its own cost is the worker's
        subprocess.run([sys.executable, "-c", burn.format(s=1.5, hold=0.3)], check=True)  # one busy process
        subprocess.run([sys.executable, "-c", burn.format(s=0.3, hold=0.3)], check=True)  # one that is not
    # 1.8 s and two interpreters' start-up; counting the 3 s before the block (or more of the worker's) would exceed 4.5
    assert 1.8 <= footprint.cpu_s < 4.5, footprint.cpu_s
    assert footprint.busy_processes == 1
    assert footprint.peak_gb > 0.0


def test_pss_is_read_only_where_the_trees_rss_could_hold_a_new_peak(monkeypatch):
    """A process's PSS is at most its RSS: while the tree's RSS (read with the CPU, from the stat files) is no more than
    the peak PSS so far, the sampler skips the costly PSS read; above it, it reads."""
    import tests.memory_budget as budget

    rss = {"gb": 5.0}
    monkeypatch.setattr(budget, "tree_cpu_and_rss", lambda pid=None: ({}, rss["gb"]))
    monkeypatch.setattr(budget, "tree_pss_gb", lambda pid=None: 3.0)
    sampler = budget.PeakMemory()
    sampler._take(pss=True)
    assert (sampler.peak_gb, sampler.pss_reads) == (3.0, 1)
    rss["gb"] = 2.9  # below the peak: no sample now could exceed it
    sampler._take(pss=True)
    assert (sampler.peak_gb, sampler.pss_reads) == (3.0, 1)
    rss["gb"] = 3.1
    sampler._take(pss=True)
    sampler._take(pss=False)  # between PSS reads only the CPU is read
    assert (sampler.peak_gb, sampler.pss_reads) == (3.0, 2)


def test_the_trees_rss_from_the_stat_files_is_what_psutil_reads_and_bounds_its_pss():
    import psutil

    from tests.memory_budget import tree_cpu_and_rss, tree_cpu_s, tree_pss_gb

    cpu, rss_gb = tree_cpu_and_rss()
    assert cpu.keys() == tree_cpu_s().keys()
    me = psutil.Process()
    psutil_gb = sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]) / 2**30
    assert abs(rss_gb - psutil_gb) < 0.05  # read a moment apart
    assert tree_pss_gb() <= rss_gb + 0.05


def test_a_process_keeps_its_key_when_the_wall_clock_moves_the_boot_time(monkeypatch):
    """The wall clock's idea of the boot time moves while the clock is adjusted; a process sampled before and after
    is still one process (psutil's create_time() changed with it, and long-lived processes were counted again whole)."""
    import os

    import psutil
    import psutil._pslinux

    from tests.memory_budget import tree_cpu_s

    before = {key for key in tree_cpu_s() if key[0] == os.getpid()}
    boot_time = psutil._pslinux.boot_time
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: boot_time() + 1.0)
    after = {key for key in tree_cpu_s() if key[0] == os.getpid()}
    assert len(before) == 1 and after == before


def test_cpu_used_counts_each_process_from_its_first_read():
    before = {(10, 1.0): 5.0, (11, 2.0): 1.0}
    after = {(10, 1.0): 7.5, (12, 3.0): 0.5}  # 11 ended, 12 started; pid 10 again with another start is another process
    assert cpu_used_s(before, after) == pytest.approx(3.0)
    assert cpu_used_s(after, {**after, (10, 9.0): 1.0}) == pytest.approx(1.0)
