"""Escalate and review policies, their logic: the policy rules, the request the target gets, reading its answer back,
and the hand-off through the app with a scripted engine (A at 0.7, B at 0.3) and a scripted target. The real round
trip (real engines, the official client) is in tests/test_openai_conformance.py."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from pydantic import ValidationError

from gateway.serving.escalation import TargetFailed, letter_of, read_reply, target_request
from gateway.edge.peer import HOP_HEADER, hop_value
from gateway.policy.policies import Policy
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
from tests.test_gateway_logic import LetterEngine, science_app

# The operator's targets (CALM_TARGETS); policies name them.
TARGETS = {"strong": {"url": "http://strong.example/v1", "api_key_env": "STRONG_KEY"},
           "strong-calm": {"url": "http://strong.example/v1", "api_key_env": "STRONG_KEY", "protocol": "calm"},
           "ops-hook": {"url": "http://ops.example/hook", "kind": "webhook"}}
TARGET = {"target": "strong", "model": "strong", "timeout_s": 5.0}
ADMIN = {"Authorization": "Bearer dev-admin-key"}


def test_policy_rules_for_escalate_and_review():
    policy = Policy.model_validate({"threshold": 0.6, "action": "escalate", "escalate": TARGET})
    assert policy.escalate.on_failure == "annotate" and policy.escalate.target == "strong"
    assert not {"url", "api_key_env", "api_key_file", "protocol"} & set(policy.model_dump()["escalate"])
    for bad, needle in [
        ({"threshold": 0.6, "action": "escalate"}, "needs an `escalate` target"),
        ({"threshold": 0.6, "escalate": TARGET}, "needs that action"),
        ({"threshold": 0.6, "action": "annotate", "review": {}}, "goes with action `review`"),
        ({"threshold": 0.6, "action": "escalate", "escalate": {**TARGET, "api_key_file": "/run/key"}}, "operator's"),
        ({"threshold": 0.6, "action": "escalate", "escalate": {**TARGET, "url": "http://x/v1"}}, "operator's"),
        ({"threshold": 0.6, "action": "escalate", "escalate": {**TARGET, "target": "a b"}}, "pattern"),
        ({"threshold": 0.6, "action": "escalate", "escalate": {"model": "strong"}}, "name the escalation target"),
        ({"threshold": 0.6, "action": "review", "review": {"webhook": "http://ops.example/hook"}}, "operator's"),
    ]:
        with pytest.raises(ValidationError, match=needle):
            Policy.model_validate(bad)
    assert Policy.model_validate({"target_risk": 0.2, "delta": 0.1, "action": "review"}).review is None


def test_the_target_gets_the_callers_request_with_options_as_letters_or_as_options():
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Largest?"}],
        "options": ["ant", "whale"], "metadata": {"domain": "science"}, "stream": True, "seed": 3,
        "calm": {"domain": "science", "version": "v1-abc", "threshold": 0.9}})
    path, body = target_request(req, "strong", "openai", 2, multiple_choice=True)
    assert path == "/chat/completions" and body["model"] == "strong" and body["n"] == 2 and body["stream"] is False
    assert body["temperature"] == 0.0 and body["seed"] == 3  # omitted temperature: greedy, as this gateway answers
    assert not {"options", "calm", "metadata", "stream_options"} & set(body)
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert "A. ant\nB. whale" in body["messages"][1]["content"] and body["messages"][1]["content"].count("Largest?") == 1
    _, body = target_request(req, "strong", "calm", 1, multiple_choice=True)
    assert body["options"] == ["ant", "whale"] and body["messages"][1]["content"] == "Largest?"
    assert body["calm"] == {"domain": "science", "threshold": 0.9} and body["metadata"] == {"domain": "science"}
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "Once", "max_tokens": 5, "logprobs": 2,
                                                   "temperature": 0.7})
    path, body = target_request(completion, "strong", "openai", 1, multiple_choice=False)
    assert path == "/completions" and body == {"model": "strong", "prompt": "Once", "max_tokens": 5, "logprobs": 2,
                                               "temperature": 0.7, "n": 1, "stream": False, "echo": False}


@pytest.mark.parametrize("text, letter", [
    ("B", "B"), ("B) whale", "B"), ("  (C). cat", "C"), ("The answer is C.", "C"), ("Answer: b", "B"),
    ("I think it is the whale.", "B"), ("A whale, clearly: B", "B"), ("A or B", None), ("Neither.", None),
    ("E", None),  # not one of the options
])
def test_the_letter_a_free_text_answer_names(text, letter):
    assert letter_of(text, ("A", "B", "C"), ("ant", "whale", "cat")) == letter


def test_reading_the_targets_reply():
    payload = {"choices": [
        {"index": 1, "message": {"content": "Lyon"}, "finish_reason": "stop"},
        {"index": 0, "message": {"content": "Paris"}, "finish_reason": "stop",
         "calibration": {"confidence": 0.91, "abstained": False},
         "logprobs": {"content": [{"token": "Paris", "logprob": -0.1, "top_logprobs": [{"token": "Paris", "logprob": -0.1}]}]}}],
        "usage": {"completion_tokens": 5}}
    first, second = read_reply(payload, 2, chat=True, letters=None, options=None)
    assert (first.text, first.confidence, first.abstained, first.completion_tokens) == ("Paris", 0.91, False, 3)
    assert (second.text, second.confidence, second.completion_tokens) == ("Lyon", None, 2)
    assert first.positions[0].token == "Paris" and first.positions[0].alternatives == (("Paris", -0.1),)
    with pytest.raises(TargetFailed, match="2 asked"):
        read_reply({"choices": payload["choices"][:1]}, 2, chat=True, letters=None, options=None)
    with pytest.raises(TargetFailed, match="not an OpenAI completion"):
        read_reply({"error": "nope"}, 1, chat=True, letters=None, options=None)
    with pytest.raises(TargetFailed, match="names none of the options"):
        read_reply({"choices": [{"message": {"content": "no idea"}}]}, 1, chat=True, letters=("A", "B"), options=None)


def gateway_app(tmp_path, target, **settings):
    """The app on the scripted engine, its escalation client answering through `target` (an httpx handler)."""
    app = science_app(tmp_path, LetterEngine(), **{"targets": TARGETS, **settings})
    app.state.gateway.shared.handoff.escalator._client = httpx.AsyncClient(transport=httpx.MockTransport(target))
    return app


def answering_b(seen: list):
    """A scripted target that answers "B" to every request, recording each in `seen`."""
    def target(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "B"}, "finish_reason": "stop"}],
                                         "usage": {"completion_tokens": 1}})
    return target


QUESTION = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "options": ["x", "y"],
            "metadata": {"domain": "science"}}


def test_unsure_answers_are_escalated_confident_ones_are_not_and_a_failing_target_falls_back(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    seen = []

    def target(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers, json.loads(request.content)))
        if request.headers.get("authorization") != "Bearer s3cret":
            return httpx.Response(401, json={"error": {"message": "bad key"}})
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "The answer is B."},
                                                      "finish_reason": "stop"}], "usage": {"completion_tokens": 4}})

    monkeypatch.setenv("STRONG_KEY", "s3cret")
    with TestClient(gateway_app(tmp_path, target)) as client:
        escalate = {"threshold": 0.8, "action": "escalate", "escalate": TARGET}
        assert client.put("/admin/policies/science", json=escalate, headers=ADMIN).status_code == 200
        assert "s3cret" not in json.dumps(client.get("/admin/policies/science", headers=ADMIN).json())
        out = client.post("/v1/chat/completions", json=QUESTION).json()
        choice = out["choices"][0]
        assert choice["message"]["content"] == "B" and choice["calibration"]["escalated"]
        assert choice["calibration"]["confidence"] == pytest.approx(0.7)  # the first model's, kept
        assert choice["calibration"]["escalation"]["target_model"] == "strong"
        headers, body = seen[-1]
        assert HOP_HEADER not in headers  # an OpenAI target is no peer gateway: no hop
        assert body["model"] == "strong" and "A. x\nB. y" in body["messages"][0]["content"]
        # Feedback on the escalated answer judges the target: kept apart, not a label of the first model.
        fb = client.post("/v1/feedback", json={"response_id": out["id"], "correct": True}).json()
        assert fb["escalated"] and fb["recorded"]
        metrics = client.get("/metrics").text
        assert 'calm_escalated_feedback_total{correct="true",domain="science"} 1.0' in metrics
        assert 'calm_feedback_total{correct="true",domain="science"}' not in metrics
        assert 'calm_escalations_total{domain="science",outcome="escalated"} 1.0' in metrics
        # A caller who writes the hop header is escalated as any other (no peer secret here, so no hop is one).
        calls = len(seen)
        forged = client.post("/v1/chat/completions", json=QUESTION, headers={HOP_HEADER: "1"}).json()["choices"][0]
        assert forged["calibration"]["escalated"] and len(seen) == calls + 1
        calls = len(seen)
        lower = {**escalate, "threshold": 0.5}
        assert client.put("/admin/policies/science", json=lower, headers=ADMIN).status_code == 200
        kept = client.post("/v1/chat/completions", json=QUESTION).json()["choices"][0]
        assert kept["message"]["content"] == "A" and kept["calibration"]["escalation"] is None and len(seen) == calls
        # The key is missing, then wrong: the first answer stands (annotate) or the message is sent (abstain).
        monkeypatch.delenv("STRONG_KEY")
        fell = client.post("/v1/chat/completions", json=QUESTION | {"calm": {"threshold": 0.9}}).json()["choices"][0]
        assert fell["message"]["content"] == "A" and not fell["calibration"]["escalated"]
        assert fell["calibration"]["escalation"]["fallback"] == (
            "api_key: the target's API key is not available on this gateway; the first answer stands")
        monkeypatch.setenv("STRONG_KEY", "wrong")
        withhold = {**escalate, "message": "Ask a person.", "escalate": {**TARGET, "on_failure": "abstain"}}
        assert client.put("/admin/policies/science", json=withhold, headers=ADMIN).status_code == 200
        fell = client.post("/v1/chat/completions", json=QUESTION | {"stream": True}).text
        assert "Ask a person." in fell and "the target refused the request" in fell and '"escalated": false' in fell
        # The target's own words stay in this gateway's log. Only the text shown is searched: the random
        # response id and the latency are digits that hold "401" now and then.
        shown = [text for event in fell.splitlines() if event.startswith("data: {")
                 for text in strings(json.loads(event[len("data: "):])["choices"])]
        assert "Ask a person." in shown and not [text for text in shown if "bad key" in text or "401" in text]
        metrics = client.get("/metrics").text
        assert 'calm_escalation_errors_total{domain="science",reason="status"} 1.0' in metrics
        assert 'calm_escalations_total{domain="science",outcome="fallback_abstain"} 1.0' in metrics


def strings(value) -> list[str]:
    """Every string inside a JSON value, keys left out."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [text for item in value for text in strings(item)] if isinstance(value, list) else []


