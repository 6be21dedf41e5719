"""The gateway as users meet it: the official `openai` client against `calm serve` running the real vLLM engine
(in-process) on the embedded model, with a non-trivial α head whose effect is checked against HF transformers."""

from __future__ import annotations

from http.client import HTTPConnection
import json
import math
import time

import httpx
import numpy as np
import openai
import pytest

from calm_core.alpha_head import AlphaHead, apply_alpha
from calm_core.scoring import option_probs
from calm_core.artifact import load_artifact, save_artifact
from calm_core.data import load_mc
from calm_core.prompts import letter_prompt, letter_token_ids
from tests.servers import calm_argv, free_port, http, running

pytestmark = pytest.mark.slow
MODEL = "calm-smollm2-135m"
ADMIN = {"Authorization": "Bearer test-admin-key"}
LETTER_SCALE = [1.6, 0.6, 1.3, 0.8, 1.0]
LETTER_SHIFT = [0.4, -0.3, 0.6, 0.0, 0.2]


@pytest.fixture(scope="module")
def test_artifact(tmp_path_factory, embedded_model):
    """The shipped artifact's references with a letter-format head (no adapter) that rescales and shifts only the
    answer letters A-E."""
    from calm_cli.serving import DEFAULT_ARTIFACTS

    base = load_artifact(next(iter(DEFAULT_ARTIFACTS.values())))
    _, tokenizer = embedded_model
    vocab = base.manifest.tokenizer.vocab_size
    scale, shift = np.ones(vocab, dtype=np.float32), np.zeros(vocab, dtype=np.float32)
    ids = letter_token_ids(tokenizer)[:5]
    scale[ids], shift[ids] = LETTER_SCALE, LETTER_SHIFT
    path = tmp_path_factory.mktemp("artifact") / "test-head"
    m = base.manifest
    save_artifact(path, AlphaHead(scale, shift), base_model=m.base_model, tokenizer=m.tokenizer, method="test",
                  reference_histograms=m.reference_histograms)
    return path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, test_artifact, embedded_model_dir):
    tmp = tmp_path_factory.mktemp("gateway")
    port = free_port()
    # Outside development, with client keys off explicitly: these tests ask without keys (tests/test_client_keys.py
    # covers keys).
    env = {"CALM_DB_PATH": str(tmp / "gw.sqlite3"), "CALM_ADMIN_KEY": "test-admin-key", "CALM_ENVIRONMENT": "test",
           "CALM_REQUIRE_API_KEYS": "false"}
    argv = calm_argv("serve", "--port", str(port), "--artifact", str(test_artifact))
    with running(argv, f"http://127.0.0.1:{port}/health", tmp / "gateway.log", env):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)


def calibration(choice) -> dict:
    return choice.model_extra["calibration"]


def test_models_and_health(client, gateway):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = http.get(f"{gateway}/health", headers=ADMIN).json()
    assert health["status"] == "ok" and health["artifact_version"].startswith("test-")


def test_an_idle_connection_outlives_uvicorns_5_s_default(gateway):
    """A client (or balancer) reusing a connection after 6 s idle is answered on it: with uvicorn's default the gateway
    closed it at 5 s, and a request sent at that moment failed with no answer (CALM_KEEP_ALIVE_S, default 75)."""
    conn = HTTPConnection(gateway.removeprefix("http://"), timeout=30)
    conn.request("GET", "/health/live")
    first = conn.getresponse()
    first.read()  # the whole answer read: the connection is idle and reusable
    assert first.status == 200
    sock = conn.sock
    time.sleep(6)  # the idle time under test, not a wait for an event
    conn.request("GET", "/health/live")  # http.client does not reconnect: a closed connection raises here or below
    response = conn.getresponse()
    assert response.status == 200 and conn.sock is sock
    conn.close()


def test_multiple_choice_confidence_equals_alpha_head_on_hf_logits(client, embedded_model, shared_data):
    """Gateway confidence = softmax over the options of d ⊙ z + l, z from HF transformers (fp32, 1e-3)."""
    import torch

    from training.scoring import last_position_logits

    model, tokenizer = embedded_model
    questions = [q for q in load_mc("arc_easy", "dev", root=shared_data) if q.n_options == 4][:6]
    ids = np.asarray(letter_token_ids(tokenizer)[:4])
    changed = 0
    for q in questions:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q.question}],
                                           extra_body={"options": list(q.choices)}, metadata={"domain": "science"})
        cal = calibration(r.choices[0])
        with torch.inference_mode():
            z = last_position_logits(model, tokenizer, [letter_prompt(tokenizer, q)])[0, ids].double().numpy()
        calibrated = option_probs(apply_alpha(z, np.array(LETTER_SCALE[:4]), np.array(LETTER_SHIFT[:4]))[None])[0]
        raw = option_probs(z[None])[0]
        chosen = "ABCD".index(r.choices[0].message.content)
        assert chosen == int(np.argmax(calibrated))  # greedy answer under the calibrated distribution
        assert cal["mode"] == "multiple_choice" and cal["domain"] == "science"
        assert cal["confidence"] == pytest.approx(calibrated[chosen], abs=1e-3)
        assert cal["raw_confidence"] == pytest.approx(raw[chosen], abs=1e-3)
        np.testing.assert_allclose([o["probability"] for o in cal["options"]], calibrated, atol=1e-3)
        changed += abs(cal["confidence"] - cal["raw_confidence"]) > 0.01
    assert changed >= 3  # the head really acts inside the engine


