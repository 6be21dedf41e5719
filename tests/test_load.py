"""The load suite's quick form (benchmarks/load/load_suite.py; docs/configuration.md's numbers come from its full form): concurrent
Locust clients against `calm serve` on the real engine; only 200 and 429 answers, every acknowledged write in the
database, the gateway's own memory not growing beyond 5% + 20 MiB across at least 3 samples after warm-up (a run of
20 s catches a runaway growth, not a slow leak: that is the long form's job)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_quick_load_only_200_and_429_every_write_counted_back(tmp_path, embedded_model_dir):
    from benchmarks.load.load_suite import run

    result = run(users=20, duration=20, out=tmp_path, warmup_s=10)  # the quick form in load_suite's docstring
    stats = result["stats"]
    assert stats["chat (multiple choice)"]["requests"] > 0 and stats["chat (free form)"]["requests"] > 0
    assert result["feedback_acknowledged"] > 0
    assert result["checks"] == {name: True for name in result["checks"]}, result["checks"]