def test_a_review_queues_the_withheld_answer_and_its_verdict_becomes_feedback(tmp_path):
    from fastapi.testclient import TestClient

    posted = []

    def webhook(request: httpx.Request) -> httpx.Response:
        posted.append(json.loads(request.content))
        return httpx.Response(204)

    with TestClient(gateway_app(tmp_path, webhook)) as client:
        policy = {"threshold": 0.8, "action": "review", "message": "A specialist will answer.",
                  "review": {"webhook": "ops-hook"}}
        assert client.put("/admin/policies/science", json=policy, headers=ADMIN).status_code == 200
        out = client.post("/v1/chat/completions", json=QUESTION).json()
        choice = out["choices"][0]
        assert choice["message"]["content"] == "A specialist will answer." and choice["calibration"]["abstained"]
        review_id = choice["calibration"]["review_id"]
        listed = client.get("/admin/reviews", headers=ADMIN).json()["data"]
        assert [(r["id"], r["answer"], r["status"], r["response_id"]) for r in listed] == [
            (review_id, "A", "open", out["id"])]
        assert listed[0]["confidence"] == pytest.approx(0.7) and listed[0]["request"]["options"] == ["x", "y"]
        assert listed[0]["answer_option"] == "x"  # what the withheld letter stands for, for the person judging it
        closed = client.post(f"/admin/reviews/{review_id}", json={"correct": False, "note": "it is y"}, headers=ADMIN)
        assert closed.status_code == 200 and closed.json()["status"] == "closed" and closed.json()["recorded"]
        again = client.post(f"/admin/reviews/{review_id}", json={"correct": False}, headers=ADMIN).json()
        assert again["recorded"] is False
        conflict = client.post(f"/admin/reviews/{review_id}", json={"correct": True}, headers=ADMIN)
        assert conflict.status_code == 409 and conflict.json()["error"]["type"] == "conflict_error"
        assert client.post("/admin/reviews/rev-0", json={"correct": True}, headers=ADMIN).status_code == 404
        assert client.get("/admin/reviews", params={"status": "closed"}, headers=ADMIN).json()["data"][0]["note"] == "it is y"
        assert client.get("/admin/reviews", params={"status": "later"}, headers=ADMIN).status_code == 400
        assert client.get("/admin/reviews").status_code == 401
        metrics = client.get("/metrics").text
        assert 'calm_feedback_total{correct="false",domain="science"} 1.0' in metrics
        assert 'calm_online_accuracy{domain="science"} 0.0' in metrics
        assert 'calm_reviews_total{domain="science",event="opened"} 1.0' in metrics
        assert 'calm_reviews_total{domain="science",event="closed"} 1.0' in metrics
        # The verdict is a label of the first model's answer at its confidence (guaranteed-risk fits read these).
        assert client.app.state.gateway.store.labelled_answers("science") == ([pytest.approx(0.7)], [False])
    assert posted and posted[0]["review_id"] == review_id and posted[0]["answer"] == "A"
    assert posted[0]["answer_option"] == "x"


