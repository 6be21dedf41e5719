"""The answer routes' fast lane (gateway/fast_lane.py) answers exactly what the framework answers, and takes only
valid requests; the chat template's render cache returns the template's own text (a fake engine: these test the
gateway's request handling, the real engine is exercised elsewhere)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.test_client_keys import QuietEngine, make_app
from tests.test_gateway_logic import _tiny_tokenizer

VALID = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "metadata": {"domain": "science"}}
VOLATILE = {"id", "created", "created_at"}  # per-response values


class Counting:
    """ASGI wrapper that counts the requests reaching the framework (`owner`: the app, as Starlette sets it)."""

    def __init__(self, app, owner):
        self.app, self.owner, self.calls = app, owner, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.calls += 1
        scope.setdefault("app", self.owner)
        await self.app(scope, receive, send)


def _shape(response: httpx.Response) -> tuple:
    body = response.json() if response.headers.get("content-type", "").startswith("application/json") else response.text
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in VOLATILE}
        for item in body.get("output", []):  # a response's message id follows its response id
            item.pop("id")
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "date")}
    return response.status_code, body, headers


def _both(app, requests: list[dict]) -> list[tuple[tuple, tuple, int]]:
    """Each request through the app (lane first) and straight through the framework: both answers' shapes, and how
    many of the lane's requests reached the framework."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            await client.get("/health/live")  # builds the middleware stack
            lane = app.middleware_stack
            framework = Counting(lane.app, app)
            lane.app = framework
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=framework), base_url="http://t") as direct:
                out = []
                for r in requests:
                    before = framework.calls
                    via_lane = await client.request("POST", **r)
                    reached = framework.calls - before
                    out.append((_shape(via_lane), _shape(await direct.request("POST", **r)), reached))
                return out
    return asyncio.run(go())


def test_the_lane_answers_valid_requests_itself_and_leaves_every_refusal_to_the_framework(tmp_path):
    app = make_app(tmp_path)
    cases = {
        "chat": dict(url="/v1/chat/completions", json=VALID),
        "completion": dict(url="/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}),
        "json content type with charset": dict(url="/v1/chat/completions", content=json.dumps(VALID),
                                               headers={"content-type": "application/json; charset=utf-8"}),
        "response": dict(url="/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2}),
        "response refused": dict(url="/v1/responses", json={"model": "m", "input": "hi", "previous_response_id": "r"}),
        "unknown model (404 from the handler)": dict(url="/v1/chat/completions", json={**VALID, "model": "other"}),
        "invalid JSON": dict(url="/v1/chat/completions", content=b"{not json",
                             headers={"content-type": "application/json"}),
        "refused parameter": dict(url="/v1/chat/completions", json={**VALID, "tools": []}),
        "no user message": dict(url="/v1/chat/completions",
                                json={**VALID, "messages": [{"role": "system", "content": "x"}]}),
        "form body": dict(url="/v1/chat/completions", content=json.dumps(VALID),
                          headers={"content-type": "text/plain"}),
    }
    results = dict(zip(cases, _both(app, list(cases.values()))))
    for name, (via_lane, direct, reached) in results.items():
        assert via_lane == direct, name
    taken = {name for name, (_, _, reached) in results.items() if reached == 0}
    assert taken == {"chat", "completion", "response", "json content type with charset",
                     "unknown model (404 from the handler)"}
    assert results["response"][0][1]["output"][0]["content"][0]["text"] == "Hi"
    assert results["response refused"][0][0] == 400
    assert results["chat"][0][0] == 200 and results["chat"][0][1]["choices"][0]["calibration"]["domain"] == "science"
    assert results["unknown model (404 from the handler)"][0][0] == 404
    statuses = {name: results[name][0][0] for name in ("invalid JSON", "refused parameter", "no user message")}
    assert statuses == {"invalid JSON": 400, "refused parameter": 400, "no user message": 400}


def test_the_lane_keeps_keys_and_the_body_limit(tmp_path):
    app = make_app(tmp_path, environment="production", admin_key="a-real-admin-key", max_body_bytes=2048)
    big = {**VALID, "messages": [{"role": "user", "content": "x" * 4096}]}

    async def chunks():  # no Content-Length: the limit is counted as the body arrives
        body = json.dumps(big).encode()
        for i in range(0, len(body), 512):
            yield body[i:i + 512]

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            no_key = await client.post("/v1/chat/completions", json=VALID)
            declared = await client.post("/v1/chat/completions", json=big, headers={"Authorization": "Bearer sk-x"})
            chunked = await client.post("/v1/chat/completions", content=chunks(),
                                        headers={"content-type": "application/json"})
            return no_key, declared, chunked

    no_key, declared, chunked = asyncio.run(go())
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "missing_api_key"
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "body_too_large"
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "body_too_large"


def test_the_render_cache_returns_the_templates_text_and_skips_long_conversations():
    from calm_core.prompts import render_chat
    from gateway.serving import prompting

    tokenizer = _tiny_tokenizer()
    short = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    long = [{"role": "user", "content": "why " * (prompting.CACHED_CHARS // 4 + 1)}]
    prompting._rendered.cache_clear()
    for _ in range(3):
        assert prompting.rendered(tokenizer, short) == render_chat(tokenizer, short)
        assert prompting.rendered(tokenizer, long) == render_chat(tokenizer, long)
    info = prompting._rendered.cache_info()
    assert (info.hits, info.misses, info.currsize) == (2, 1, 1)  # the long one never enters the cache


class WaitingEngine(QuietEngine):
    """Streams `first` deltas, then waits for an answer that never comes; records its cancellation."""

    def __init__(self, first: int):
        super().__init__()
        self.first, self.waiting, self.cancelled = first, asyncio.Event(), asyncio.Event()

    async def draw(self, request):
        from calm_core.engine import EngineDelta

        for _ in range(self.first):
            yield EngineDelta(text="Hi", token_ids=[7], token_logprobs=[-0.1], top_logprobs=[{7: -0.1}],
                              prompt_tokens=3)
        self.waiting.set()
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def _served(app, port: int):
    """`app` under a real uvicorn (httptools, as `calm serve` runs it), started in this event loop."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools", log_level="warning"))
    task = asyncio.create_task(server.serve())
    async with asyncio.timeout(30):
        while not server.started:
            await asyncio.sleep(0.01)
    return server, task


@pytest.mark.parametrize("streamed", [False, True])
def test_a_client_that_disconnects_cancels_its_engine_request(tmp_path, streamed):
    """Neither uvicorn nor Starlette cancels a handler whose client has gone: the gateway does (fast_lane.py), so the
    engine stops working on an answer nobody reads, the slot is free again and the request is counted as 499."""
    from tests.servers import free_port

    engine = WaitingEngine(first=1 if streamed else 0)
    app = make_app(tmp_path, engine=engine)
    port = free_port()
    body = json.dumps({**VALID, "max_tokens": 500, "stream": streamed}).encode()

    async def go():
        server, task = await _served(app, port)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            async with asyncio.timeout(30):
                await engine.waiting.wait()
                writer.close()  # the client gives up while the engine works on its answer
                await engine.cancelled.wait()
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                metrics = (await client.get("/metrics")).text
            return metrics, app.state.gateway.in_flight.count
        finally:
            server.should_exit = server.force_exit = True  # without waiting for a request that never ends
            await task

    metrics, in_flight = asyncio.run(go())
    assert in_flight == 0
    counted = 'calm_requests_total{domain="science",endpoint="chat",status="499"} 1.0' in metrics
    assert counted != streamed  # a stream was counted 200 when it started
