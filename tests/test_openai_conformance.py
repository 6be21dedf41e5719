"""OpenAI wire conformance: the same requests, through the official `openai` client, to vLLM's own OpenAI server
(`calm engine`, identity head) and to the gateway (identity artifact; in-process engine, and upstream over the same
server). Where both answer, the gateway's response must parse into the SDK's typed models and equal vLLM's (texts,
finish reasons, token strings, log-probs to 1e-3, usage) plus a calibration object per choice; where the gateway
refuses a parameter by design, it must be a 400 in the OpenAI error shape that names the parameter.

The same servers carry the escalate and review policies end to end: the in-process gateway answers first, vLLM's
server (plain OpenAI) or the upstream gateway (a CALM gateway) is the stronger target.

The suite records what it saw and writes the compatibility table of docs/api.md (tests/recorded.py: `conformance.md`); the last test
checks that the page carries that table.
"""

from __future__ import annotations

import json
import math
import socket
from dataclasses import dataclass, field

import openai
import pytest

from scripts.readme_numbers import page_of, read_block
from tests.recorded import results_dir
from tests.servers import calm_argv, free_port, http, metric_values, running

pytestmark = pytest.mark.slow
MODEL = "calm-smollm2-135m"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
COUNT = [{"role": "user", "content": "Count from one to ten, separated by commas."}]
JSON_ASK = [{"role": "user", "content": "Give a JSON object with the name and age of a person."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PARIS = 7042  # " Paris" in the embedded model's vocabulary


@dataclass(frozen=True)
class Case:
    row: str  # the documented table's parameter column
    endpoint: str  # "chat" | "completions"
    kwargs: dict
    refused: str | None = None  # the parameter the gateway names in its 400, when it refuses by design
    why: str = ""  # the reason, for the table
    check: str | None = None  # an extra property the answer must have (so the case cannot pass vacuously)


CASES = [
    Case("`logprobs` + `top_logprobs` (chat)", "chat", dict(messages=CAPITAL, max_tokens=8, logprobs=True, top_logprobs=3)),
    Case("`logprobs` (completions)", "completions", dict(prompt="The capital of France is", max_tokens=6, logprobs=3)),
    Case("`echo` (completions)", "completions", dict(prompt="The capital of France is", max_tokens=4, echo=True)),
    Case("`echo` + `logprobs` (completions)", "completions",
         dict(prompt="The capital of France is", max_tokens=4, echo=True, logprobs=1), refused="echo",
         why="would return the prompt's log-probs, which are taken before the α head (not calibrated)"),
    Case("`suffix` (completions)", "completions", dict(prompt="def add(a, b):", suffix="return c", max_tokens=4),
         refused="suffix", why="the model has no fill-in-the-middle template"),
    Case("`n` (chat)", "chat", dict(messages=CAPITAL, max_tokens=8, n=3, temperature=1.0, seed=11), check="distinct"),
    Case("`n` (completions)", "completions", dict(prompt="Once upon a time", max_tokens=8, n=2, temperature=1.0, seed=5),
         check="distinct"),
    Case("`prompt` list (completions)", "completions",
         dict(prompt=["Once upon a time", "The capital of France is"], max_tokens=6, logprobs=2)),
    Case("`prompt` list + `n` + `stream` (completions)", "completions",
         dict(prompt=["Once upon a time", "1, 2, 3,"], max_tokens=6, n=2, temperature=1.0, seed=5, stream=True,
              stream_options={"include_usage": True}), check="distinct"),
    Case("`stop` (string)", "chat", dict(messages=COUNT, max_tokens=40, stop="4."), check="stopped"),
    Case("`stop` (list)", "completions", dict(prompt="1, 2, 3, 4,", max_tokens=30, stop=["7", "9"]), check="stopped"),
    Case("`seed`", "chat", dict(messages=CAPITAL, max_tokens=12, temperature=1.0, seed=1234)),
    Case("`max_tokens`", "chat", dict(messages=COUNT, max_tokens=5), check="length"),
    Case("`max_completion_tokens`", "chat", dict(messages=COUNT, max_completion_tokens=7), check="length"),
    Case("`temperature` / `top_p` / `top_k` / `min_p`", "chat",
         dict(messages=CAPITAL, max_tokens=12, temperature=0.8, top_p=0.9, seed=3, extra_body={"top_k": 20, "min_p": 0.05})),
    Case("`presence_penalty` / `frequency_penalty`", "chat",
         dict(messages=COUNT, max_tokens=24, presence_penalty=1.5, frequency_penalty=1.0)),
    Case("`repetition_penalty`", "completions",
         dict(prompt="1, 2, 3, 4,", max_tokens=16, extra_body={"repetition_penalty": 1.5})),
    Case("`logit_bias`", "chat", dict(messages=CAPITAL, max_tokens=8, logit_bias={str(PARIS): -100}), check="no_paris"),
    Case("`response_format` `json_object`", "chat",
         dict(messages=JSON_ASK, max_tokens=24, response_format={"type": "json_object"}), check="json_start"),
    Case("`response_format` `json_schema`", "chat",
         dict(messages=JSON_ASK, max_tokens=40,
              response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}),
         check="json"),
    Case("`stream` + `stream_options.include_usage` (chat)", "chat",
         dict(messages=CAPITAL, max_tokens=8, stream=True, stream_options={"include_usage": True}, logprobs=True,
              top_logprobs=2)),
    Case("`stream` + `stream_options.include_usage` (completions)", "completions",
         dict(prompt="The capital of France is", max_tokens=6, stream=True, stream_options={"include_usage": True},
              logprobs=1)),
    Case("`/v1/responses`: `input` text, `max_output_tokens`", "responses",
         dict(input="What is the capital of France?", max_output_tokens=8)),
    Case("`/v1/responses`: `instructions`, `input` messages", "responses",
         dict(instructions="Answer briefly.", input=[{"role": "user", "content": "Name a primary colour."},
                                                     {"role": "assistant", "content": "Red."},
                                                     {"role": "user", "content": [{"type": "input_text", "text": "Another?"}]}],
              max_output_tokens=12)),
    Case("`/v1/responses`: `include` log-probs + `top_logprobs`", "responses",
         dict(input="What is the capital of France?", max_output_tokens=6, include=["message.output_text.logprobs"],
              top_logprobs=3)),
    Case("`/v1/responses` + `stream` (log-probs included)", "responses",
         dict(input="Count from one to ten, separated by commas.", max_output_tokens=10, stream=True,
              include=["message.output_text.logprobs"], top_logprobs=2)),
    Case("`user`, `metadata`", "chat", dict(messages=CAPITAL, max_tokens=6, user="u-42", metadata={"team": "qa"})),
    Case("`tools` / `tool_choice`", "chat",
         dict(messages=CAPITAL, max_tokens=8, tool_choice="auto", tools=[{"type": "function", "function": {
             "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]),
         refused="tool", why="no tool-call parser is configured in the engine"),
    Case("other vLLM extras (`ignore_eos`, `min_tokens`, `best_of`, …)", "chat",
         dict(messages=CAPITAL, max_tokens=4, extra_body={"ignore_eos": True}), refused="ignore_eos",
         why="not implemented; refused rather than ignored"),
]


@dataclass
class Outcome:
    vllm: str = ""
    gateway: dict[str, str] = field(default_factory=dict)


OUTCOMES: dict[str, Outcome] = {}


@pytest.fixture(scope="module")
def identity_artifact(tmp_path_factory):
    from training.artifacts import write_identity_artifact

    path = tmp_path_factory.mktemp("identity") / "artifact"
    write_identity_artifact(path, with_reference=False)
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, identity_artifact, embedded_model_dir):
    """vLLM's server, the gateway in-process, and the gateway upstream over that server (all identity heads): their
    base URLs, and the in-process gateway's database."""
    tmp = tmp_path_factory.mktemp("conformance")
    engine_port, gw_port, up_port, down_port = free_port(), free_port(), free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    silent = socket.socket()  # accepts connections and never answers: a hung target
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    local = lambda port, **more: {"url": f"http://127.0.0.1:{port}/v1", "private": True, **more}  # noqa: E731
    # The operator's targets the escalation tests' policies name (all on this host, so `private`).
    targets = {"vllm": local(engine_port), "calm-gateway": local(up_port, protocol="calm"), "down": local(down_port),
               "silent": local(silent.getsockname()[1])}
    # One registry folder: the upstream gateway names its version per request and the engine resolves it there.
    common = {"CALM_ARTIFACT": str(identity_artifact), "CALM_ENVIRONMENT": "development",
              "CALM_REGISTRY_DIR": str(tmp / "registry")}
    with running(calm_argv("engine", "--port", str(engine_port)), f"{engine_url}/health", tmp / "engine.log",
                 {**common, "VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=300), \
         running(calm_argv("serve", "--port", str(gw_port)), f"http://127.0.0.1:{gw_port}/health", tmp / "gw.log",
                 {**common, "CALM_DB_PATH": str(tmp / "gw.db"), "CALM_DOMAINS": '["escalation", "triage"]',
                  "CALM_TARGETS": json.dumps(targets)}), \
         running(calm_argv("serve", "--port", str(up_port)), f"http://127.0.0.1:{up_port}/health", tmp / "up.log",
                 {**common, "CALM_DB_PATH": str(tmp / "up.db"), "CALM_ENGINE": "upstream",
                  "CALM_UPSTREAM_URLS": f'["{engine_url}"]'}):
        yield {"vllm": engine_url, "inprocess": f"http://127.0.0.1:{gw_port}", "upstream": f"http://127.0.0.1:{up_port}",
               "db": tmp / "gw.db"}
    silent.close()


@pytest.fixture(scope="module")
def clients(stack):
    return {name: openai.OpenAI(base_url=f"{stack[name]}/v1", api_key="unused", max_retries=0, timeout=120)
            for name in ("vllm", "inprocess", "upstream")}


def call(client: openai.OpenAI, case: Case):
    """The SDK's typed response (streams: the list of chunks), or the APIStatusError. Temperature is explicit:
    omitted, vLLM samples at 1.0 and the gateway answers greedily (docs/api.md)."""
    api = {"chat": client.chat.completions, "completions": client.completions, "responses": client.responses}[case.endpoint]
    try:
        result = api.create(model=MODEL, **{"temperature": 0.0, **case.kwargs})
        return list(result) if case.kwargs.get("stream") else result
    except openai.APIStatusError as e:
        return e


def _text(choice) -> str:
    return choice.message.content if hasattr(choice, "message") else choice.text


def _logprob_rows(choice) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token, log-prob, alternatives) per position, through the SDK's typed models (chat and completions)."""
    lp = choice.logprobs
    if lp is None:
        return []
    if hasattr(lp, "content"):
        return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in lp.content or []]
    return [(tok, v, list((alts or {}).items())) for tok, v, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)]


def _response_choice(response) -> dict:
    """A Responses API response as the one choice it holds (its status standing for the finish reason)."""
    rows = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs or []])
            for item in response.output for part in item.content for t in part.logprobs or []]
    return {"text": response.output_text, "finish": response.status, "rows": rows,
            "calibration": (response.model_extra or {}).get("calibration")}


