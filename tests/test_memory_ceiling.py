"""scripts/memory_ceiling.py's rule for a slow step (the probe itself takes GBs and seconds: run by scripts/test.sh)."""

from __future__ import annotations

import pytest

from scripts.memory_ceiling import Probe, Step, is_slow


def step(seconds: float, size_gb: float = 0.5) -> Step:
    return Step(size_gb, size_gb, 10.0, seconds, 0, 0)


@pytest.mark.parametrize("seconds, fastest, slow", [
    (0.21, 0.40, False),  # 0.42 s per GB, as fast as the fastest
    (0.90, 0.40, True),   # 1.8 s per GB: 4.5x the fastest
    (0.70, 0.40, False),  # 1.4 s per GB: 3.5x, under both limits
    (5.00, 10.0, True),   # the first step already past the line: 10 s per GB is slow whatever came before
])
def test_a_step_is_slow_against_the_fastest_or_on_its_own(seconds, fastest, slow):
    assert is_slow(step(seconds), fastest, slow=4.0, slow_s_per_gb=2.0) is slow


def test_the_summary_names_the_line_and_the_cost_past_it():
    probe = Probe(23.5, [step(0.2), step(0.2), step(5.0)], 11.0)
    assert probe.markdown().splitlines()[-1] == ("full speed up to ~11.0 GB in use of 23.5 GiB: the step from there "
                                                 "took 10.0 s per GB (the fastest 0.40)")
