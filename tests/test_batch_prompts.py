"""Several prompts in one completions request, through the official openai client against the app (a scripted engine
whose answer names its prompt: these test the numbering, the merge and the bookkeeping; tests/test_openai_conformance.py
compares the same requests with vLLM's own server on the real engine)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from fastapi.testclient import TestClient

from tests.test_client_keys import ADMIN, make_app
from tests.test_gateway_logic import FailingEngine


class NamingEngine(FailingEngine):
    """Answer j to prompt p is "p/j" in two tokens (the second after a yield, so concurrent prompts interleave), with
    confidence exp(-0.1 * (3 len(p) + j)); an "x" prompt fails."""

    def __init__(self):
        super().__init__(None)
        self.prompts: list[str] = []

    def describe(self) -> dict:
        return {"kind": "naming"}

    async def draw(self, request):
        from calm_core.engine import EngineDelta, EngineRejected

        self.prompts.append(request.prompt)
        if request.prompt == "x":
            raise EngineRejected("the engine refused prompt x")
        for j in range(request.n):
            lp = -0.1 * (3 * len(request.prompt) + j)
            yield EngineDelta(text=f"{request.prompt}/", token_ids=[7], token_logprobs=[lp], top_logprobs=[{7: lp}],
                              prompt_tokens=len(request.prompt), index=j)
            await asyncio.sleep(0)
            yield EngineDelta(text=str(j), token_ids=[8], token_logprobs=[lp], top_logprobs=[{8: lp}],
                              finish_reason="length", index=j)


@pytest.fixture
def app_and_engine(tmp_path):
    engine = NamingEngine()
    return make_app(tmp_path, engine), engine


def ask(http, **kwargs):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    return client.completions.create(model="m", max_tokens=2, temperature=1.0, **kwargs)


def test_each_prompt_is_answered_as_its_own_request_and_numbered_as_vllm_does(app_and_engine):
    app, engine = app_and_engine
    with TestClient(app) as http:
        r = ask(http, prompt=["a", "bb", "ccc"], n=2)
        assert [(c.index, c.text) for c in r.choices] == [
            (0, "a/0"), (1, "a/1"), (2, "bb/0"), (3, "bb/1"), (4, "ccc/0"), (5, "ccc/1")]
        assert sorted(engine.prompts) == ["a", "bb", "ccc"]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 12, 18)
        confidences = [c.model_extra["calibration"]["confidence"] for c in r.choices]
        assert confidences == sorted(confidences, reverse=True) and len(set(confidences)) == 6  # each its own
        # Feedback names choice i * n + j of the one response id; each is stored once.
        for index in (0, 5):
            verdict = http.post("/v1/feedback", json={"response_id": r.id, "correct": True, "choice_index": index})
            assert verdict.status_code == 200 and verdict.json()["recorded"], verdict.text
        assert http.post("/v1/feedback", json={"response_id": r.id, "correct": True, "choice_index": 6}).status_code == 404
        one = ask(http, prompt=["a"])  # a list of one is a plain request
        assert [(c.index, c.text) for c in one.choices] == [(0, "a/0")]


def test_a_stream_interleaves_the_prompts_and_ends_once(app_and_engine):
    app, _ = app_and_engine
    with TestClient(app) as http:
        chunks = list(ask(http, prompt=["a", "bb"], n=2, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: "a/0", 1: "a/1", 2: "bb/0", 3: "bb/1"}
    calibrated = [c.index for chunk in chunks for c in chunk.choices if (c.model_extra or {}).get("calibration")]
    assert sorted(calibrated) == [0, 1, 2, 3]
    order = [c.index for chunk in chunks for c in chunk.choices]
    assert order != sorted(order)  # the prompts' chunks came as they were made, not one prompt after the other
    usage = chunks[-1]
    assert usage.choices == [] and (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (3, 8)
    assert sum(1 for c in chunks if c.usage is not None) == 1


def test_one_failing_prompt_fails_the_request_as_its_own_would(app_and_engine):
    app, _ = app_and_engine
    with TestClient(app) as http:
        with pytest.raises(openai.BadRequestError, match="refused prompt x"):
            ask(http, prompt=["a", "x"])
        streamed = http.post("/v1/completions", json={"model": "m", "max_tokens": 2, "prompt": ["a", "x"], "stream": True})
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert "refused prompt x" in events[-2] and events[-1] == "data: [DONE]"
        assert http.get("/metrics").text.count('calm_requests_total{domain="other",endpoint="completions",status="400"}')
        assert http.app.state.gateway.in_flight.count == 0
        assert http.post("/admin/keys", json={"name": "n"}, headers=ADMIN).status_code == 201  # the app still serves