def _response_usage(response) -> dict:
    u = response.usage
    return {"prompt_tokens": u.input_tokens, "completion_tokens": u.output_tokens, "total_tokens": u.total_tokens}


def _merge_stream(chunks) -> tuple[dict[int, dict], object]:
    """A stream's choices (text, finish reason, log-prob rows, calibration) and its usage chunk's usage."""
    choices, usage = {}, None
    if chunks and hasattr(chunks[0], "sequence_number"):  # Responses API events: the final response, its deltas
        final = chunks[-1].response
        assert "".join(e.delta for e in chunks if e.type == "response.output_text.delta") == final.output_text
        return {0: _response_choice(final)}, _response_usage(final)
    for chunk in chunks:
        if chunk.usage is not None and not chunk.choices:
            usage = chunk.usage
        for c in chunk.choices:
            entry = choices.setdefault(c.index, {"text": "", "finish": None, "rows": [], "calibration": None})
            entry["text"] += (c.delta.content or "") if hasattr(c, "delta") else (c.text or "")
            entry["finish"] = c.finish_reason or entry["finish"]
            entry["rows"] += _logprob_rows(c)
            entry["calibration"] = (c.model_extra or {}).get("calibration") or entry["calibration"]
    return choices, usage


def _normalise(result) -> tuple[dict[int, dict], dict | None]:
    if isinstance(result, list):
        choices, usage = _merge_stream(result)
        return choices, usage if isinstance(usage, dict) or usage is None else usage.model_dump()
    if getattr(result, "object", None) == "response":
        return {0: _response_choice(result)}, _response_usage(result)
    choices = {c.index: {"text": _text(c), "finish": c.finish_reason, "rows": _logprob_rows(c),
                         "calibration": (c.model_extra or {}).get("calibration")} for c in result.choices}
    return choices, result.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})