def test_options_question_in_the_prompt_is_detected(client):
    text = "Which gas do plants absorb?\nA. oxygen\nB. carbon dioxide\nC. helium\nAnswer with a letter."
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}])
    cal = calibration(r.choices[0])
    assert cal["mode"] == "multiple_choice" and r.choices[0].message.content in "ABC"
    assert len(cal["options"]) == 3 and sum(o["probability"] for o in cal["options"]) == pytest.approx(1.0)
    assert cal["domain"] == "other"


def test_a_responses_api_answer_is_the_chat_answer_on_the_real_engine(client):
    """The same multiple-choice question through /v1/responses and /v1/chat/completions: the same option and the same
    calibrated distribution (one path), and a free-form answer with the same text and confidence."""
    question, options = "Which gas do plants absorb?", ["oxygen", "carbon dioxide", "helium"]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          extra_body={"options": options}, metadata={"domain": "science"})
    response = client.responses.create(model=MODEL, input=question, extra_body={"options": options},
                                       metadata={"domain": "science"})
    mine, theirs = response.model_extra["calibration"], calibration(chat.choices[0])
    assert response.output_text == chat.choices[0].message.content and mine["mode"] == "multiple_choice"
    assert [o["probability"] for o in mine["options"]] == pytest.approx([o["probability"] for o in theirs["options"]],
                                                                        abs=1e-6)
    asked = "What is the capital of France?"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": asked}], max_tokens=8)
    response = client.responses.create(model=MODEL, input=asked, max_output_tokens=8)
    assert response.output_text == chat.choices[0].message.content
    assert response.model_extra["calibration"]["confidence"] == pytest.approx(calibration(chat.choices[0])["confidence"],
                                                                             abs=1e-6)


