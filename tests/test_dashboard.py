"""The Grafana dashboard (gateway/observe/dashboard.py): the committed JSON is the module's output, and every panel's query
names only metrics the gateway exports. tests/test_gateway_e2e.py evaluates every query against a real Prometheus
scraping a live gateway."""

from __future__ import annotations

import json
import re

from prometheus_client import CollectorRegistry

from gateway.observe.dashboard import OUT, REPO, build, drift_threshold, panels
from gateway.observe.monitoring import Metrics


def exported_names() -> set[str]:
    names = set()
    for family in Metrics(CollectorRegistry()).registry.collect():
        for suffix in ("", "_total", "_sum", "_count", "_bucket", "_info"):
            names.add(family.name + suffix)
    return names


def test_the_committed_dashboard_is_the_modules_output():
    assert json.loads(OUT.read_text()) == build(), "run `python -m gateway.observe.dashboard` and commit the JSON"


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


RECORDED = REPO / "benchmarks" / "results" / "dashboard_run.json"


def test_the_recorded_run_has_every_panel_of_the_dashboard_with_data():
    """benchmarks/load/dashboard_run.py recorded the current panels (rerun it when a panel changes), each with a series."""
    recorded = json.loads(RECORDED.read_text())
    assert [(p["row"], p["title"]) for p in recorded["panels"]] == [(s.row, s.title) for s in panels()]
    empty = [p["title"] for p in recorded["panels"] if not any(len(s["points"]) >= 2 for s in p["series"])]
    assert empty == []


def test_the_png_is_drawn_from_the_recording(tmp_path):
    from benchmarks.load.dashboard_run import draw

    draw(json.loads(RECORDED.read_text()), tmp_path / "dashboard.png")
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