def assert_same(expected, got) -> None:
    want, want_usage = _normalise(expected)
    have, have_usage = _normalise(got)
    assert sorted(have) == sorted(want)
    for i in want:
        w, h = want[i], have[i]
        assert h["text"] == w["text"] and h["finish"] == w["finish"], (i, w, h)
        assert len(h["rows"]) == len(w["rows"])
        for (wt, wv, walts), (ht, hv, halts) in zip(w["rows"], h["rows"]):
            assert ht == wt and math.isclose(hv, wv, abs_tol=1e-3), (wt, wv, ht, hv)
            assert [t for t, _ in halts] == [t for t, _ in walts]
            assert all(math.isclose(a, b, abs_tol=1e-3) for (_, a), (_, b) in zip(halts, walts))
        cal = h["calibration"]
        assert cal is not None and cal["mode"] == "free_form" and 0.0 <= cal["confidence"] <= 1.0
    if want_usage is not None:
        assert have_usage is not None
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert have_usage[key] == want_usage[key], (key, want_usage, have_usage)


def assert_property(case: Case, result) -> None:
    choices, _ = _normalise(result)
    texts = [c["text"] for c in choices.values()]
    if case.check == "distinct":
        assert len(set(texts)) > 1, texts
    elif case.check == "stopped":
        assert all(c["finish"] == "stop" for c in choices.values()), choices
        assert not any(s in t for t in texts for s in ([case.kwargs["stop"]] if isinstance(case.kwargs["stop"], str)
                                                        else case.kwargs["stop"]))
    elif case.check == "length":
        assert all(c["finish"] == "length" for c in choices.values()), choices
    elif case.check == "no_paris":
        assert all("Paris" not in t for t in texts), texts
    elif case.check == "json":
        assert all(isinstance(json.loads(t), dict) for t in texts), texts
    elif case.check == "json_start":  # a JSON object cut off by max_tokens
        assert all(t.lstrip().startswith("{") for t in texts), texts