def test_free_form_confidence_is_geometric_mean_of_token_probabilities(client):
    """This artifact's head reorders tokens (it moves the letters only), so its answers are drawn from the weights
    without it and read back through it (calm_core/scorers/free_form.py): the log-probs returned are the draw's, the
    weights' own, whose geometric mean is the raw confidence; the head's renormalisation moves the confidence."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=12, logprobs=True, extra_body={"calm": {"raw_confidence": True}})
    choice = r.choices[0]
    lps = [t.logprob for t in choice.logprobs.content]
    cal = calibration(choice)
    assert cal["mode"] == "free_form" and choice.message.content
    assert len(lps) == r.usage.completion_tokens > 0
    assert cal["raw_confidence"] == pytest.approx(math.exp(sum(lps) / len(lps)), rel=1e-4)
    assert abs(cal["confidence"] - cal["raw_confidence"]) > 0.01
    assert 0 < cal["confidence"] <= 1 and cal["entropy"] >= 0


def test_semantic_confidence_answers_as_token_mode_and_samples_in_one_call(client):
    ask = lambda **calm: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=12,
        temperature=0, extra_body={"calm": calm})
    token, r = ask(), ask(confidence="semantic", samples=8, raw_confidence=True)
    cal = calibration(r.choices[0])
    sizes = [c["size"] for c in cal["clusters"]]
    assert cal["method"] == "semantic" and sum(sizes) == 8 and sizes == sorted(sizes, reverse=True)
    assert r.choices[0].message.content == token.choices[0].message.content  # the answer is never a sample
    assert 0 <= cal["raw_confidence"] * 8 == round(cal["raw_confidence"] * 8) <= 8 and 0 < cal["confidence"] < 1
    assert r.usage.completion_tokens > token.usage.completion_tokens  # eight sampled answers were generated too


def test_completions_endpoint(client):
    r = client.completions.create(model=MODEL, prompt="The capital of Italy is", max_tokens=6, temperature=0)
    assert r.choices[0].text and calibration(r.choices[0])["mode"] == "free_form"
    mc = client.completions.create(model=MODEL, prompt="Which is a mammal?", max_tokens=1,
                                   extra_body={"options": ["shark", "whale", "trout"]})
    assert mc.choices[0].text in "ABC" and calibration(mc.choices[0])["mode"] == "multiple_choice"


def test_streaming_matches_non_streaming_and_ends_with_calibration(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    last = chunks[-1].choices[0]
    assert last.finish_reason == full.choices[0].finish_reason
    assert last.model_extra["calibration"]["confidence"] == pytest.approx(calibration(full.choices[0])["confidence"], abs=1e-6)
    assert all("calibration" not in (c.choices[0].model_extra or {}) for c in chunks[:-1])
    stream = list(client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0, stream=True))
    assert stream[-1].choices[0].model_extra["calibration"]["mode"] == "free_form"


def test_abstention_policy_and_stricter_request(client, gateway):
    q = {"messages": [{"role": "user", "content": "Which is largest?"}], "extra_body": {"options": ["ant", "dog", "whale"]}}
    r = http.put(f"{gateway}/admin/policies/science", headers=ADMIN,
                  json={"threshold": 1.0, "action": "abstain", "message": "Routing to a human."})
    assert r.status_code == 200 and r.json()["version"] == 1
    out = client.chat.completions.create(model=MODEL, metadata={"domain": "science"}, **q)
    cal = calibration(out.choices[0])
    assert cal["abstained"] and out.choices[0].message.content == "Routing to a human.", cal
    assert cal["threshold"] == 1.0 and cal["policy"] == "science:v1"
    # A looser threshold in the request does not loosen the policy.
    extra = {**q["extra_body"], "calm": {"threshold": 0.1}}
    loose = client.chat.completions.create(model=MODEL, metadata={"domain": "science"}, messages=q["messages"], extra_body=extra)
    assert calibration(loose.choices[0])["threshold"] == 1.0 and calibration(loose.choices[0])["abstained"]
    # Other domains fall back to the built-in annotate policy; a stricter request threshold annotates.
    extra = {**q["extra_body"], "calm": {"threshold": 1.0}}
    other = client.chat.completions.create(model=MODEL, messages=q["messages"], extra_body=extra)
    cal = calibration(other.choices[0])
    assert cal["threshold"] == 1.0 and cal["confidence"] < 1.0 and not cal["abstained"] and other.choices[0].message.content in "ABC"
    # Streaming with an abstain policy never shows the withheld answer.
    chunks = list(client.chat.completions.create(model=MODEL, metadata={"domain": "science"}, stream=True, **q))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Routing to a human."
    assert http.delete(f"{gateway}/admin/policies/science", headers=ADMIN).status_code == 200
    audit = http.get(f"{gateway}/admin/audit", params={"domain": "science"}, headers=ADMIN).json()["data"]
    assert [a["action"] for a in audit][:2] == ["delete", "create"]


def test_target_risk_policy_derives_threshold_from_reference(gateway):
    r = http.put(f"{gateway}/admin/policies/medicine", headers=ADMIN, json={"target_risk": 0.4})
    assert r.status_code == 200
    assert 0.0 < r.json()["effective_threshold"] <= 1.0
    http.delete(f"{gateway}/admin/policies/medicine", headers=ADMIN)


def test_feedback_is_idempotent_and_feeds_online_metrics(client, gateway):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Which is a fruit?"}],
                                       extra_body={"options": ["apple", "stone"]}, metadata={"domain": "commonsense"})
    first = http.post(f"{gateway}/v1/feedback", json={"response_id": r.id, "correct": True})
    again = http.post(f"{gateway}/v1/feedback", json={"response_id": r.id, "correct": True})
    assert first.status_code == again.status_code == 200
    assert first.json()["recorded"] and not again.json()["recorded"]
    conflict = http.post(f"{gateway}/v1/feedback", json={"response_id": r.id, "correct": False})
    assert conflict.status_code == 409 and conflict.json()["error"]["type"] == "conflict_error"
    metrics = http.get(f"{gateway}/metrics").text
    assert 'calm_online_accuracy{domain="commonsense"} 1.0' in metrics
    assert 'calm_feedback_total{correct="true",domain="commonsense"} 1.0' in metrics
    assert 'calm_confidence_bucket{domain="commonsense"' in metrics
    assert 'calm_drift_psi{domain="commonsense"}' in metrics
    assert "Which is a fruit" not in metrics  # no prompt text in labels


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ('{"model": "calm-smollm2-135m", "messages": [', 400, "not valid JSON"),
        ({"model": MODEL, "messages": "hello"}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
        ({"model": MODEL, "messages": []}, 400, "at least 1"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "  "}]}, 400, "non-empty user message"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400, "limit"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 4000}]}, 400, "maximum context length"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "n"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "best_of": 2}, 400, "unsupported parameter 'best_of'"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "needs logprobs"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
         400, "stream is true"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 5}}, 400,
         "outside the vocabulary"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "Which?"}], "options": ["a", "b"], "logit_bias": {"5": 1}},
         400, "logit_bias does not apply to multiple-choice"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "options": ["only one"]}, 400, "options"),
    ],
)
def test_bad_chat_requests(gateway, body, status, needle):
    content = body if isinstance(body, str) else json.dumps(body)
    resp = http.post(f"{gateway}/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert needle in error_of(resp, status)["message"]


def test_bad_input_through_the_official_client(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="", max_tokens=4)


def test_bad_admin_and_feedback_requests(gateway):
    url = f"{gateway}/admin/policies/science"
    assert error_of(http.put(url, json={"threshold": 0.5}), 401)["type"] == "authentication_error"
    assert error_of(http.put(url, json={"threshold": 0.5}, headers={"Authorization": "Bearer nope"}), 403)
    assert "threshold" in error_of(http.put(url, json={"threshold": 2}, headers=ADMIN), 400)["message"]
    assert "exactly one" in error_of(http.put(url, json={"action": "abstain"}, headers=ADMIN), 400)["message"]
    assert error_of(http.put(url, json={"threshold": 0.5, "action": "shout"}, headers=ADMIN), 400)
    assert error_of(http.put(f"{gateway}/admin/policies/Bad%20Name", json={"threshold": 0.5}, headers=ADMIN), 400)
    assert error_of(http.get(f"{gateway}/admin/policies/none", headers=ADMIN), 404)
    fb = f"{gateway}/v1/feedback"
    assert "no response" in error_of(http.post(fb, json={"response_id": "chatcmpl-unknown", "correct": True}), 404)["message"]
    assert error_of(http.post(fb, json={"response_id": "x", "correct": "yes"}), 400)
    assert error_of(http.post(fb, json={"correct": True}), 400)


def test_every_dashboard_query_returns_the_gateways_series(gateway, client, shared_data, tmp_path):
    """A real Prometheus scrapes this gateway after the tests above (answers, feedback, bad requests) and a
    guaranteed-risk policy with uploaded labels and feedback; every query of every panel of the Grafana dashboard
    (gateway/observe/dashboard.py) returns series, those of per-domain panels each with a `domain` label."""
    import shutil
    import time

    from gateway.observe.dashboard import panels
    from tests.servers import wait_until

    questions = [q for q in load_mc("medmcqa", "dev", root=shared_data) if q.n_options == 4][:40]
    # A loose target (the letter head here is near chance) so that the answers sent after the fit are kept.
    policy = {"target_risk": 0.95, "delta": 0.5, "min_labels": 30, "fallback": "label_free", "action": "annotate"}
    assert http.put(f"{gateway}/admin/policies/medicine", json=policy, headers=ADMIN).status_code == 200
    labels = [{"question": q.question, "options": list(q.choices), "answer": q.answer} for q in questions[:30]]
    r = http.post(f"{gateway}/admin/labels/medicine", json={"questions": labels}, headers=ADMIN, timeout=300)
    assert r.status_code == 200, r.text
    for q in questions[30:]:
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q.question}],
                                                extra_body={"options": list(q.choices)}, metadata={"domain": "medicine"})
        http.post(f"{gateway}/v1/feedback", json={"response_id": answer.id, "correct": True}).raise_for_status()
    traffic_ended = time.time()

    port = free_port()
    (tmp_path / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s}}
scrape_configs:
  - job_name: calm-gateway
    static_configs: [{{targets: ["{gateway.removeprefix('http://')}"]}}]
""")
    argv = [shutil.which("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"]
    prometheus = f"http://127.0.0.1:{port}"

    def query(expr: str) -> list[dict]:
        return http.get(f"{prometheus}/api/v1/query", params={"query": expr}).json()["data"]["result"]

    with running(argv, f"{prometheus}/-/ready", tmp_path / "prom.log", timeout=60):
        # Rates need two scrapes after the traffic: wait for the second one's sample.
        wait_until("two scrapes after the traffic", lambda: (s := query("count_over_time(up[1m])")) and
                   float(s[0]["value"][1]) >= 2 and float(query("timestamp(up)")[0]["value"][1]) > traffic_ended + 1,
                   120, 0.2)
        empty = []
        for spec in panels():
            for q in spec.queries:
                expr = q.expr.replace("$domain", ".*").replace("$__rate_interval", "1m")
                series = query(expr)
                if not series or (spec.per_domain and not all("domain" in s["metric"] for s in series)):
                    empty.append((spec.title, expr, series[:2]))
        assert empty == [], empty
        versions = query('calm_serving_version_info{domain="medicine"}')
        assert versions and versions[0]["metric"]["version"]
