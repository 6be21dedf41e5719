"""Shipped configurations closed by default (issue 63 item 3): every environment but `development` gets production
rules; docker-compose.yml publishes on loopback unless told otherwise, starts with no default secret, keeps the engines
behind their key on a network of their own; HAProxy passes the engines only the routes their key guards. The
Kubernetes side is in tests/test_deploy.py, the images' user and Alertmanager's credential in tests/test_dockerfile.py."""

from __future__ import annotations

import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient
from pydantic import ValidationError

from gateway.settings import DEV_ADMIN_KEY, GatewaySettings
from tests.servers import background, free_port, http, REPO, wait_until
from tests.test_client_keys import make_app

COMPOSE_TEXT = (REPO / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)
SERVICES = COMPOSE["services"]
SECRETS = ("CALM_ADMIN_KEY", "CALM_UPSTREAM_API_KEY", "GRAFANA_ADMIN_PASSWORD")
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}: compose's interpolation forms
VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


@pytest.fixture(autouse=True)
def _no_settings_from_the_environment(monkeypatch):
    for name in ("CALM_ENVIRONMENT", "CALM_ADMIN_KEY", "CALM_REQUIRE_API_KEYS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("environment", ["production", "prod", "staging", "test", "Development", "dev"])
def test_every_environment_but_development_requires_client_keys_and_a_real_admin_key(environment):
    assert GatewaySettings(environment=environment, admin_key="a-real-key").api_keys_required
    # an operator may still turn client keys off explicitly
    assert not GatewaySettings(environment=environment, admin_key="a-real-key", require_api_keys=False).api_keys_required
    with pytest.raises(ValidationError, match="development admin key is refused"):
        GatewaySettings(environment=environment)


def test_development_alone_keeps_its_conveniences_and_no_environment_takes_an_empty_admin_key():
    settings = GatewaySettings(environment="development")
    assert settings.admin_key == DEV_ADMIN_KEY and not settings.api_keys_required
    # "Authorization: Bearer" with nothing after it would match an empty key
    for environment in ("development", "production"):
        for key in ("", "  "):
            with pytest.raises(ValidationError, match="CALM_ADMIN_KEY is empty"):
                GatewaySettings(environment=environment, admin_key=key)


def test_a_staging_gateway_refuses_a_request_without_a_client_key(tmp_path):
    with TestClient(make_app(tmp_path, environment="staging", admin_key="a-real-admin-key")) as http:
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"


def unset(text: str) -> str:
    """`text` as compose interpolates it with none of its variables set (a required one fails the test)."""
    def resolve(match: re.Match) -> str:
        name, form, rest = match.groups()
        assert form not in (":?", "?"), f"{name} is required: {text}"
        return rest if form else ""
    return VARIABLE.sub(resolve, text)


def test_compose_publishes_every_port_on_loopback_unless_told_and_unauthenticated_ones_always():
    published = {name: s["ports"] for name, s in SERVICES.items() if s.get("ports")}
    assert set(published) >= {"gateway", "haproxy", "prometheus", "alertmanager", "grafana"}
    for name, ports in published.items():
        for port in ports:
            assert unset(str(port)).startswith("127.0.0.1:"), f"{name} publishes {port} beyond this machine"
    for name in ("prometheus", "alertmanager"):  # no authentication of their own: no variable opens them
        assert all(str(port).startswith("127.0.0.1:") for port in published[name]), published[name]
    for name in ("gateway", "haproxy", "grafana"):
        assert all(str(port).startswith("${CALM_PUBLISH_ADDRESS:-127.0.0.1}:") for port in published[name])


def test_compose_starts_with_no_default_secret():
    """Every secret is required (${NAME:?...}): unset, `docker compose` refuses to start rather than fall back to the
    development admin key or Grafana's admin/admin."""
    assert DEV_ADMIN_KEY not in COMPOSE_TEXT
    uses = [(name, form) for name, form, _ in VARIABLE.findall(COMPOSE_TEXT) if name in SECRETS]
    assert {name for name, _ in uses} == set(SECRETS) and all(form == ":?" for _, form in uses), uses
    gateways = ["gateway", "gateway-1", "gateway-2", "worker"]
    assert all(SERVICES[name]["environment"]["CALM_ADMIN_KEY"].startswith("${CALM_ADMIN_KEY:?") for name in gateways)
    grafana = SERVICES["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"


def test_compose_engines_need_their_key_and_answer_only_haproxy_and_the_fleets_gateways():
    for name in ("engine-1", "engine-2"):
        assert SERVICES[name]["environment"]["VLLM_API_KEY"].startswith("${CALM_UPSTREAM_API_KEY:?")
        assert SERVICES[name]["networks"] == ["engines"] and "ports" not in SERVICES[name]
    for name in ("gateway-1", "gateway-2"):
        assert SERVICES[name]["environment"]["CALM_UPSTREAM_API_KEY"].startswith("${CALM_UPSTREAM_API_KEY:?")
    on_engines = {name for name, s in SERVICES.items() if "engines" in s.get("networks", [])}
    assert on_engines == {"engine-1", "engine-2", "gateway-1", "gateway-2", "haproxy"}
    assert COMPOSE["networks"]["engines"] == {"internal": True}


class _Engine(BaseHTTPRequestHandler):
    """Any path answered 200 with the path: a stand-in for a vLLM server's routes."""

    def _answer(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = self.path.encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


def test_haproxy_passes_the_engines_only_the_routes_their_key_guards_and_health(tmp_path):
    """vLLM's --api-key guards /v1 (and /v2, /inference, /cohere) only: /invocations runs the same inference with no
    key, so the engines' balancer forwards /v1/* and /health and refuses the rest."""
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(haproxy).exists():
        pytest.fail("haproxy not installed: scripts/test.sh installs Debian's package")
    engines = [ThreadingHTTPServer(("127.0.0.1", 0), _Engine) for _ in range(2)]
    for engine in engines:
        threading.Thread(target=engine.serve_forever, daemon=True).start()
    lb = free_port()
    env = {"CALM_LB_BIND": f"127.0.0.1:{free_port()}", "CALM_ENGINE_LB_BIND": f"127.0.0.1:{lb}",
           "CALM_GATEWAY_1": f"127.0.0.1:{free_port()}", "CALM_GATEWAY_2": f"127.0.0.1:{free_port()}",
           **{f"CALM_ENGINE_{i + 1}": f"127.0.0.1:{e.server_address[1]}" for i, e in enumerate(engines)}}
    try:
        with background([haproxy, "-db", "-f", str(REPO / "deploy/haproxy/haproxy.cfg")], tmp_path / "lb.log", env):
            base = f"http://127.0.0.1:{lb}"

            def health():
                try:
                    return http.get(f"{base}/health", timeout=2).status_code == 200
                except httpx.TransportError:
                    return False

            wait_until("HAProxy to forward /health", health, timeout=30, every=0.2)
            assert http.post(f"{base}/v1/completions", json={}).text == "/v1/completions"
            assert http.post(f"{base}/v1/load_lora_adapter", json={}).status_code == 200  # vLLM checks the key
            for path in ("/invocations", "/tokenize", "/metrics", "/v1"):
                assert http.post(f"{base}{path}", json={}).status_code == 403, path
    finally:
        for engine in engines:
            engine.shutdown()