@pytest.mark.parametrize("case", CASES, ids=[c.row for c in CASES])
def test_gateway_answers_like_vllm(clients, case):
    outcome = OUTCOMES.setdefault(case.row, Outcome())
    expected = call(clients["vllm"], case)
    outcome.vllm = str(expected.status_code) if isinstance(expected, openai.APIStatusError) else "200"
    for name in ("inprocess", "upstream"):
        got = call(clients[name], case)
        if case.refused:
            assert isinstance(got, openai.BadRequestError), got
            error = got.body if isinstance(got.body, dict) and "message" in got.body else got.body.get("error", got.body)
            assert case.refused in (error.get("param") or "") and case.refused in error["message"], error
            outcome.gateway[name] = "400"
            continue
        assert not isinstance(expected, openai.APIStatusError), expected
        assert not isinstance(got, openai.APIStatusError), got
        assert_same(expected, got)
        if case.check:
            assert_property(case, got)
        outcome.gateway[name] = "same"


def test_multiple_choice_logprobs_in_openai_shape(clients):
    """Multiple choice with logprobs: one position, the chosen letter; its alternatives are the option letters with
    their calibrated log-probs (chosen first), and they agree with `calibration.options`."""
    r = clients["inprocess"].chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Which planet is largest?"}], logprobs=True, top_logprobs=4,
        extra_body={"options": ["Mars", "Jupiter", "Venus", "Mercury"]})
    choice = r.choices[0]
    (position,) = choice.logprobs.content
    options = {o["label"]: o["probability"] for o in choice.model_extra["calibration"]["options"]}
    assert position.token == choice.message.content
    assert math.exp(position.logprob) == pytest.approx(options[position.token], abs=1e-6)
    assert [a.token for a in position.top_logprobs][0] == position.token
    assert sorted(a.token for a in position.top_logprobs) == list("ABCD")
    for alt in position.top_logprobs:
        assert math.exp(alt.logprob) == pytest.approx(options[alt.token], abs=1e-6)
        assert alt.bytes == list(alt.token.encode())


def test_n_choices_each_carry_their_own_calibration_and_take_feedback(clients):
    r = clients["inprocess"].chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=8, n=3,
                                                     temperature=1.0, seed=11)
    confidences = [c.model_extra["calibration"]["confidence"] for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(confidences)) == 3
    base = str(clients["inprocess"].base_url).rstrip("/").removesuffix("/v1")
    ok = http.post(f"{base}/v1/feedback", json={"response_id": r.id, "correct": True, "choice_index": 2})
    assert ok.status_code == 200 and ok.json()["recorded"] is True
    missing = http.post(f"{base}/v1/feedback", json={"response_id": r.id, "correct": True, "choice_index": 5})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "choice_index"


