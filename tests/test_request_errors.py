"""What a caller or an operator is told when the gateway refuses something, through the official openai client where a
client would send it (a fake engine: nothing here reaches one)."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from gateway.errors import REFUSED_PARAMETERS
from tests.test_client_keys import ADMIN, make_app

QUESTION = [{"role": "user", "content": "hello"}]


@pytest.fixture
def http(tmp_path):
    with TestClient(make_app(tmp_path)) as http:  # serves "science" and "medicine" (CALM_DOMAINS)
        yield http


@pytest.fixture
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


REFUSED = [  # (endpoint, arguments, param, words of the message)
    ("completions", dict(prompt="   "), "prompt", "prompt: must not be empty or blank"),
    ("completions", dict(prompt=["A"] * 65), "prompt", "at most 64 prompts per request (this list has 65)"),
    ("completions", dict(prompt=[[1, 2], [3]]), "prompt", "token-id prompts are not supported"),
    ("completions", dict(prompt=[1, 2, 3]), "prompt", "token-id prompts are not supported"),
    ("chat", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]),
     "messages.0.content.0.type", "content parts of type 'image_url' are not supported"),
    ("chat", dict(messages=QUESTION, extra_body={"options": ["Paris", " "]}), "options.1", "must not be empty or blank"),
    ("chat", dict(messages=[{"role": "system", "content": "rules"}]), "messages",
     "messages: must contain at least one non-empty user message"),  # a validator's words, without pydantic's prefix
    ("chat", dict(messages=QUESTION, max_completion_tokens=10**6), "max_completion_tokens",
     "max_completion_tokens 1000000 exceeds this gateway's limit"),  # the field the caller used
    # A misspelt field is refused (never ignored): the message says the name it probably meant, and in a small object
    # every name it takes.
    ("chat", dict(messages=QUESTION, extra_body={"calm": {"confidence_method": "semantic"}}), "calm.confidence_method",
     "did you mean 'confidence'? `calm` takes threshold, domain, raw_confidence, confidence, samples, version"),
    ("chat", dict(messages=QUESTION, extra_body={"max_token": 3}), "max_token", "did you mean 'max_tokens'?"),
    ("chat", dict(messages=[{"role": "user", "content": "hi", "nmae": "x"}]), "messages.0.nmae",
     "did you mean 'name'? `messages.0` takes role, content, name"),
    ("completions", dict(prompt="hi", extra_body={"frobnicate": 1}), "frobnicate", "this gateway does not support it"),
    # Errors in two fields: the first one the request has is reported, as before.
    ("chat", dict(messages=QUESTION, temperature="x", n=0), "temperature", "Input should be a valid number"),
]


@pytest.mark.parametrize("name, value", [("min_tokens", 3), ("store", True), ("reasoning_effort", "low"),
                                         ("web_search_options", {}), ("truncate_prompt_tokens", 8),
                                         ("length_penalty", 1.0)])
def test_a_parameter_refused_by_design_is_refused_with_why_not_a_spelling_suggestion(client, name, value):
    """These were answered 'did you mean ...?' (min_tokens -> max_tokens, store -> stream): a caller who means them
    is told why the gateway refuses them."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=QUESTION, max_tokens=2, extra_body={name: value})
    error = refused.value.body
    assert error["param"] == name and "did you mean" not in error["message"]
    assert error["message"] == f"unsupported parameter {name!r}: {REFUSED_PARAMETERS[name]}"


@pytest.mark.parametrize("endpoint, arguments, param, words", REFUSED, ids=[f"{e}-{p}" for e, _, p, _ in REFUSED])
def test_a_refused_request_names_the_field_as_the_caller_wrote_it(client, endpoint, arguments, param, words):
    """Pydantic reports every branch of a union (`str | list[...]`): the message comes from the branch the input took
    and names the field without the branch's tag ('prompt', not 'prompt.constrained-str')."""
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    with pytest.raises(openai.BadRequestError) as refused:
        create(model="m", **{"max_tokens": 2, **arguments})
    error = refused.value.body
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert words in error["message"] and "str" not in error["param"] and "[" not in error["message"]


def test_models_retrieve_answers_for_the_served_model_only(client):
    assert client.models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("gpt-4")
    assert unknown.value.body["code"] == "model_not_found" and "serves 'm'" in unknown.value.body["message"]


def test_policies_keys_and_labels_are_refused_for_a_domain_requests_cannot_name(http, client):
    """A domain the gateway does not tell apart is served and counted as `other`: a policy, a key or labels stored for
    it would never apply, so they are refused with what to do instead."""
    answer = client.chat.completions.create(model="m", max_tokens=2, messages=QUESTION, metadata={"domain": "geo"})
    assert answer.choices[0].model_extra["calibration"]["domain"] == "other"
    refused = [http.put("/admin/policies/geo", json={"threshold": 0.5}, headers=ADMIN),
               http.post("/admin/keys", json={"name": "team-geo", "domains": ["science", "geo"]}, headers=ADMIN),
               http.post("/admin/labels/geo", json={"questions": [{"question": "q", "options": ["a", "b"], "answer": 0}]},
                         headers=ADMIN),
               http.put("/admin/capture/geo", json={"enabled": True}, headers=ADMIN)]
    for r in refused:
        error = r.json()["error"]
        assert (r.status_code, error["code"], error["param"]) == (404, "domain_not_found", "domain"), r.text
        assert "'geo' is not a domain this gateway serves" in error["message"] and "CALM_DOMAINS" in error["message"]
        assert "medicine, other, science" in error["message"] or "medicine, science" in error["message"]
    assert http.get("/admin/policies/geo", headers=ADMIN).status_code == 404  # nothing was stored
    assert http.post("/admin/keys", json={"name": "t", "domains": ["medicine"]}, headers=ADMIN).status_code == 201
    for domain in ("science", "medicine", "other", "default"):  # `other` and `default` hold policies too
        assert http.put(f"/admin/policies/{domain}", json={"threshold": 0.0}, headers=ADMIN).status_code == 200
    assert http.get("/health", headers=ADMIN).json()["domains"] == ["medicine", "other", "science"]


