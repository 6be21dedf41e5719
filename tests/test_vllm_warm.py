"""The engine middleware that loads the served versions before a (re)started engine takes traffic
(adapters/vllm_plugins/warm.py), against a scripted stand-in for vLLM's server app (the real server runs it in
tests/test_fleet.py); and the serving list the gateways keep in the registry folder (calm_core/registry.py)."""

from __future__ import annotations

import asyncio
import json

import httpx

from calm_core.registry import SERVED_FILE, Registry, read_served
from calm_core.db import Database


class ScriptedServer:
    """vLLM's routes the middleware uses: /v1/models, /v1/completions (held until `go` is set; 404 for `missing`),
    /health."""

    def __init__(self, missing: str):
        self.go = asyncio.Event()
        self.completions: list[dict] = []
        self.missing = missing

    async def __call__(self, scope, receive, send):
        message = await receive()
        if scope["path"] == "/v1/models":
            status, body = 200, {"data": [{"id": "base", "parent": None}, {"id": "v1", "parent": "base"}]}
        elif scope["path"] == "/v1/completions":
            request = json.loads(message["body"])
            self.completions.append(request)
            await self.go.wait()
            missing = request["vllm_xargs"]["calm_head"] == self.missing
            status, body = (404, {"error": "no such version"}) if missing else (200, {"choices": [{"text": "x"}]})
        else:
            status, body = 200, {}
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})


def _version(root, name: str, adapter: bool, free_form: bool) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    if adapter:
        (folder / "adapter").mkdir()
        (folder / "adapter" / "adapter_config.json").write_text("{}")
    if free_form:
        (folder / "free_form" / "adapter").mkdir(parents=True)
        (folder / "free_form" / "adapter" / "adapter_config.json").write_text("{}")


def test_health_waits_for_every_served_name_then_passes_through(tmp_path, monkeypatch):
    from adapters.vllm_plugins.warm import ServedVersionsFirst

    root = tmp_path / "registry"
    _version(root, "v1", adapter=True, free_form=True)
    _version(root, "v2", adapter=False, free_form=False)
    _version(root, "v3", adapter=False, free_form=False)  # in the registry, not served: not loaded
    monkeypatch.setenv("CALM_REGISTRY_DIR", str(root))
    registry = Registry(Database(tmp_path / "r.db"), root)
    registry.publish_served(["v2", "v1", "gone"])  # "gone": not in the registry folder (refused, skipped)
    assert read_served(root) == ["gone", "v1", "v2"]

    async def go():
        server = ScriptedServer(missing="gone")
        app = ServedVersionsFirst(server)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e") as client:
            loading = await client.get("/health")  # starts loading; the scripted engine holds the first probe
            server.go.set()
            await app._loading
            ready = await client.get("/health")
            return loading, ready, server.completions, app

    loading, ready, completions, app = asyncio.run(go())
    assert loading.status_code == 503 and loading.json()["status"] == "loading the served versions"
    assert ready.status_code == 200
    probes = [(c["model"], c["vllm_xargs"]["calm_head"], c["max_tokens"]) for c in completions]
    assert probes == [("base", "gone", 1), ("v1", "v1", 1), ("v1:free_form", "v1:free_form", 1), ("base", "v2", 1)]
    assert app.loaded == ["v1", "v1:free_form", "v2"] and list(app.failed) == ["gone"]


def test_without_a_registry_or_a_serving_list_the_engine_is_ready_at_once(tmp_path, monkeypatch):
    from adapters.vllm_plugins.warm import ServedVersionsFirst

    async def health(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e") as client:
            return (await client.get("/health")).status_code

    monkeypatch.delenv("CALM_REGISTRY_DIR", raising=False)
    assert asyncio.run(health(ServedVersionsFirst(ScriptedServer(missing="")))) == 200
    (tmp_path / "empty").mkdir()
    assert asyncio.run(health(ServedVersionsFirst(ScriptedServer(missing=""), root=str(tmp_path / "empty")))) == 200
    (tmp_path / "empty" / SERVED_FILE).write_text("not json")
    assert read_served(tmp_path / "empty") == []


def test_the_gateway_publishes_what_it_serves_when_it_changes(tmp_path):
    from prometheus_client import CollectorRegistry

    from gateway.serving.deployments import Deployment, Deployments
    from gateway.observe.monitoring import DomainMonitor, Metrics

    root = tmp_path / "registry"
    registry = Registry(Database(tmp_path / "r.db"), root)
    deployments = Deployments(Deployment("v0", None, None), registry, None,
                              DomainMonitor(Metrics(CollectorRegistry()), {}, [], 100))
    asyncio.run(deployments.sync())
    assert read_served(root) == ["v0"]
    before = (root / SERVED_FILE).stat().st_mtime_ns
    asyncio.run(deployments.sync())  # nothing changed: not written again
    assert (root / SERVED_FILE).stat().st_mtime_ns == before


def test_an_engine_started_with_an_api_key_still_loads_its_served_versions(tmp_path, monkeypatch):
    """vLLM's --api-key (or VLLM_API_KEY) guards /v1 with a middleware inside this one, so the warm-up's own requests
    carry the server's key: behind vLLM's real authentication every served name loads, while /health stays open."""
    from types import SimpleNamespace

    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    from adapters.vllm_plugins.warm import ServedVersionsFirst

    root = tmp_path / "registry"
    _version(root, "v1", adapter=True, free_form=False)
    Registry(Database(tmp_path / "r.db"), root).publish_served(["v1"])

    def with_args(app, api_key):  # what vLLM's FastAPI app puts in every scope: itself, its parsed flags on .state
        server = SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(api_key=api_key)))
        return lambda scope, receive, send: app({**scope, "app": server}, receive, send)

    async def warm(api_key, env_key):
        if env_key:
            monkeypatch.setenv("VLLM_API_KEY", env_key)
        else:
            monkeypatch.delenv("VLLM_API_KEY", raising=False)
        server = ScriptedServer(missing="")
        server.go.set()
        app = ServedVersionsFirst(AuthenticationMiddleware(server, tokens=[api_key or env_key]), root=str(root))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_args(app, api_key and [api_key])),
                                     base_url="http://e") as client:
            await client.get("/health")
            await app._loading
            unauthenticated = await client.post("/v1/completions", json={})
            return (await client.get("/health")).status_code, unauthenticated.status_code, app.loaded

    assert asyncio.run(warm(api_key="flag-key", env_key=None)) == (200, 401, ["v1"])  # --api-key
    assert asyncio.run(warm(api_key=None, env_key="env-key")) == (200, 401, ["v1"])  # VLLM_API_KEY