@pytest.mark.parametrize("action", ["escalate", "review"])
def test_only_a_peer_gateways_signed_hop_skips_the_hand_off_and_then_the_answer_is_withheld(tmp_path, monkeypatch,
                                                                                         action):
    """X-Calm-Escalated once let any caller skip review with `: 1` and get the withheld answer (63). A hop counts only
    when signed for this very body with the fleet's peer secret and fresh; then this gateway does not hand the
    request off again, and an answer its policy would hand off is withheld, never returned."""
    from fastapi.testclient import TestClient

    seen = []
    target = answering_b(seen)

    monkeypatch.setenv("STRONG_KEY", "s3cret")
    policy = {"threshold": 0.8, "action": action, "message": "Ask a person."}
    policy |= {"escalate": {**TARGET, "target": "strong-calm"}} if action == "escalate" else {}
    with TestClient(gateway_app(tmp_path, target, peer_secret="fleet-secret")) as client:
        assert client.put("/admin/policies/science", json=policy, headers=ADMIN).status_code == 200
        body = json.dumps(QUESTION).encode()
        send = lambda hop: client.post("/v1/chat/completions", content=body, headers={  # noqa: E731
            "Content-Type": "application/json", **({HOP_HEADER: hop} if hop else {})}).json()["choices"][0]
        handed_off = [send(hop) for hop in (None, "1", hop_value("wrong-secret", body), hop_value("fleet-secret", b"{}"),
                                            hop_value("fleet-secret", body, now=time.time() - 3600))]
        for choice in handed_off:  # none of these is a peer's hop: the policy hands the answer off
            cal = choice["calibration"]
            assert cal["escalated"] if action == "escalate" else cal["review_id"], choice
        calls, reviews = len(seen), len(client.get("/admin/reviews", headers=ADMIN).json()["data"])
        peer = send(hop_value("fleet-secret", body))
        assert peer["message"]["content"] == "Ask a person." and peer["calibration"]["abstained"]
        assert not peer["calibration"]["escalated"] and peer["calibration"]["review_id"] is None
        assert len(seen) == calls and len(client.get("/admin/reviews", headers=ADMIN).json()["data"]) == reviews
        if action == "escalate":  # this gateway's own hop to a CALM target is signed for what it sends
            sent = seen[0]
            assert sent.headers[HOP_HEADER] == hop_value("fleet-secret", sent.content, now=int(sent.headers[HOP_HEADER].split(".")[0]))


