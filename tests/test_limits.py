"""Backpressure and bounds through the app (a slow fake engine; these test the gateway's own logic)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.test_client_keys import make_app
from tests.test_gateway_logic import FailingEngine


class SlowEngine(FailingEngine):
    """Takes `seconds` before its one token."""

    def __init__(self, seconds: float):
        super().__init__(None)
        self.seconds = seconds
        self.cancelled = 0

    def describe(self) -> dict:
        return {"kind": "slow"}

    async def stream(self, request):
        from adapters.engine import EngineDelta

        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:  # the engine clients abort their request here (vLLM on cancellation)
            self.cancelled += 1
            raise
        yield EngineDelta(text="Hi", token_ids=[7], token_logprobs=[-0.1], top_logprobs=[{7: -0.1}], prompt_tokens=3,
                          finish_reason="stop")


BODY = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def run(app, calls):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await asyncio.gather(*(c(client) for c in calls))
    return asyncio.run(go())


def slow_app(tmp_path, seconds, **settings):
    app = make_app(tmp_path, **settings)
    engine = SlowEngine(seconds)
    app.state.service.engine = engine
    return app, engine


def test_requests_beyond_the_in_flight_limit_get_429_at_once_and_streams_hold_their_slot(tmp_path):
    app, _ = slow_app(tmp_path, 0.5, max_in_flight=2)
    post = lambda c: c.post("/v1/chat/completions", json=BODY)  # noqa: E731
    statuses = sorted(r.status_code for r in run(app, [post] * 5))
    assert statuses == [200, 200, 429, 429, 429]
    busy = run(app, [post] * 3)
    refused = [r for r in busy if r.status_code == 429][0]
    assert refused.headers["Retry-After"] == "1" and refused.json()["error"]["code"] == "server_busy"
    assert app.state.in_flight.count == 0  # every slot came back
    stream = lambda c: c.post("/v1/chat/completions", json={**BODY, "stream": True})  # noqa: E731
    results = run(app, [stream, stream, post])
    assert sorted(r.status_code for r in results) == [200, 200, 429]
    streamed = [r for r in results if r.status_code == 200 and r.text.startswith("data:")]
    assert streamed and all(r.text.rstrip().endswith("data: [DONE]") for r in streamed)
    assert app.state.in_flight.count == 0


def test_a_request_past_its_deadline_gets_504_and_its_engine_request_is_cancelled(tmp_path):
    app, engine = slow_app(tmp_path, 5.0, request_deadline_s=0.2)
    (r,) = run(app, [lambda c: c.post("/v1/chat/completions", json=BODY)])
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert engine.cancelled == 1 and app.state.in_flight.count == 0


def test_an_oversized_body_is_refused_with_413_before_it_is_read(tmp_path):
    app, _ = slow_app(tmp_path, 0.0, max_body_bytes=2000)
    big = {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]}
    (r, ok) = run(app, [lambda c: c.post("/v1/chat/completions", json=big),
                        lambda c: c.post("/v1/chat/completions", json=BODY)])
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert ok.status_code == 200

    async def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 500

    (chunked,) = run(app, [lambda c: c.post("/v1/chat/completions", content=chunks(),
                                            headers={"content-type": "application/json"})])
    assert chunked.status_code == 413 and "content-length" not in chunked.request.headers

    async def small():
        yield __import__("json").dumps(BODY).encode()

    (fine,) = run(app, [lambda c: c.post("/v1/chat/completions", content=small(),
                                         headers={"content-type": "application/json"})])
    assert fine.status_code == 200, fine.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_limits_are_documented_in_the_openapi_contract(tmp_path, path):
    app, _ = slow_app(tmp_path, 0.0)
    responses = app.openapi()["paths"][path]["post"]["responses"]
    assert {"413", "429", "504"} <= set(responses)
