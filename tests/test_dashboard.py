"""The Grafana dashboard (gateway/dashboard.py): the committed JSON is the module's output, and every panel's query
names only metrics the gateway exports. tests/test_gateway_e2e.py evaluates every query against a real Prometheus
scraping a live gateway."""

from __future__ import annotations

import json
import re

from prometheus_client import CollectorRegistry

from gateway.dashboard import OUT, build, drift_threshold, panels
from gateway.monitoring import Metrics


def exported_names() -> set[str]:
    names = set()
    for family in Metrics(CollectorRegistry()).registry.collect():
        for suffix in ("", "_total", "_sum", "_count", "_bucket", "_info"):
            names.add(family.name + suffix)
    return names


def test_the_committed_dashboard_is_the_modules_output():
    assert json.loads(OUT.read_text()) == build(), "run `python -m gateway.dashboard` and commit the JSON"


def test_every_query_reads_only_the_gateways_metrics():
    exported = exported_names()
    for spec in panels():
        for query in spec.queries:
            used = set(re.findall(r"\bcalm_[a-z_]+", query.expr))
            assert used and used <= exported, (spec.title, used - exported)


def test_the_drift_panel_draws_the_shipped_alerts_threshold():
    drift = next(p for p in build()["panels"] if p.get("title", "").startswith("Drift (PSI)"))
    steps = drift["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert steps[-1]["value"] == drift_threshold() == 0.25