def test_a_key_file_that_is_not_one_key_is_never_sent_and_no_upstream_text_reaches_the_caller(tmp_path):
    """An `escalate` policy with `api_key_file: /etc/passwd` once sent the file as a Bearer token, and the transport's
    error, quoting it, came back to the client in `escalation.fallback` (63). A key file must hold one token; a
    failure is described to the caller by its kind only."""
    from fastapi.testclient import TestClient

    sent = []
    secret_file = tmp_path / "passwd"
    secret_file.write_text("root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n")

    def target(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500, text="upstream exploded: internal hostname db-7.corp")

    filed = {"url": "http://strong.example/v1", "api_key_file": str(secret_file)}
    with TestClient(gateway_app(tmp_path, target, targets={"filed": filed})) as client:
        policy = {"threshold": 0.8, "action": "escalate", "escalate": {**TARGET, "target": "filed"}}
        assert client.put("/admin/policies/science", json=policy, headers=ADMIN).status_code == 200
        text = json.dumps(client.post("/v1/chat/completions", json=QUESTION).json())
        assert not sent and "root:x" not in text and "daemon" not in text
        assert "the target's API key is not available on this gateway" in text
        secret_file.write_text("one-key\n")
        text = json.dumps(client.post("/v1/chat/completions", json=QUESTION).json())
        assert sent[-1].headers["authorization"] == "Bearer one-key"
        assert "the target refused the request" in text and "exploded" not in text and "db-7" not in text


@pytest.mark.parametrize("value", ["²³.00", "1" * 5000 + "." + "0" * 64, "1." + "é" * 64, "12.abc", ".", "1" * 12])
def test_a_malformed_hop_is_no_hop_and_no_error(value):
    """With a secret set, a header a caller wrote in any shape is simply not a hop (int() refused '²', a 5,000-digit
    time, and compare_digest a non-ASCII MAC)."""
    from gateway.edge.peer import is_peer_hop

    assert is_peer_hop("s", value, b"{}") is False
