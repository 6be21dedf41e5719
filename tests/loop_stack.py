"""The retraining loop's stack for end-to-end tests, every part real: the gateway on the real vLLM engine, a real
Prometheus evaluating the shipped alert rules, a real Alertmanager routing with the shipped configuration to the
gateway's webhook, and `calm worker`; with the helpers the loop tests read it through."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests.servers import REPO, background, calm_argv, free_port, http, metric_values, running

ADMIN = {"Authorization": "Bearer dev-admin-key"}
RULES = REPO / "deploy" / "prometheus" / "alerts.yml"
ALERTMANAGER = REPO / "deploy" / "alertmanager" / "alertmanager.yml"


@contextmanager
def loop_stack(tmp: Path, gw_port: int, loop_config: Path, env: dict, worker_env: dict | None = None) -> Iterator[dict]:
    """Gateway (on `gw_port`, with `env`), Alertmanager, Prometheus and a worker running `loop_config` (with `env` and
    `worker_env`)."""
    for tool in ("prometheus", "prometheus-alertmanager"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not installed: scripts/test.sh installs Debian's prometheus and prometheus-alertmanager")
    prom_port, am_port = free_port(), free_port()
    gateway = f"http://127.0.0.1:{gw_port}"
    # The shipped Alertmanager routing, pointed at this gateway, with this test's key file and short waits.
    am_config = yaml.safe_load(ALERTMANAGER.read_text())
    (tmp / "key").write_text("dev-admin-key\n")
    for receiver in am_config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{gateway}/admin/alerts"
            hook["http_config"]["authorization"]["credentials_file"] = str(tmp / "key")
    for route in [am_config["route"], *am_config["route"]["routes"]]:
        route.update(group_wait="1s", group_interval="1s")
    (tmp / "alertmanager.yml").write_text(yaml.safe_dump(am_config))
    # The shipped rules, with the drift alert's `for` at 5 s instead of 30 s: the expression, labels and routing are
    # what is under test; waiting out a long `for` is Prometheus's behaviour, and only made the suite slower.
    rules = yaml.safe_load(RULES.read_text())
    drift = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "CalmConfidenceDrift"]
    assert len(drift) == 1 and drift[0]["for"] == "30s"
    drift[0]["for"] = "5s"
    (tmp / "alerts.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    (tmp / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{tmp / 'alerts.yml'}"]
scrape_configs:
  - job_name: calm-gateway
    static_configs: [{{targets: ["127.0.0.1:{gw_port}"]}}]
alerting:
  alertmanagers:
    - static_configs: [{{targets: ["127.0.0.1:{am_port}"]}}]
""")
    am_argv = [shutil.which("prometheus-alertmanager"), f"--config.file={tmp / 'alertmanager.yml'}",
               f"--storage.path={tmp / 'am'}", f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="]
    prom_argv = [shutil.which("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"]
    worker_argv = calm_argv("worker", "--config", str(loop_config), "--lease-s", "20")
    with running(calm_argv("serve", "--port", str(gw_port)), f"{gateway}/health", tmp / "gw.log", env), \
         running(am_argv, f"http://127.0.0.1:{am_port}/-/ready", tmp / "am.log", timeout=60), \
         running(prom_argv, f"http://127.0.0.1:{prom_port}/-/ready", tmp / "prom.log", timeout=60), \
         background(worker_argv, tmp / "worker.log", {**env, **(worker_env or {})}) as worker:
        yield {"gateway": gateway, "prometheus": f"http://127.0.0.1:{prom_port}", "tmp": tmp, "env": env,
               "worker": worker}


def psi(gateway: str, domain: str = "science") -> float:
    values = metric_values(gateway, "calm_drift_psi", domain=domain)
    assert values, f"no drift gauge for {domain}"
    return values[0]


def registry_syncs(gateway: str) -> float:
    return sum(metric_values(gateway, "calm_registry_syncs_total", outcome="ok"))


def prometheus_value(prometheus: str, query: str) -> float | None:
    result = http.get(f"{prometheus}/api/v1/query", params={"query": query}).json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def rules_evaluated_after(prometheus: str, timestamp: float) -> bool:
    """Every rule group has been evaluated after `timestamp` (Unix seconds)."""
    def unix(rfc3339: str) -> float:  # Prometheus gives nanoseconds; datetime takes microseconds
        return datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", rfc3339).replace("Z", "+00:00")).timestamp()
    groups = http.get(f"{prometheus}/api/v1/rules").json()["data"]["groups"]
    return bool(groups) and all(unix(g["lastEvaluation"]) > timestamp for g in groups)


def jobs(gateway: str, **params) -> list[dict]:
    return http.get(f"{gateway}/admin/jobs", params=params, headers=ADMIN).json()["data"]


def drift_alerts(prometheus: str, domain: str) -> list[dict]:
    alerts = http.get(f"{prometheus}/api/v1/alerts").json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == "CalmConfidenceDrift" and a["labels"].get("domain") == domain]