# -- escalate and review policies on real servers: the in-process gateway first, vLLM's server or the upstream
# gateway (a CALM gateway) as the target ---------------------------------------------------------------------------
ADMIN = {"Authorization": "Bearer dev-admin-key"}
QUESTIONS = [CAPITAL, COUNT, [{"role": "user", "content": "Name a colour."}],
             [{"role": "user", "content": "Why is the sky blue? One sentence."}]]


def vllm_requests(stack) -> float:
    """Requests vLLM's server has finished (its own Prometheus counter)."""
    return sum(metric_values(stack["vllm"], "vllm:request_success_total"))


def put_policy(stack, domain: str, policy: dict) -> None:
    r = http.put(f"{stack['inprocess']}/admin/policies/{domain}", json=policy, headers=ADMIN)
    assert r.status_code == 200, r.text


def test_unsure_answers_come_from_the_target_confident_ones_from_the_first_model(stack, clients):
    first = clients["inprocess"]
    ask = dict(model=MODEL, max_tokens=8, temperature=0.0, metadata={"domain": "escalation"})
    before = [first.chat.completions.create(messages=q, **ask).choices[0] for q in QUESTIONS]
    confidences = sorted(c.model_extra["calibration"]["confidence"] for c in before)
    threshold = (confidences[0] + confidences[-1]) / 2
    put_policy(stack, "escalation", {"threshold": threshold, "action": "escalate", "escalate": {
        "target": "vllm", "model": MODEL, "timeout_s": 60}})
    for question, was in zip(QUESTIONS, before):
        calls = vllm_requests(stack)
        got = first.chat.completions.create(messages=question, **ask).choices[0]
        cal = got.model_extra["calibration"]
        unsure = was.model_extra["calibration"]["confidence"] < threshold
        assert cal["escalated"] == unsure and cal["confidence"] == pytest.approx(was.model_extra["calibration"]["confidence"])
        assert vllm_requests(stack) - calls == (1 if unsure else 0)  # the target was asked exactly when unsure
        if unsure:
            direct = clients["vllm"].chat.completions.create(messages=question, model=MODEL, max_tokens=8, temperature=0)
            assert got.message.content == direct.choices[0].message.content and cal["escalation"]["target_model"] == MODEL
        else:
            assert got.message.content == was.message.content and cal["escalation"] is None
    unsure = next(q for q, c in zip(QUESTIONS, before) if c.model_extra["calibration"]["confidence"] < threshold)
    streamed, _ = _merge_stream(list(first.chat.completions.create(messages=unsure, stream=True, **ask)))
    assert streamed[0]["calibration"]["escalated"] and streamed[0]["text"] == got_text(clients, unsure)
    calls = vllm_requests(stack)  # n = 2, both below (the request's stricter threshold): both from the target
    both = first.chat.completions.create(messages=CAPITAL, n=2, extra_body={"calm": {"threshold": 1.0}},
                                         **{**ask, "temperature": 1.0, "seed": 5})
    assert [c.model_extra["calibration"]["escalated"] for c in both.choices] == [True, True]
    assert vllm_requests(stack) - calls == 2  # vLLM counts each of the n sequences


def got_text(clients, question) -> str:
    return clients["vllm"].chat.completions.create(messages=question, model=MODEL, max_tokens=8,
                                                   temperature=0).choices[0].message.content


def test_a_calm_target_scores_the_options_itself_and_its_confidence_is_passed_on(stack, clients):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Which planet is largest?"}],
               extra_body={"options": ["Mars", "Jupiter", "Venus"]})
    put_policy(stack, "escalation", {"threshold": 1.0, "action": "escalate", "escalate": {
        "target": "calm-gateway", "model": MODEL, "timeout_s": 60}})
    got = clients["inprocess"].chat.completions.create(metadata={"domain": "escalation"}, **ask).choices[0]
    direct = clients["upstream"].chat.completions.create(**ask).choices[0]
    cal, theirs = got.model_extra["calibration"], direct.model_extra["calibration"]
    assert cal["escalated"] and cal["mode"] == "multiple_choice" and got.message.content == direct.message.content
    assert cal["escalation"]["confidence"] == pytest.approx(theirs["confidence"], abs=1e-6)


