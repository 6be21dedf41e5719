"""The cores the engines split (adapters/hosting/cpu_limits.py): the affinity mask, capped by a cgroup CPU quota anywhere above
the process (a container's `--cpus`, a Kubernetes CPU limit), read from cgroup v2 and v1 file trees laid out here."""

from __future__ import annotations

import os

import pytest

from adapters.hosting.cpu_limits import cgroup_cpu_limit, quota_cores, usable_cpus


def test_quota_in_cores():
    assert quota_cores("max", "100000") is None and quota_cores("-1", "100000") is None
    assert quota_cores("400000", "100000") == 4.0 and quota_cores("150000", "100000") == 1.5


def test_cgroup_v2_takes_the_tightest_quota_of_the_cgroup_and_its_parents(tmp_path):
    pod = tmp_path / "kubepods" / "pod1" / "ctr"
    pod.mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("400000 100000\n")  # the pod's limit: 4 cores
    (pod / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit("0::/kubepods/pod1/ctr\n", tmp_path) == 4.0
    assert cgroup_cpu_limit("0::/kubepods\n", tmp_path) is None  # nothing above it limits
    assert cgroup_cpu_limit("0::/\n", tmp_path) is None  # a container's own namespace root, unlimited


def test_cgroup_v1_reads_the_cpu_hierarchy(tmp_path):
    docker = tmp_path / "cpu" / "docker" / "abc"
    docker.mkdir(parents=True)
    (docker / "cpu.cfs_quota_us").write_text("200000\n")  # docker run --cpus 2
    (docker / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    text = "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cgroup_cpu_limit(text, tmp_path) == 2.0
    assert cgroup_cpu_limit("2:cpu,cpuacct:/\n", tmp_path) is None


def test_usable_cpus_is_the_mask_capped_by_the_quota(monkeypatch):
    import adapters.hosting.cpu_limits as limits

    mask = len(os.sched_getaffinity(0))
    monkeypatch.setattr(limits, "cgroup_cpu_limit", lambda text: None)
    assert usable_cpus() == mask
    monkeypatch.setattr(limits, "cgroup_cpu_limit", lambda text: 0.5)
    assert usable_cpus() == 1  # at least one
    monkeypatch.setattr(limits, "cgroup_cpu_limit", lambda text: mask + 8.0)
    assert usable_cpus() == mask  # a quota above the mask does not add cores


@pytest.mark.skipif(not os.path.exists("/proc/self/cgroup"), reason="Linux only")
def test_this_machine_reads_without_error():
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


def test_a_process_runs_omp_num_threads_where_set_else_the_usable_cores(monkeypatch):
    from adapters.hosting.cpu_limits import process_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert process_threads() == 3  # more than the cores, if asked: the operator's call
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert process_threads() == usable_cpus()
