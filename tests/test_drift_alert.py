"""The shipped alert rules are valid Prometheus rules. Their behaviour — a real Prometheus scraping the gateway on the
real engine: the drift alert quiet on in-domain traffic, firing when a domain's traffic shifts, and what follows —
is tested in tests/test_retrain_loop.py, which runs the whole loop on one gateway."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.servers import REPO

RULES = REPO / "deploy" / "prometheus" / "alerts.yml"


def test_alert_rules_are_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not installed: scripts/test.sh installs Debian's prometheus package")
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 rules found" in out.stdout
