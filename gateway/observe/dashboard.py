"""The operators' Grafana dashboard as code (Grafana's own `grafana-foundation-sdk`, a dev dependency: nothing on the
serving path imports this module). Every panel is a typed `PanelSpec` whose PromQL reads only the gateway's metrics
(gateway/observe/monitoring.py); `tests/test_dashboard.py` checks the committed JSON is this module's output and evaluates
every query against a real Prometheus scraping a live gateway.

    python -m gateway.observe.dashboard            -> deploy/grafana/dashboards/calm-gateway.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import yaml
from grafana_foundation_sdk.builders.common import GraphThresholdsStyleConfig
from grafana_foundation_sdk.builders.dashboard import Dashboard, QueryVariable, Row, ThresholdsConfig
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import GraphTresholdsStyleMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef, Threshold, ThresholdsMode

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "deploy" / "grafana" / "dashboards" / "calm-gateway.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DOMAIN = 'domain=~"$domain"'
RATE = "$__rate_interval"
# The data source deploy/grafana/provisioning/datasources/prometheus.yml provisions under this uid.
PROMETHEUS = DataSourceRef(type_val="prometheus", uid="prometheus")


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    row: str
    title: str
    queries: tuple[Query, ...]
    unit: str = "none"
    per_domain: bool = True  # every series carries the gateway's `domain` label
    threshold: float | None = None  # drawn as a line (e.g. the drift alert's)
    description: str = ""


def drift_threshold() -> float:
    """The PSI the shipped drift alert fires at, read from its rule (`calm_drift_psi > X`)."""
    rules = yaml.safe_load(ALERTS.read_text())
    expr = next(r["expr"] for g in rules["groups"] for r in g["rules"] if r.get("alert") == "CalmConfidenceDrift")
    return float(str(expr).split(">")[1].split()[0])


def rate(metric: str, by: str = "domain") -> str:
    return f"sum by ({by}) (rate({metric}{{{DOMAIN}}}[{RATE}]))"


def share(part: str, whole: str) -> str:
    return f"{rate(part)} / {rate(whole)}"


def mean_of(histogram: str) -> str:
    return share(f"{histogram}_sum", f"{histogram}_count")


def quantile(q: float) -> str:
    return f"histogram_quantile({q}, {rate('calm_request_latency_seconds_bucket', 'le, domain')})"


def panels() -> list[PanelSpec]:
    calibration, policy, traffic = "Calibration per domain", "Policies and guarantees", "Traffic"
    return [
        PanelSpec(calibration, "Confidence and its reference", (
            Query(mean_of("calm_confidence"), "{{domain}} live"),
            Query(f"calm_reference_confidence_mean{{{DOMAIN}}}", "{{domain}} reference")), "percentunit",
            description="Mean calibrated confidence of answers against the serving version's reference for the domain"),
        PanelSpec(calibration, "Drift (PSI) against the alert threshold", (
            Query(f"calm_drift_psi{{{DOMAIN}}}", "{{domain}} PSI"),), threshold=drift_threshold()),
        PanelSpec(calibration, "Drift (KS statistic)", (Query(f"calm_drift_ks{{{DOMAIN}}}", "{{domain}} KS"),)),
        PanelSpec(calibration, "Online accuracy and ECE from feedback", (
            Query(f"calm_online_accuracy{{{DOMAIN}}}", "{{domain}} accuracy"),
            Query(f"calm_online_ece{{{DOMAIN}}}", "{{domain}} ECE"),
            Query(f"calm_estimated_accuracy{{{DOMAIN}}}", "{{domain}} label-free estimate")), "percentunit"),
        PanelSpec(calibration, "Serving version", (
            Query(f"calm_serving_version_info{{{DOMAIN}}}", "{{domain}}: {{version}}"),)),
        PanelSpec(policy, "Abstention rate", (
            Query(share("calm_abstentions_total", "calm_answers_total"), "{{domain}} abstained"),
            Query(share("calm_below_threshold_total", "calm_answers_total"), "{{domain}} below threshold")),
            "percentunit"),
        PanelSpec(policy, "Guaranteed risk: threshold and realised selective risk", (
            Query(f"calm_policy_guaranteed_threshold{{{DOMAIN}}}", "{{domain}} threshold"),
            Query(f"calm_policy_realised_selective_risk{{{DOMAIN}}}", "{{domain}} realised risk")), "percentunit"),
        PanelSpec(policy, "Guaranteed risk: labels", (
            Query(f"calm_policy_guarantee_labels{{{DOMAIN}}}", "{{domain}} labels behind the threshold"),
            Query(f"calm_policy_realised_answers{{{DOMAIN}}}", "{{domain}} answers with feedback since the fit"))),
        PanelSpec(traffic, "Requests", (
            Query(rate("calm_requests_total", "domain, status"), "{{domain}} {{status}}"),),
            "reqps"),
        PanelSpec(traffic, "Errors", (
            Query(rate("calm_errors_total", "domain, type"), "{{domain}} {{type}}"),),
            "reqps"),
        PanelSpec(traffic, "Latency p50 and p99", (
            Query(quantile(0.5), "{{domain}} p50"), Query(quantile(0.99), "{{domain}} p99")), "s"),
        PanelSpec(traffic, "Requests in flight", (Query("calm_requests_in_flight", "in flight"),), per_domain=False,
                  description="Generation requests being served by this replica (the engine's queue as the gateway "
                              "sees it); at CALM_MAX_IN_FLIGHT more are answered 429"),
    ]


def build(specs: list[PanelSpec] | None = None) -> dict:
    specs = specs if specs is not None else panels()
    dashboard = (Dashboard("CALM Gateway").uid("calm-gateway").tags(["calm", "calibration"]).refresh("30s")
                 .time("now-1h", "now")
                 .with_variable(QueryVariable("domain").label("domain").query("label_values(calm_answers_total, domain)")
                                .multi(True).include_all(True)))
    row = None
    for spec in specs:
        if spec.row != row:
            row = spec.row
            dashboard = dashboard.with_row(Row(row))
        panel = Timeseries().title(spec.title).unit(spec.unit).height(8).span(12).datasource(PROMETHEUS)
        if spec.description:
            panel = panel.description(spec.description)
        for i, query in enumerate(spec.queries):
            panel = panel.with_target(Dataquery().expr(query.expr).legend_format(query.legend).ref_id("ABCDEFGH"[i]))
        if spec.threshold is not None:
            panel = panel.thresholds_style(_line_thresholds()).thresholds(_thresholds(spec.threshold))
        dashboard = dashboard.with_panel(panel)
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(dashboard.build()))


def _line_thresholds() -> GraphThresholdsStyleConfig:
    return GraphThresholdsStyleConfig().mode(GraphTresholdsStyleMode.LINE)  # sic: the SDK's spelling


def _thresholds(value: float) -> ThresholdsConfig:
    return ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
        [Threshold(value=None, color="green"), Threshold(value=value, color="red")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(build(), indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out} ({len(panels())} panels)")


if __name__ == "__main__":
    main()
