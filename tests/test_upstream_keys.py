"""The gateway's calls to the fleet's vLLM servers carry the servers' key (CALM_UPSTREAM_API_KEY, for their
--api-key): against a real local server that refuses /v1 without it, as vLLM's authentication does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tests.servers import free_port
from tests.test_upstream import answer_text, listening

MODEL = "calm-smollm2-135m"


def guarded_engine(key: str, seen: list[tuple[str, str | None]]):
    """vLLM's routes the gateway calls, /v1 guarded by `key` (GUARDED_PREFIX in vLLM's authenticate.py), /health open;
    `seen` gets (path, Authorization header) of every request."""
    from aiohttp import web

    @web.middleware
    async def authenticate(request: web.Request, handler):
        seen.append((request.path, request.headers.get("Authorization")))
        if request.path.startswith("/v1") and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def completions(request: web.Request) -> web.Response:
        streamed = (await request.json()).get("stream", False)
        return web.Response(text=answer_text(streamed), content_type="application/json")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[authenticate])
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/unload_lora_adapter", ok)
    app.router.add_get("/health", ok)
    return app


def engine_for(url: str, **settings):
    """The gateway's upstream engine as `calm serve` builds it from its settings (calm_cli/serving.py)."""
    from calm_cli.serving import upstream_engine
    from gateway.settings import GatewaySettings

    artifact = SimpleNamespace(free_form=None, manifest=SimpleNamespace(
        free_form_version=None, artifact_version="v1", has_adapter=True))
    return upstream_engine(GatewaySettings(engine="upstream", upstream_urls=[url], **settings), artifact)


async def session(engine) -> str:
    """What a gateway does with a version over its life: load and check it, serve, check health, retire it."""
    from calm_core.engine import EngineRequest, generate

    await engine.start()
    try:
        await engine.prepare()
        answer = await generate(engine, EngineRequest("r", prompt="q", adapter=True))
        await engine.check_health()
        await engine.retire()
        return answer.text
    finally:
        await engine.close()


def test_every_request_to_the_engines_carries_their_key():
    async def run():
        seen: list[tuple[str, str | None]] = []
        port = free_port()
        runner = await listening(guarded_engine("engine-key", seen), port)
        try:
            text = await session(engine_for(f"http://127.0.0.1:{port}", upstream_api_key="engine-key"))
        finally:
            await runner.cleanup()
        return text, seen

    text, seen = asyncio.run(run())
    assert text == "Paris"
    # the version check, the answer, the health check and the unload: each with the key
    assert [path for path, _ in seen] == ["/v1/completions", "/v1/completions", "/health", "/v1/unload_lora_adapter"]
    assert {header for _, header in seen} == {"Bearer engine-key"}


def test_without_the_engines_key_a_version_is_refused_with_a_reason_naming_the_setting():
    from calm_core.engine import EngineUnavailable

    async def run(**settings):
        seen: list[tuple[str, str | None]] = []
        port = free_port()
        runner = await listening(guarded_engine("engine-key", seen), port)
        try:
            await session(engine_for(f"http://127.0.0.1:{port}", **settings))
        finally:
            await runner.cleanup()

    with pytest.raises(EngineUnavailable, match="HTTP 401 .check CALM_UPSTREAM_API_KEY"):
        asyncio.run(run())
    with pytest.raises(EngineUnavailable, match="HTTP 401"):
        asyncio.run(run(upstream_api_key="another-key"))