def test_a_misspelt_policy_field_is_named_with_the_one_meant(http):
    refused = http.put("/admin/policies/science", json={"treshold": 0.5}, headers=ADMIN)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "treshold"
    assert refused.json()["error"]["message"] == "invalid policy: unsupported parameter 'treshold': did you mean 'threshold'?"


def test_requests_refused_before_their_route_are_counted(tmp_path):
    """calm_requests_total / calm_errors_total missed requests refused at validation and 401s (65): a dashboard showed
    no errors while callers got them. Counted under the domain label `unresolved` (read before the domain is), on both
    the fast lane and the framework's path."""
    body = {"model": "m", "max_tokens": 2, "messages": QUESTION}
    with TestClient(make_app(tmp_path / "keys", require_api_keys=True)) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 401  # no key: refused in the fast lane
        assert http.post("/v1/chat/completions", json={**body, "messages": []}).status_code == 401  # the framework's
        metrics = http.get("/metrics").text
    assert 'calm_requests_total{domain="unresolved",endpoint="chat",status="401"} 2.0' in metrics
    assert 'calm_errors_total{domain="unresolved",endpoint="chat",type="authentication_error"} 2.0' in metrics
    with TestClient(make_app(tmp_path / "open")) as http:
        assert http.post("/v1/chat/completions", json={**body, "messages": []}).status_code == 400
        assert http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
                         ).status_code == 400
        metrics = http.get("/metrics").text
    assert 'calm_requests_total{domain="unresolved",endpoint="chat",status="400"} 1.0' in metrics
    assert 'calm_requests_total{domain="unresolved",endpoint="completions",status="400"} 1.0' in metrics


@pytest.mark.parametrize("method, path", [("post", "/v1/chat/completions"), ("post", "/v1/feedback"),
                                          ("post", "/admin/keys"), ("put", "/admin/policies/science")])
def test_a_json_body_sent_as_a_form_is_told_to_say_it_is_json(http, method, path):
    """curl -d sends application/x-www-form-urlencoded: FastAPI then reads no JSON and answered a bare 'Input should
    be a valid dictionary' with param null (65), while PUT /admin/policies, which reads its body itself, took it. One
    rule now: the caller is told what to send."""
    body = '{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "threshold": 0.5}'
    refused = getattr(http, method)(path, content=body, headers={**ADMIN,
                                                                 "Content-Type": "application/x-www-form-urlencoded"})
    assert refused.status_code == 400
    assert "Content-Type: application/json" in refused.json()["error"]["message"]


def test_a_multiple_choice_only_gateway_refuses_every_free_form_request_with_a_400_and_answers_options(tmp_path):
    """CALM_ANSWERS=multiple_choice starts no engine for free form: each way a free-form answer is asked for (chat,
    streamed or not, completions, the Responses API, free-form labels) is told so in OpenAI's error shape, never a 500
    or a 503 from the missing engine; multiple choice is answered as before, with options sent or written in the text."""
    from tests.test_gateway_logic import LetterEngine, science_app

    class Described(LetterEngine):
        def describe(self) -> dict:
            return {"kind": "fake"}

    with TestClient(science_app(tmp_path, Described(), answers="multiple_choice")) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        asked = [
            lambda: client.chat.completions.create(model="m", max_tokens=4, messages=QUESTION),
            lambda: client.chat.completions.create(model="m", max_tokens=4, messages=QUESTION, stream=True),
            lambda: client.completions.create(model="m", max_tokens=4, prompt="hello"),
            lambda: client.completions.create(model="m", max_tokens=4, prompt=["hello", "hello"]),
            lambda: client.responses.create(model="m", input="hello"),
            lambda: client.responses.create(model="m", input="hello", stream=True),
        ]
        for ask in asked:
            with pytest.raises(openai.BadRequestError) as refused:
                ask()
            error = refused.value.body
            assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "options",
                                                                      "free_form_not_served")
            assert error["message"] == ("this gateway serves multiple-choice answers only "
                                        "(CALM_ANSWERS=multiple_choice): send `options`")
        mixed = [{"question": "hello", "options": ["x", "y"], "answer": 0}, {"question": "hello", "answers": ["Hi"]}]
        labels = http.post("/admin/labels/science", json={"questions": mixed}, headers=ADMIN)
        assert (labels.status_code, labels.json()["error"]["param"]) == (400, "questions"), labels.text
        alone = http.post("/admin/labels/science", json={"questions": mixed[:1]}, headers=ADMIN).json()
        assert alone["labels"] == 1  # the refused upload stored none of its questions

        chosen = client.chat.completions.create(model="m", messages=QUESTION, extra_body={"options": ["x", "y"]})
        assert chosen.choices[0].message.content == "A"
        written = client.completions.create(model="m", max_tokens=1, prompt="hello\nA. x\nB. y\nAnswer:")
        assert written.choices[0].model_extra["calibration"]["mode"] == "multiple_choice"
        health = http.get("/health", headers=ADMIN).json()
        assert health["scoring"]["free_form"].startswith("refused: this gateway serves multiple-choice answers only")
        metrics = http.get("/metrics").text
    assert 'calm_requests_total{domain="other",endpoint="chat",status="400"} 2.0' in metrics
