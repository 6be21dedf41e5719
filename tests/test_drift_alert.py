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


def test_the_drift_alert_names_the_version_whose_window_it_measured(tmp_path):
    """Prometheus's own rule evaluator (`promtool test rules`) on two replicas of one fleet: the alert fires for the
    replica whose full window drifted, labelled with the version that replica serves the domain with (the webhook
    ignores an alert about a version the domain is no longer routed to), and not for a window under 50 answers."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not installed: scripts/test.sh installs Debian's prometheus package")
    a, b = 'instance="gw-a:8000", job="calm-gateway"', 'instance="gw-b:8000", job="calm-gateway"'
    cases = tmp_path / "drift_test.yml"
    cases.write_text(f"""
rule_files: [{RULES}]
evaluation_interval: 10s
tests:
  - interval: 10s
    input_series:
      - {{series: 'calm_drift_psi{{domain="science", {a}}}', values: '0.9x10'}}
      - {{series: 'calm_drift_window_size{{domain="science", {a}}}', values: '100x10'}}
      - {{series: 'calm_serving_version_info{{domain="science", version="v2", {a}}}', values: '1x10'}}
      - {{series: 'calm_serving_version_info{{domain="medicine", version="v1", {a}}}', values: '1x10'}}
      - {{series: 'calm_drift_psi{{domain="science", {b}}}', values: '0.9x10'}}
      - {{series: 'calm_drift_window_size{{domain="science", {b}}}', values: '49x10'}}
      - {{series: 'calm_serving_version_info{{domain="science", version="v1", {b}}}', values: '1x10'}}
    alert_rule_test:
      - eval_time: 20s
        alertname: CalmConfidenceDrift
        exp_alerts: []
      - eval_time: 60s
        alertname: CalmConfidenceDrift
        exp_alerts:
          - exp_labels: {{alertname: CalmConfidenceDrift, severity: warning, domain: science, version: v2,
                         instance: "gw-a:8000", job: calm-gateway}}
            exp_annotations:
              summary: Confidence drift in domain science (PSI 0.90)
              description: Answers in this domain look unlike the calibration reference; confidence may no longer be calibrated here.
""")
    out = subprocess.run([promtool, "test", "rules", str(cases)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
