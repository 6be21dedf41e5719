"""A real Prometheus server scrapes the gateway and evaluates the shipped alert rules: the drift alert stays quiet on
in-domain traffic and fires when a domain's traffic shifts. Gateway on the real vLLM engine and the shipped artifact."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from calm_core.data import load_mc, load_open
from tests.servers import REPO, calm_argv, free_port, running

pytestmark = pytest.mark.slow
RULES = REPO / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS = shutil.which("prometheus")


def test_alert_rules_are_valid():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not installed: scripts/test.sh installs Debian's prometheus package")
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 rules found" in out.stdout


@pytest.fixture(scope="module")
def stack(tmp_path_factory, embedded_model_dir):
    if PROMETHEUS is None:
        pytest.fail("prometheus not installed: scripts/test.sh installs Debian's prometheus package")
    tmp = tmp_path_factory.mktemp("drift")
    gw_port, prom_port = free_port(), free_port()
    # The window is the alert rule's minimum (50 answers) and the raw-model pass is off: cloze scoring costs one engine
    # request per option token, and this test is about the alerting path.
    env = {"CALM_DB_PATH": str(tmp / "gw.sqlite3"), "CALM_DRIFT_WINDOW": "50", "CALM_RAW_CONFIDENCE": "false"}
    config = tmp / "prometheus.yml"
    config.write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: calm-gateway
    static_configs: [{{targets: ["127.0.0.1:{gw_port}"]}}]
""")
    prom_argv = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}"]
    with running(calm_argv("serve", "--port", str(gw_port)), f"http://127.0.0.1:{gw_port}/health", tmp / "gw.log", env), \
         running(prom_argv, f"http://127.0.0.1:{prom_port}/-/ready", tmp / "prom.log", timeout=60):
        yield f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{prom_port}"


def ask(gateway: str, question: str, choices: list[str], domain: str) -> float:
    r = httpx.post(f"{gateway}/v1/chat/completions", timeout=300, json={
        "model": "calm-smollm2-135m", "messages": [{"role": "user", "content": question}],
        "options": choices, "metadata": {"domain": domain}})
    r.raise_for_status()
    return r.json()["choices"][0]["calibration"]["confidence"]


def send(gateway: str, items: list[tuple[str, list[str]]], domain: str) -> list[float]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda qc: ask(gateway, qc[0], qc[1], domain), items))


def drift_alerts(prometheus: str, domain: str) -> list[dict]:
    alerts = httpx.get(f"{prometheus}/api/v1/alerts").json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == "CalmConfidenceDrift" and a["labels"].get("domain") == domain]


def gauge(prometheus: str, name: str, domain: str) -> float | None:
    result = httpx.get(f"{prometheus}/api/v1/query", params={"query": f'{name}{{domain="{domain}"}}'}).json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def test_drift_alert_quiet_in_domain_and_firing_on_shift(stack, shared_data):
    gateway, prometheus = stack
    # In-domain: held-out grade-school science questions, from the population the artifact's reference histogram was
    # built on (the split's calibration and in-domain test questions; training questions would be more confident).
    science = load_mc("arc_easy", "test", root=shared_data)[:30] + load_mc("arc_challenge", "test", root=shared_data)[:20]
    send(gateway, [(q.question, list(q.choices)) for q in science], "science")
    time.sleep(40)  # longer than the rule's `for: 30s`, so a pending alert would have fired
    psi_in = gauge(prometheus, "calm_drift_psi", "science")
    assert psi_in is not None and psi_in < 0.25, psi_in
    assert drift_alerts(prometheus, "science") == []

    # Shifted: trivia questions posed as 2-way choices under the same domain label (answers far more confident than
    # the 4-way science reference; 2 options also keep this test's engine load small).
    trivia = load_open("triviaqa", root=shared_data)[:50]
    rng = random.Random(0)
    pool = [t.answer for t in load_open("triviaqa", root=shared_data)[100:400]]
    shifted = [(t.question, rng.sample(pool, 1) + [t.answer]) for t in trivia]
    send(gateway, shifted, "science")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        firing = [a for a in drift_alerts(prometheus, "science") if a["state"] == "firing"]
        if firing:
            break
        time.sleep(2)
    psi_shift = gauge(prometheus, "calm_drift_psi", "science")
    print(f"PSI in-domain {psi_in:.3f}, shifted {psi_shift:.3f}", file=sys.stderr)
    assert firing, f"drift alert did not fire; PSI {psi_shift}"
    assert psi_shift > 0.25
    # Other domains saw no traffic and stay quiet.
    assert drift_alerts(prometheus, "medicine") == []
