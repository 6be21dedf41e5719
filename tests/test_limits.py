"""Backpressure and bounds through the app (a fake engine held until a test releases it; these test the gateway's
own logic)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from tests.test_client_keys import make_app
from tests.test_gateway_logic import FailingEngine


class HeldEngine(FailingEngine):
    """Answers one token once `release` is set (never, unless a test sets it): requests hold their slot exactly as
    long as a test needs, whatever the machine's speed."""

    def __init__(self):
        super().__init__(None)
        self.release = threading.Event()
        self.cancelled = 0

    def describe(self) -> dict:
        return {"kind": "held"}

    async def draw(self, request):
        from calm_core.engine import EngineDelta

        try:
            while not self.release.is_set():
                await asyncio.sleep(0.005)
        except asyncio.CancelledError:  # the engine clients abort their request here (vLLM on cancellation)
            self.cancelled += 1
            raise
        yield EngineDelta(text="Hi", token_ids=[7], token_logprobs=[-0.1], top_logprobs=[{7: -0.1}], prompt_tokens=3,
                          finish_reason="stop")


BODY = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def run(app, calls, engine: HeldEngine | None = None, release_after: int = 0):
    """Run `calls` concurrently; with `engine`, hold its answers until `release_after` calls have been answered (the
    refusals, which never reach the engine)."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            tasks = [asyncio.ensure_future(c(client)) for c in calls]
            if engine is not None:
                engine.release.clear()
                for answered, task in enumerate(asyncio.as_completed(tasks, timeout=120), start=1):
                    await task
                    if answered == release_after:
                        break
                engine.release.set()
            return await asyncio.gather(*tasks)
    return asyncio.run(go())


def held_app(tmp_path, released: bool = True, **settings):
    engine = HeldEngine()
    if released:
        engine.release.set()
    return make_app(tmp_path, engine, **settings), engine


def test_requests_beyond_the_in_flight_limit_get_429_at_once_and_streams_hold_their_slot(tmp_path):
    app, engine = held_app(tmp_path, max_in_flight=2)
    post = lambda c: c.post("/v1/chat/completions", json=BODY)  # noqa: E731
    # Two requests hold the two slots until the other three have been refused.
    results = run(app, [post] * 5, engine, release_after=3)
    assert sorted(r.status_code for r in results) == [200, 200, 429, 429, 429]
    busy = run(app, [post] * 3, engine, release_after=1)
    refused = [r for r in busy if r.status_code == 429][0]
    assert refused.headers["Retry-After"] == "1" and refused.json()["error"]["code"] == "server_busy"
    assert app.state.gateway.in_flight.count == 0  # every slot came back
    stream = lambda c: c.post("/v1/chat/completions", json={**BODY, "stream": True})  # noqa: E731
    results = run(app, [stream, stream, post], engine, release_after=1)
    assert sorted(r.status_code for r in results) == [200, 200, 429]
    streamed = [r for r in results if r.status_code == 200 and r.text.startswith("data:")]
    assert streamed and all(r.text.rstrip().endswith("data: [DONE]") for r in streamed)
    assert app.state.gateway.in_flight.count == 0


def test_a_request_past_its_deadline_gets_504_and_its_engine_request_is_cancelled(tmp_path):
    app, engine = held_app(tmp_path, released=False, request_deadline_s=0.2)  # never answers: only the deadline ends it
    (r,) = run(app, [lambda c: c.post("/v1/chat/completions", json=BODY)])
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert engine.cancelled == 1 and app.state.gateway.in_flight.count == 0


def test_an_oversized_body_is_refused_with_413_before_it_is_read(tmp_path):
    app, _ = held_app(tmp_path, max_body_bytes=2000)
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
    app, _ = held_app(tmp_path)
    responses = app.openapi()["paths"][path]["post"]["responses"]
    assert {"413", "429", "504"} <= set(responses)


def test_refused_requests_give_their_slot_back_and_several_prompts_hold_one_each(tmp_path):
    app, engine = held_app(tmp_path, max_in_flight=3)
    unknown = lambda c: c.post("/v1/chat/completions", json={**BODY, "calm": {"version": "nope"}})  # noqa: E731
    assert [r.status_code for r in run(app, [unknown] * 5)] == [404] * 5
    assert app.state.gateway.in_flight.count == 0  # a 404 for the version kept its slot once: 256 typos, then 429s
    two = lambda c: c.post("/v1/completions", json={"model": "m", "max_tokens": 2, "prompt": ["a", "b"]})  # noqa: E731
    post = lambda c: c.post("/v1/chat/completions", json=BODY)  # noqa: E731
    results = run(app, [two, post, post], engine, release_after=1)  # 2 + 1 + 1 slots asked of 3
    assert sorted(r.status_code for r in results) == [200, 200, 429]
    assert app.state.gateway.in_flight.count == 0
    (r,) = run(app, [lambda c: c.post("/v1/completions", json={"model": "m", "max_tokens": 2, "prompt": list("abcd")})])
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "send fewer" in r.json()["error"]["message"]


def test_a_stream_is_held_to_the_deadline_until_its_last_chunk(tmp_path):
    """The deadline once ended when a stream started (63, item 5): a stream whose engine never finishes ran, and held
    its slot, for as long as the engine took. Now it ends at the deadline with a 504 event and its request aborted."""
    app, engine = held_app(tmp_path, released=False, request_deadline_s=0.3)
    (r,) = run(app, [lambda c: c.post("/v1/chat/completions", json={**BODY, "stream": True})])
    events = [e.removeprefix("data: ") for e in r.text.strip().split("\n\n")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    error = __import__("json").loads(events[-2])["error"]
    assert error["code"] == "deadline_exceeded" and "0.3 s" in error["message"]
    assert engine.cancelled == 1 and app.state.gateway.in_flight.count == 0


def test_one_request_starts_at_most_its_budget_of_engine_sequences(tmp_path):
    """Several prompts, n and per-token option scoring multiply one request into many engine requests (63, item 5)."""
    # A prompt's greedy answer here is one token: its draw and that token's read-back, 2 sequences.
    app, engine = held_app(tmp_path, max_engine_sequences=6)
    prompts = lambda k: lambda c: c.post("/v1/completions", json={  # noqa: E731
        "model": "m", "max_tokens": 2, "prompt": [f"p{i}" for i in range(k)]})
    fits, refused = run(app, [prompts(3), prompts(4)])
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 3
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "engine_work_exceeded" and "more than 6" in error["message"]
    (sampled,) = run(app, [lambda c: c.post("/v1/chat/completions", json={**BODY, "n": 7, "temperature": 1.0})])
    assert sampled.status_code == 400 and sampled.json()["error"]["code"] == "engine_work_exceeded"
    assert app.state.gateway.in_flight.count == 0


def test_a_stream_whose_client_reads_nothing_is_closed_and_frees_what_it_held():
    """A client that stops reading made uvicorn's send wait for ever, holding the stream's slots and engine requests
    (63, item 5). Here the send never completes, as on a full socket: the response gives up after its write timeout
    and closes the stream, whose `finally` (slot release, engine abort) runs."""
    from gateway.edge.limits import WriteTimeoutStreamingResponse

    closed, sent = asyncio.Event(), []

    async def chunks():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n"
        finally:
            closed.set()

    async def stuck_send(message):
        sent.append(message["type"])
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the client's window is full: never drains

    async def go():
        response = WriteTimeoutStreamingResponse(chunks(), write_timeout_s=0.2, media_type="text/event-stream")
        await asyncio.wait_for(response.stream_response(stuck_send), timeout=30)
        return closed.is_set()

    assert asyncio.run(go()) and sent == ["http.response.start", "http.response.body"]


def test_a_fan_out_over_the_budget_starts_none_of_its_engine_requests():
    """Charged as each task started, a per-token option fan-out over budget once sent its first requests to the engine
    and left them running with nobody waiting (the review of 63's item 5): now it is charged whole before any starts."""
    from calm_core.engine import EngineBudget, EngineDelta, EngineRequest, EngineWorkExceeded, engine_budget
    from calm_core.prompts import ClozeTokens
    from calm_core.scorers.options import ClozePerTokenScorer

    class Counting(FailingEngine):
        def __init__(self):
            super().__init__(None)
            self.started = 0

        async def stream(self, request):
            self.started += 1
            yield EngineDelta(text="x", token_ids=[request.option_token_ids[0]], token_logprobs=[-1.0],
                              top_logprobs=[{request.option_token_ids[0]: -1.0}], prompt_tokens=3)

    tokens = ClozeTokens(prompt=(1, 2), options=((3, 4, 5), (6, 7, 8)))  # 6 option tokens: 6 engine requests
    request = EngineRequest(request_id="r", prompt="")

    async def score(limit: int) -> int:
        engine = Counting()
        engine_budget.set(EngineBudget(limit))
        try:
            await ClozePerTokenScorer(engine).option_scores(tokens, request, calibrated=True)
        except EngineWorkExceeded:
            pass
        await asyncio.sleep(0)  # a task started before the refusal would have run its first step by now
        return engine.started

    assert asyncio.run(score(limit=6)) == 6 and asyncio.run(score(limit=5)) == 0