def test_a_target_down_or_slow_gets_the_fallback_within_its_timeout(stack, clients):
    first, ask = clients["inprocess"], dict(model=MODEL, messages=CAPITAL, max_tokens=8, metadata={"domain": "escalation"})
    # The stack's "down" target has nothing listening; its "silent" one accepts and never answers.
    put_policy(stack, "escalation", {"threshold": 1.0, "action": "escalate", "escalate": {
        "target": "down", "model": "strong", "timeout_s": 30}})
    down = first.chat.completions.create(**ask).choices[0]
    assert down.message.content == got_text(clients, CAPITAL)  # annotate: the first answer stands
    assert down.model_extra["calibration"]["escalation"]["fallback"].startswith("connect:")
    put_policy(stack, "escalation", {"threshold": 1.0, "action": "escalate", "message": "Ask a person.", "escalate": {
        "target": "silent", "model": "strong", "timeout_s": 1.5, "on_failure": "abstain"}})
    slow = first.chat.completions.create(**ask).choices[0]
    assert slow.message.content == "Ask a person." and slow.model_extra["calibration"]["abstained"]
    # The kind of failure only: the target's and the transport's own words stay in the gateway's log (63).
    assert slow.model_extra["calibration"]["escalation"]["fallback"].startswith("timeout: the target did not answer")
    streamed, _ = _merge_stream(list(first.chat.completions.create(stream=True, **ask)))
    assert streamed[0]["text"] == "Ask a person." and streamed[0]["finish"] is not None
    metrics = http.get(f"{stack['inprocess']}/metrics").text
    for line in ('calm_escalation_errors_total{domain="escalation",reason="connect"} 1.0',
                 'calm_escalation_errors_total{domain="escalation",reason="timeout"} 2.0',
                 'calm_escalations_total{domain="escalation",outcome="fallback_abstain"} 2.0'):
        assert line in metrics, line


def test_a_review_round_trip_becomes_counted_feedback(stack, clients):
    import subprocess

    put_policy(stack, "triage", {"threshold": 1.0, "action": "review", "message": "A specialist will answer."})
    out = clients["inprocess"].chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=8,
                                                       metadata={"domain": "triage"})
    cal = out.choices[0].model_extra["calibration"]
    assert out.choices[0].message.content == "A specialist will answer." and cal["abstained"] and cal["review_id"]
    listed = subprocess.run(calm_argv("reviews", "list", "--domain", "triage"), capture_output=True, text=True,
                            env={**__import__("os").environ, "CALM_DB_PATH": str(stack["db"])}, check=True).stdout
    (queued,) = [json.loads(line) for line in listed.splitlines()]
    assert queued["id"] == cal["review_id"] and queued["answer"] == got_text(clients, CAPITAL)
    assert queued["answer_option"] is None and 0 <= queued["waited_s"] < 600  # free form: no option to name
    closed = http.post(f"{stack['inprocess']}/admin/reviews/{cal['review_id']}", json={"correct": True}, headers=ADMIN)
    assert closed.status_code == 200 and closed.json()["status"] == "closed"
    metrics = http.get(f"{stack['inprocess']}/metrics").text
    for line in ('calm_feedback_total{correct="true",domain="triage"} 1.0', 'calm_online_accuracy{domain="triage"} 1.0',
                 'calm_reviews_total{domain="triage",event="closed"} 1.0'):
        assert line in metrics, line


def render_table() -> str:
    lines = ["| parameter | vLLM server | gateway (in-process) | gateway (upstream) | note |", "|---|---|---|---|---|"]
    for case in CASES:
        o = OUTCOMES[case.row]
        note = f"400 by design: {case.why}" if case.refused else "same response, plus `calibration`"
        lines.append(f"| {case.row} | {o.vllm} | {o.gateway['inprocess']} | {o.gateway['upstream']} | {note} |")
    return "\n".join(lines) + "\n"


def test_the_documented_table_is_the_suites_output():
    if any(len(OUTCOMES.get(c.row, Outcome()).gateway) < 2 for c in CASES):
        pytest.skip("the table needs every conformance case to have run in this session")
    table = render_table()
    written = results_dir() / "conformance.md"  # a CI run leaves the committed table alone
    written.write_text(table)
    page = page_of("conformance")
    block = read_block(page.read_text(), "conformance") + "\n"
    assert block == table, f"{page.name}'s conformance table differs from the suite's output; copy {written} into it"
