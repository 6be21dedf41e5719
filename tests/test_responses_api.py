"""OpenAI's Responses API through the official openai client against the app (a scripted engine: these test the
mapping onto the chat path and the response shapes; tests/test_openai_conformance.py compares texts and usage with
vLLM's own /v1/responses on the real engine)."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from calm_core.engine import EngineDelta, EngineUnavailable
from tests.test_client_keys import make_app
from tests.test_gateway_logic import FailingEngine


class ScriptedEngine(FailingEngine):
    """Answers "Hi there" in two tokens (log-prob -0.1 each), cut at max_tokens; records the prompts it was given.
    A prompt naming "crash" fails after the first token."""

    def __init__(self):
        super().__init__(None)
        self.prompts: list[str] = []

    def describe(self) -> dict:
        return {"kind": "scripted"}

    async def draw(self, request):
        self.prompts.append(request.prompt)
        cut = request.max_tokens < 2
        yield EngineDelta(text="Hi", token_ids=[7], token_logprobs=[-0.1], top_logprobs=[{7: -0.1}], prompt_tokens=5,
                          finish_reason="length" if cut else None)
        if "crash" in request.prompt:
            raise EngineUnavailable("the engine died")
        if not cut:
            yield EngineDelta(text=" there", token_ids=[8], token_logprobs=[-0.1], top_logprobs=[{8: -0.1}],
                              finish_reason="stop")


@pytest.fixture
def served(tmp_path):
    engine = ScriptedEngine()
    with TestClient(make_app(tmp_path, engine)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0), engine


def test_a_response_is_the_chat_answer_with_its_calibration(served):
    client, engine = served
    r = client.responses.create(model="m", instructions="Be brief.", metadata={"domain": "science"},
                                input=[{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi"},
                                       {"role": "user", "content": [{"type": "input_text", "text": "again"}]}])
    assert engine.prompts == ["Be brief. hello Hi again "]  # the tiny chat template joins the turns
    assert (r.object, r.status, r.output_text, r.output[0].role) == ("response", "completed", "Hi there", "assistant")
    assert r.id.startswith("resp_") and r.output[0].id == "msg_" + r.id.removeprefix("resp_")
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (5, 2, 7)
    calibration = r.model_extra["calibration"]
    assert calibration["domain"] == "science" and calibration["mode"] == "free_form"
    assert calibration["confidence"] == pytest.approx(0.9048374, abs=1e-6)  # exp(-0.1): the geometric mean
    verdict = client.post("/feedback", body={"response_id": r.id, "correct": True}, cast_to=object)
    assert verdict["recorded"] and verdict["domain"] == "science"  # the id the caller got is the one feedback names
    cut = client.responses.create(model="m", input="hello", max_output_tokens=1)
    assert (cut.status, cut.incomplete_details.reason, cut.output_text) == ("incomplete", "max_output_tokens", "Hi")


def test_token_log_probs_come_when_included(served):
    """The answer's tokens ("Hi", " there": ids 7 and 8, "G" and "H" in the tiny vocabulary) with their calibrated
    log-probs and alternatives, whole or streamed with each delta."""
    client, _ = served
    asked = dict(model="m", input="hello", include=["message.output_text.logprobs"], top_logprobs=1)
    whole = client.responses.create(**asked).output[0].content[0].logprobs
    assert [(t.token, round(t.logprob, 6), [a.token for a in t.top_logprobs]) for t in whole] == [
        ("G", -0.1, ["G"]), ("H", -0.1, ["H"])]
    events = list(client.responses.create(**asked, stream=True))
    assert [[t.token for t in e.logprobs] for e in events if e.type == "response.output_text.delta"] == [["G"], ["H"]]
    assert [t.token for t in events[-1].response.output[0].content[0].logprobs] == ["G", "H"]
    assert client.responses.create(model="m", input="hello").output[0].content[0].logprobs == []


def test_a_stream_is_the_responses_event_sequence_ending_with_the_calibrated_response(served):
    client, _ = served
    events = list(client.responses.create(model="m", input="hello", stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["Hi", " there"]
    final = events[-1].response
    assert final.output_text == "Hi there" and final.usage.output_tokens == 2 and final.id == events[0].response.id
    assert final.model_extra["calibration"]["confidence"] == pytest.approx(0.9048374, abs=1e-6)
    with client.responses.stream(model="m", input="hello") as stream:  # the SDK's helper reads the same events
        assert stream.get_final_response().output_text == "Hi there"
    with pytest.raises(openai.APIError, match="the engine died"):
        list(client.responses.create(model="m", input="crash", stream=True))


@pytest.mark.parametrize("extra, param, words", [
    (dict(previous_response_id="resp_1"), "previous_response_id", "send the conversation in `input`"),
    (dict(tools=[{"type": "function", "name": "f", "parameters": {}}]), "tools", "tool-call parser"),
    (dict(reasoning={"effort": "low"}), "reasoning", "does not reason"),
    (dict(include=["file_search_call.results"]), "include.0", "message.output_text.logprobs"),
    (dict(input="  "), "input", "must not be empty or blank"),
    (dict(input=[{"role": "system", "content": "rules"}]), "input", "input: must contain at least one non-empty user"),
    (dict(max_output_tokens=10**6), "max_output_tokens", "max_output_tokens 1000000 exceeds this gateway's limit"),
    (dict(input="word " * 3000), "input", "maximum context length is 2048 tokens"),
])
def test_what_the_gateway_cannot_honour_is_refused_by_name(served, extra, param, words):
    client, engine = served
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="m", **{"input": "hello", **extra})
    assert refused.value.body["param"] == param and words in refused.value.body["message"]
    assert engine.prompts == []


def test_retrieving_a_response_says_none_is_kept(served):
    client, _ = served
    answered = client.responses.create(model="m", input="hello")
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(answered.id)
    assert missing.value.body["code"] == "response_not_found" and "keeps no response" in missing.value.body["message"]


def test_the_values_clients_send_by_default_are_accepted(served):
    client, _ = served
    r = client.responses.create(model="m", input="hello", tools=[], tool_choice="auto", parallel_tool_calls=True,
                                truncation="disabled", store=True, text={"format": {"type": "text"}})
    assert r.output_text == "Hi there" and r.store is False  # nothing is kept for retrieval, and it says so
