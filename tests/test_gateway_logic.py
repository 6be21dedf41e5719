"""Unit tests of the gateway's pure logic: confidence, drift, policies, option detection, the SQLite store."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from calm_core.prompts import ClozeTokens, detect_option_letters, parse_options_question
from calm_core.scoring import cloze_scores, option_distribution, options_softmax, sequence_confidence, topk_entropy
from calm_core.semantic import SAMPLE_TEMPERATURE
from gateway.observe.drift import ConfidenceWindow, histogram_share, ks, psi
from gateway.errors import status_code_name
from gateway.policy.policies import Action, Policy, resolve, threshold_for_risk


def test_option_distribution_renormalises_over_options():
    dist = option_distribution({10: math.log(0.2), 11: math.log(0.6), 12: math.log(0.1), 99: math.log(0.1)}, [10, 11, 12])
    np.testing.assert_allclose(dist.probs, [0.2 / 0.9, 0.6 / 0.9, 0.1 / 0.9])
    assert dist.chosen == 1 and dist.confidence == pytest.approx(0.6 / 0.9)
    assert dist.entropy == pytest.approx(-sum(p * math.log(p) for p in dist.probs))
    # The sampled option is the answer even when it is not the most probable one.
    assert option_distribution({10: -1.0, 11: -0.5}, [10, 11], chosen_token=10).chosen == 0
    with pytest.raises(ValueError, match="no finite log-prob"):
        option_distribution({}, [1, 2])


def test_cloze_options_are_a_softmax_of_mean_token_log_probs():
    scores = cloze_scores([[math.log(0.5), math.log(0.125)], [math.log(0.5)], [-math.inf, 0.0]])
    np.testing.assert_allclose(scores[:2], [math.log(0.25), math.log(0.5)])
    dist = options_softmax(scores)
    np.testing.assert_allclose(dist.probs, [1 / 3, 2 / 3, 0.0])
    assert dist.chosen == 1 and options_softmax(scores, chosen=0).confidence == pytest.approx(1 / 3)


class ScriptedEngine:
    """Answers each one-token request with log-prob -(prompt length + token id / 100) for the asked token."""

    def __init__(self):
        self.requests = []

    async def stream(self, request):
        from calm_core.engine import EngineDelta

        self.requests.append(request)
        token = request.option_token_ids[0]
        value = -(len(request.prompt_token_ids) + token / 100)
        yield EngineDelta(text="x", token_ids=[7], token_logprobs=[-1.0], top_logprobs=[{token: value, 7: -1.0}])


def test_cloze_scoring_teacher_forces_each_option_token_without_restricting_the_vocabulary():
    import asyncio

    from calm_core.engine import EngineRequest
    from calm_core.scorers.options import ClozePerTokenScorer

    engine = ScriptedEngine()
    tokens = ClozeTokens(prompt=(1, 2, 3), options=((40, 41), (50,)))
    template = EngineRequest(request_id="r", prompt="Question: ...", temperature=0.8, seed=3)
    scores = asyncio.run(ClozePerTokenScorer(engine).option_scores(tokens, template, calibrated=False))
    # Option 0: tokens 40 after the prompt (3 tokens), 41 after prompt + 40 (4 tokens); option 1: 50 after the prompt.
    np.testing.assert_allclose(scores, [-(3.40 + 4.41) / 2, -3.50])
    sent = {r.request_id: r for r in engine.requests}
    assert sorted(sent) == ["r-0-0", "r-0-1", "r-1-0"]
    assert sent["r-0-1"].prompt_token_ids == (1, 2, 3, 40) and sent["r-0-1"].option_token_ids == (41,)
    assert all(not r.restrict_to_options and not r.calibrated and r.max_tokens == 1 and r.temperature == 0.0
               for r in engine.requests)


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("Which gas?\nA. oxygen\nB. carbon dioxide\nAnswer with a letter.", ("Which gas?", ("oxygen", "carbon dioxide"))),
        ("Answer the following multiple-choice question with a single letter.\n\nQ?\n(A) one two\n(B) three",
         ("Q?", ("one two", "three"))),
        ("What is the capital of France?", None),
    ],
)
def test_parse_options_question(text, parsed):
    assert parse_options_question(text) == parsed


def test_sequence_confidence_is_geometric_mean():
    assert sequence_confidence([math.log(0.5), math.log(0.125)]) == pytest.approx(0.25)
    assert sequence_confidence([]) == 1.0


def test_topk_entropy():
    assert topk_entropy([{1: math.log(0.5), 2: math.log(0.5)}]) == pytest.approx(math.log(2))
    assert topk_entropy([{1: 0.0}, {1: math.log(0.25), 2: math.log(0.25)}]) == pytest.approx(math.log(2) / 2)
    # Tokens masked by top-k / min-p come back as -inf in-process and as -9999 over HTTP: no mass, no NaN.
    for masked in (-math.inf, -9999.0):
        assert topk_entropy([{1: math.log(0.5), 2: math.log(0.5), 3: masked}]) == pytest.approx(math.log(2))


def test_psi_and_ks():
    ref = np.array([0.25, 0.25, 0.25, 0.25])
    assert psi(ref, ref) == pytest.approx(0.0)
    assert ks(ref, ref) == pytest.approx(0.0)
    live = np.array([0.7, 0.1, 0.1, 0.1])
    expected = sum((l - r) * math.log(l / r) for l, r in zip(live, ref))
    assert psi(live, ref) == pytest.approx(expected)
    assert ks(live, ref) == pytest.approx(0.45)


def test_confidence_window_detects_shift_and_forgets():
    edges = np.linspace(0, 1, 11)
    rng = np.random.default_rng(0)
    ref_counts, _ = np.histogram(rng.uniform(0.4, 0.8, 2000), bins=edges)
    window = ConfidenceWindow(edges, ref_counts, size=100)
    for c in rng.uniform(0.4, 0.8, 100):
        reading = window.add(c)
    assert reading.psi < 0.1 and reading.ks < 0.15 and reading.window == 100
    for c in rng.uniform(0.9, 1.0, 100):
        reading = window.add(c)
    assert reading.psi > 1.0 and reading.ks > 0.9
    np.testing.assert_allclose(histogram_share([0.0, 1.0], edges).sum(), 1.0)


def test_threshold_for_risk():
    edges = [0.0, 0.25, 0.5, 0.75, 1.0]
    # centres .125 .375 .625 .875; equal counts. Risk from edge 0: 1-.5=.5; from .25: 1-.625=.375; .5: .25; .75: .125
    # α = 0.3 lies inside [.25, .5]: keeping its top u (v = u / .25 of its answers, mean .5 − u/2) with the 2 above
    # (sum 1.5) has mean .7 at v² + 1.6 v − .8 = 0, v = .4: t = .5 − .1 = .4.
    assert threshold_for_risk(edges, [1, 1, 1, 1], 0.3) == pytest.approx(0.4)
    assert threshold_for_risk(edges, [1, 1, 1, 1], 0.5) == 0.0
    assert threshold_for_risk(edges, [1, 1, 1, 1], 0.01) == pytest.approx(0.98)  # the top bin's answers ≥ .98: mean .99
    assert threshold_for_risk(edges, [1, 1, 1, 0], 0.01) == 1.0  # none that confident: abstain on every answer


def test_policy_rules():
    with pytest.raises(ValueError, match="exactly one"):
        Policy()
    with pytest.raises(ValueError, match="exactly one"):
        Policy(threshold=0.5, target_risk=0.1)
    strict = Policy(threshold=0.6, action="abstain")
    assert resolve(strict, "x:v1", None, None).threshold == 0.6
    assert resolve(strict, "x:v1", None, 0.8).threshold == 0.8  # stricter request wins
    assert resolve(strict, "x:v1", None, 0.3).threshold == 0.6  # looser request is ignored
    assert resolve(None, "builtin", None, None).action is Action.ANNOTATE
    risk = Policy(target_risk=0.3)
    assert resolve(risk, "r", ([0.0, 0.25, 0.5, 0.75, 1.0], [1, 1, 1, 1]), None).threshold == pytest.approx(0.4)
    assert resolve(risk, "r", None, None).threshold == 1.0  # no reference: never claim the target is met


@pytest.mark.parametrize(
    "text, letters",
    [
        ("Q?\nA. one\nB. two\nC. three", ("A", "B", "C")),
        ("Q?\n(A) one\n(B) two", ("A", "B")),
        ("Q?\nA) one\nB) two\nD) four", ("A", "B")),
        ("What is the capital of France?", None),
        ("A. only one option", None),
        ("B. one\nC. two", None),
    ],
)
def test_detect_option_letters(text, letters):
    assert detect_option_letters(text) == letters


def test_logprobs_follow_vllms_wire_rules():
    from gateway.serving.logprobs import chat_logprobs, completion_logprobs, option_position, token_positions

    text = {1: "a", 2: "b", 3: "c", 4: "d"}.__getitem__
    # The sampled token (3) first, then the rest by rank, as the engine's dict orders them.
    sampled_third = token_positions([3], [-2.0], [{3: -2.0, 1: -0.5, 2: -1.0, 4: -math.inf}], text)
    greedy = token_positions([1], [-0.5], [{1: -0.5, 2: -1.0, 3: -2.0, 4: -math.inf}], text)
    chat = chat_logprobs(sampled_third, 2).content[0]
    assert (chat.token, chat.logprob, chat.bytes) == ("c", -2.0, [99])
    assert [t.token for t in chat.top_logprobs] == ["c", "a"]  # chat: the first top_logprobs entries
    # Completions: the sampled token plus the top k, so k + 1 entries unless the sampled token is in the top k.
    assert list(completion_logprobs(sampled_third, 2).top_logprobs[0]) == ["c", "a", "b"]
    assert list(completion_logprobs(greedy, 2).top_logprobs[0]) == ["a", "b"]
    assert list(completion_logprobs(greedy, 0).top_logprobs[0]) == ["a"]
    masked = completion_logprobs(token_positions([4], [-math.inf], [{4: -math.inf, 1: -0.5}], text), 1)
    assert masked.token_logprobs == [-9999.0] and masked.top_logprobs[0] == {"d": -9999.0, "a": -0.5}  # -inf: no JSON
    two = token_positions([1, 2], [-0.5, -0.1], [{1: -0.5}, {2: -0.1}], {1: "ab", 2: "cde"}.__getitem__)
    assert completion_logprobs(two, 0, text_offset=4).text_offset == [4, 6]
    # Multiple choice: one position, the chosen letter first, then the options by probability.
    mc = option_position("ABC", [0.2, 0.5, 0.3], chosen=0)
    assert mc.token == "A" and mc.logprob == pytest.approx(math.log(0.2))
    assert [t for t, _ in mc.alternatives] == ["A", "B", "C"]
    assert [t for t, _ in option_position("ABC", [0.2, 0.5, 0.3], chosen=1).alternatives] == ["B", "C", "A"]


class PromptLogprobEngine:
    """Answers with prompt log-probs: token t at position i has log-prob -(i + t / 100); `folded` adds -1."""

    folded_scoring = True

    def __init__(self):
        self.requests = []

    async def stream(self, request):
        from calm_core.engine import EngineDelta

        self.requests.append(request)
        ids = request.prompt_token_ids
        lps = [math.nan] + [-(i + t / 100) - (1.0 if request.folded else 0.0) for i, t in enumerate(ids) if i > 0]
        yield EngineDelta(text="x", token_ids=[7], token_logprobs=[-1.0], top_logprobs=[{7: -1.0}], prompt_logprobs=lps)


def test_one_pass_cloze_scoring_reads_each_option_from_one_request():
    import asyncio

    from calm_core.engine import EngineRequest
    from calm_core.scorers.options import ClozeOnePassScorer

    engine = PromptLogprobEngine()
    tokens = ClozeTokens(prompt=(1, 2, 3), options=((40, 41), (50,)))
    template = EngineRequest(request_id="r", prompt="Question: ...", temperature=0.8, seed=3, n=3)
    calibrated = asyncio.run(ClozeOnePassScorer(engine).option_scores(tokens, template, calibrated=True))
    # Option 0: 40 at position 3, 41 at position 4; option 1: 50 at position 3; the folded weights' values.
    np.testing.assert_allclose(calibrated, [-(3.40 + 4.41) / 2 - 1, -3.50 - 1])
    raw = asyncio.run(ClozeOnePassScorer(engine).option_scores(tokens, template, calibrated=False))
    np.testing.assert_allclose(raw, [-(3.40 + 4.41) / 2, -3.50])
    sent = engine.requests[:2]
    assert [r.prompt_token_ids for r in sent] == [(1, 2, 3, 40, 41), (1, 2, 3, 50)]
    assert all(r.prompt_logprobs and r.folded and not r.calibrated and r.n == 1 and r.max_tokens == 1 for r in sent)
    assert not any(r.folded for r in engine.requests[2:])


class PrefixCacheEngine(PromptLogprobEngine):
    """PromptLogprobEngine with a prefix cache of 2-token blocks: a `reuse_prefix` request gets NaN for the positions
    of the full blocks an earlier request already computed (as vLLM's prompt log-probs read after its cache)."""

    prefix_reuse, prefix_block = True, 2

    def __init__(self):
        super().__init__()
        self.blocks: set[tuple[int, ...]] = set()

    async def stream(self, request):
        ids = request.prompt_token_ids
        async for delta in super().stream(request):
            cached = 0
            while request.reuse_prefix and cached + 2 < len(ids) and tuple(ids[: cached + 2]) in self.blocks:
                cached += 2  # never the whole prompt: its last token is always computed
            delta.prompt_logprobs[:cached] = [math.nan] * cached
            self.blocks |= {tuple(ids[:end]) for end in range(2, len(ids) + 1, 2)}
            yield delta


def test_one_pass_options_after_the_first_read_the_question_from_the_prefix_cache():
    import asyncio

    from calm_core.engine import EngineRequest
    from calm_core.scorers.options import ClozeOnePassScorer

    engine = PrefixCacheEngine()
    # Options 1 and 2 share the question's cached blocks; option 2 shares (1, 2, 3, 40) with option 0, so its own first
    # token comes out of the cache: it is asked again without the cache.
    tokens = ClozeTokens(prompt=(1, 2, 3), options=((40, 41), (50,), (40, 42)))
    template = EngineRequest(request_id="r", prompt="Question: ...")
    scores = asyncio.run(ClozeOnePassScorer(engine).option_scores(tokens, template, calibrated=True))
    np.testing.assert_allclose(scores, [-(3.40 + 4.41) / 2 - 1, -3.50 - 1, -(3.40 + 4.42) / 2 - 1])
    sent = [(r.request_id, r.reuse_prefix) for r in engine.requests]
    assert sent == [("r-0", False), ("r-1", True), ("r-2", True), ("r-2-whole", False)]


def test_one_table_classifies_errors_for_handlers_metrics_and_streams():
    from calm_core.engine import EngineRejected, EngineUnavailable
    from gateway.errors import APIError, classify

    assert (classify(APIError(404, "no", "not_found_error", "model")).status, classify(APIError(404, "no")).param) == (404, None)
    assert (classify(EngineRejected("too long")).status, classify(EngineRejected("x")).type) == (400, "invalid_request_error")
    unavailable = classify(EngineUnavailable("down"))
    assert (unavailable.status, unavailable.type, unavailable.headers) == (503, "service_unavailable_error", {"Retry-After": "5"})
    for unexpected in (ValueError("bug"), KeyError("k"), RuntimeError("r")):
        error = classify(unexpected)
        assert (error.status, error.type) == (500, "internal_server_error") and "bug" not in error.message


class FailingEngine:
    """Streams one token, then fails with the given exception.

    Its subclasses write `draw` (what a request generates); `stream` also answers the scorer's read-back of a free-form
    answer (one greedy token per answer position, calm_core/scorers/free_form.py) with the log-prob its draw gave that
    token, so a fake's answer has the confidence its draw says."""

    model_name, artifact_version, max_model_len, folded_scoring = "m", "test-v1", 2048, False
    free_form_mode = prompt_logprobs = False

    def __init__(self, exc: BaseException | None):
        self.exc = exc
        self.drawn: dict[tuple[str, int], list[tuple[int, float]]] = {}  # (request id, choice) -> (token, log-prob)

    async def stream(self, request):
        from calm_core.engine import EngineDelta

        read = re.fullmatch(r"(.+)-read(\d+)-(\d+)", request.request_id)
        if read is not None:
            token, lp = self.drawn[(read[1], int(read[2]))][int(read[3])]
            yield EngineDelta(text="", token_ids=[token], token_logprobs=[lp], top_logprobs=[{token: lp}])
            return
        async for delta in self.draw(request):
            self.drawn.setdefault((request.request_id, delta.index), []).extend(zip(delta.token_ids, delta.token_logprobs))
            yield delta

    async def start(self): ...

    async def close(self): ...

    async def abort(self, request_id): ...

    async def check_health(self): ...

    async def draw(self, request):
        from calm_core.engine import EngineDelta

        yield EngineDelta(text="Hi", token_ids=[7], token_logprobs=[-0.1], top_logprobs=[{7: -0.1}], prompt_tokens=3)
        if self.exc is not None:
            raise self.exc


@pytest.mark.parametrize("exc, status, kind", [
    (None, None, None),
    (__import__("calm_core.engine", fromlist=["EngineUnavailable"]).EngineUnavailable("died"), 503, "service_unavailable_error"),
    (__import__("calm_core.engine", fromlist=["EngineRejected"]).EngineRejected("bad"), 400, "invalid_request_error"),
    (RuntimeError("a bug of ours"), 500, "internal_server_error"),
])
def test_a_failing_stream_ends_with_an_error_event_and_done_and_is_counted(tmp_path, exc, status, kind):
    import json as _json

    from fastapi.testclient import TestClient

    from calm_core.artifact import ArtifactManifest
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    tokenizer = _tiny_tokenizer()
    manifest = ArtifactManifest.model_construct(reference_histograms={}, answer_format="letter", applies_to="all",
                                                has_adapter=False, artifact_version="test-v1")
    artifact = _stub_artifact(manifest)
    settings = GatewaySettings(db_path=tmp_path / "g.db", served_model_name="m")
    app = create_app(settings, FailingEngine(exc), tokenizer, artifact)
    with TestClient(app) as client:
        body = {"model": "m", "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
        text = client.post("/v1/chat/completions", json=body).text
        events = [e.removeprefix("data: ") for e in text.strip().split("\n\n")]
        assert events[-1] == "[DONE]"
        metrics = client.get("/metrics").text
    if exc is None:
        assert '"calibration"' in events[-2]
        return
    error = _json.loads(events[-2])["error"]
    assert (error["code"], error["type"]) == (status_code_name(status), kind)  # every code a string (65)
    assert f'calm_errors_total{{domain="other",endpoint="chat",type="{kind}"}} 1.0' in metrics
    assert f'calm_requests_total{{domain="other",endpoint="chat",status="{status}"}} 1.0' in metrics


def _stub_artifact(manifest):
    """A LoadedArtifact that is only its manifest: what the gateway reads of an artifact in these tests."""
    from calm_core.artifact import LoadedArtifact

    artifact = LoadedArtifact.__new__(LoadedArtifact)
    object.__setattr__(artifact, "manifest", manifest)
    return artifact


def _tiny_tokenizer():
    """A real (tiny) HF tokenizer with a chat template and single-token letters, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<unk>", *"ABCDEFGHIJKLM", "hello", "Hi", "<|im_end|>"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tok


def test_guaranteed_risk_policy_falls_back_until_enough_verdicts_then_guarantees(tmp_path):
    """A guaranteed-risk policy through the app: the declared fallback (abstain on everything) until min_labels
    verdicts exist, then the Learn-then-Test threshold; the fit is audited and exported as metrics."""
    from fastapi.testclient import TestClient

    from calm_core.artifact import ArtifactManifest, ReferenceHistogram
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    edges = [round(0.1 * i, 1) for i in range(11)]
    manifest = ArtifactManifest.model_construct(
        reference_histograms={"science": ReferenceHistogram(bin_edges=edges, counts=[0] * 9 + [10])},
        answer_format="letter", applies_to="all", has_adapter=False, artifact_version="test-v1")
    artifact = _stub_artifact(manifest)
    app = create_app(GatewaySettings(db_path=tmp_path / "g.db", served_model_name="m"), FailingEngine(None),
                     _tiny_tokenizer(), artifact)
    admin = {"Authorization": "Bearer dev-admin-key"}
    body = {"model": "m", "max_tokens": 4, "metadata": {"domain": "science"}, "messages": [{"role": "user", "content": "hello"}]}
    with TestClient(app) as client:
        policy = {"target_risk": 0.3, "delta": 0.1, "min_labels": 20, "fallback": "abstain_all", "action": "abstain"}
        put = client.put("/admin/policies/science", json=policy, headers=admin)
        assert put.status_code == 200 and put.json()["state"] == "fallback abstain_all (0 of 20 labels)"
        assert client.put("/admin/policies/science", json={"threshold": 0.5, "delta": 0.1}, headers=admin).status_code == 400
        ids = []
        for i in range(20):
            r = client.post("/v1/chat/completions", json=body).json()
            if i == 0:
                cal = r["choices"][0]["calibration"]
                assert cal["abstained"] and cal["policy_state"] == "fallback abstain_all (0 of 20 labels)"
            ids.append(r["id"])
        for i, response_id in enumerate(ids):  # 19 right, 1 wrong: 5 % errors against a 30 % target
            assert client.post("/v1/feedback", json={"response_id": response_id, "correct": i != 0}).status_code == 200
        cal = client.post("/v1/chat/completions", json=body).json()["choices"][0]["calibration"]
        assert cal["policy_state"] == "guaranteed (20 labels)" and not cal["abstained"]
        assert cal["threshold"] <= cal["confidence"]
        audit = client.get("/admin/audit", params={"domain": "science"}, headers=admin).json()["data"]
        refits = [a for a in audit if a["action"] == "refit"]
        assert len(refits) == 1 and refits[0]["actor"] == "risk-control" and refits[0]["after"]["n_labels"] == 20
        metrics = client.get("/metrics").text
        assert 'calm_policy_guarantee_labels{domain="science"} 20.0' in metrics
        assert f'calm_policy_guaranteed_threshold{{domain="science"}} {cal["threshold"]}' in metrics


class LetterEngine(FailingEngine):
    """Answers multiple choice: option A has probability 0.7, B 0.3 (of the asked letters), whatever the question."""

    def __init__(self):
        super().__init__(None)

    async def draw(self, request):
        from calm_core.engine import EngineDelta

        a, b = request.option_token_ids[:2]
        yield EngineDelta(text="A", token_ids=[a], token_logprobs=[math.log(0.7)],
                          top_logprobs=[{a: math.log(0.7), b: math.log(0.3)}], prompt_tokens=3)


def science_app(tmp_path, engine, **settings):
    """The app on a scripted engine, serving an artifact whose one reference domain is "science"."""
    from calm_core.artifact import ArtifactManifest, ReferenceHistogram
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    edges = [round(0.1 * i, 1) for i in range(11)]
    manifest = ArtifactManifest.model_construct(
        reference_histograms={"science": ReferenceHistogram(bin_edges=edges, counts=[0] * 6 + [10, 0, 0, 0])},
        answer_format="letter", applies_to="all", has_adapter=False, artifact_version="test-v1")
    artifact = _stub_artifact(manifest)
    return create_app(GatewaySettings(db_path=tmp_path / "g.db", served_model_name="m", **settings), engine,
                      _tiny_tokenizer(), artifact)


def test_uploaded_labelled_questions_are_scored_as_served_and_become_labels(tmp_path):
    from fastapi.testclient import TestClient

    app = science_app(tmp_path, LetterEngine())
    admin = {"Authorization": "Bearer dev-admin-key"}
    # The engine always answers A at confidence 0.7: right for the first 24 questions, wrong for the last 6.
    questions = [{"question": "hello", "options": ["x", "y"], "answer": 0 if i < 24 else 1} for i in range(30)]
    with TestClient(app) as client:
        policy = {"target_risk": 0.4, "delta": 0.1, "min_labels": 30}
        assert client.put("/admin/policies/science", json=policy, headers=admin).status_code == 200
        r = client.post("/admin/labels/science", json={"questions": questions}, headers=admin)
        assert r.status_code == 200, r.text
        assert r.json() == {"domain": "science", "scored": 30, "accuracy": 0.8, "labels": 30}
        got = client.get("/admin/policies/science", headers=admin).json()
        assert got["state"] == "guaranteed (30 labels)" and got["effective_threshold"] <= 0.7
        assert client.post("/admin/labels/science", json={"questions": []}, headers=admin).status_code == 400
        bad = client.post("/admin/labels/science", json={"questions": [{"question": "q", "options": ["a", "b"], "answer": 2}]},
                          headers=admin)
        assert bad.status_code == 400 and "not one of the 2 options" in bad.json()["error"]["message"]
        # Free-form labels: the aliases judge the greedy answer; an empty alias list is refused.
        bad = client.post("/admin/labels/science", json={"questions": [{"question": "q", "answers": []}]}, headers=admin)
        assert bad.status_code == 400, bad.text
        assert client.post("/admin/labels/nowhere", json={"questions": questions}, headers=admin).status_code == 404
        assert client.post("/admin/labels/science", json={"questions": questions}).status_code == 401
        assert 'calm_answers_total{domain="science"}' not in client.get("/metrics").text  # labels are not live answers


class SamplingEngine(FailingEngine):
    """n sampled answers in one call; answer i has token log-prob -(i + 1) / 10 (the first is the most probable)."""

    TEXTS = ["It is Paris.", "London", "Paris", "paris", "The answer is London", "Rome"]

    def __init__(self):
        super().__init__(None)
        self.requests = []

    async def draw(self, request):
        from calm_core.engine import EngineDelta

        self.requests.append(request)
        for i in range(request.n):
            lp = -(i + 1) / 10
            yield EngineDelta(text=self.TEXTS[i % len(self.TEXTS)], token_ids=[7], token_logprobs=[lp],
                              top_logprobs=[{7: lp}], finish_reason="stop", prompt_tokens=3, index=i)


def test_semantic_confidence_keeps_the_token_answer_and_is_the_share_of_raw_samples_that_agree(tmp_path):
    from fastapi.testclient import TestClient

    from calm_core.artifact import ArtifactManifest
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    manifest = ArtifactManifest.model_construct(reference_histograms={}, answer_format="letter", applies_to="all",
                                                has_adapter=False, artifact_version="test-v1")
    artifact = _stub_artifact(manifest)
    engine = SamplingEngine()
    app = create_app(GatewaySettings(db_path=tmp_path / "g.db", served_model_name="m"), engine, _tiny_tokenizer(), artifact)
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
    with TestClient(app) as client:
        token = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        r = client.post("/v1/chat/completions", json={**body, "calm": {"confidence": "semantic", "samples": 6,
                                                                       "raw_confidence": True}}).json()
        choice = r["choices"][0]
        cal = choice["calibration"]
        assert choice["message"]["content"] == token["message"]["content"] == "It is Paris."  # the answer is token's
        # 3 of the 6 raw samples say Paris; unfitted map: the smoothed share (3 + 0.5) / (6 + 1)
        assert cal["method"] == "semantic" and cal["raw_confidence"] == 0.5 and cal["confidence"] == 0.5
        assert [(c["answer"], c["size"]) for c in cal["clusters"]] == [("It is Paris.", 3), ("London", 2), ("Rome", 1)]
        assert r["usage"]["completion_tokens"] == 1 + 6  # the answer and every sample were generated
        answer, sampled = engine.requests[-2:]
        assert answer.n == 1 and not answer.calibrated  # drawn as in token mode: the served weights, head off
        assert sampled.n == 6 and not sampled.calibrated and sampled.temperature == SAMPLE_TEMPERATURE
        assert token["calibration"]["method"] == "token" and token["calibration"]["clusters"] is None
        two = client.post("/v1/chat/completions", json={**body, "n": 2, "temperature": 1.0,
                                                        "calm": {"confidence": "semantic"}})
        assert two.status_code == 200 and [c["calibration"]["method"] for c in two.json()["choices"]] == ["semantic"] * 2
        admin = {"Authorization": "Bearer dev-admin-key"}
        assert client.put("/admin/policies/default", json={"threshold": 0.0, "confidence": "semantic", "samples": 4},
                          headers=admin).status_code == 200
        by_policy = client.post("/v1/chat/completions", json={**body, "stream": True}).text
        assert '"method": "semantic"' in by_policy and '{"answer": "London", "size": 1}' in by_policy  # 4 samples, buffered


def test_calibration_travels_in_headers_for_clients_behind_proxies(tmp_path):
    from fastapi.testclient import TestClient

    from calm_core.artifact import ArtifactManifest
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    manifest = ArtifactManifest.model_construct(reference_histograms={}, answer_format="letter", applies_to="all",
                                                has_adapter=False, artifact_version="test-v1")
    artifact = _stub_artifact(manifest)
    app = create_app(GatewaySettings(db_path=tmp_path / "g.db", served_model_name="m"), SamplingEngine(),
                     _tiny_tokenizer(), artifact)
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}],
            "metadata": {"domain": "science"}}
    with TestClient(app) as client:
        plain = client.post("/v1/chat/completions", json=body)
        cal = plain.json()["choices"][0]["calibration"]
        assert float(plain.headers["x-calm-confidence"]) == cal["confidence"] and plain.headers["x-calm-abstained"] == "false"
        assert plain.headers["x-calm-domain"] == cal["domain"] and plain.headers["x-calm-artifact-version"] == "test-v1"
        strict = client.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4,
                                                      "calm": {"threshold": 1.0}})
        assert strict.headers["x-calm-abstained"] == str(strict.json()["choices"][0]["calibration"]["abstained"]).lower()
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert "x-calm-confidence" not in streamed.headers  # sent before the answer exists: the body's last chunk has it
        assert streamed.headers["x-calm-domain"] == cal["domain"] and streamed.headers["x-calm-artifact-version"] == "test-v1"


def test_openapi_documents_error_statuses_and_405_names_allowed_methods(tmp_path):
    from fastapi.testclient import TestClient

    from calm_core.artifact import ArtifactManifest
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    manifest = ArtifactManifest.model_construct(reference_histograms={}, answer_format="letter", applies_to="all",
                                                has_adapter=False, artifact_version="test-v1")
    artifact = _stub_artifact(manifest)
    app = create_app(GatewaySettings(db_path=tmp_path / "g.db", served_model_name="m"), FailingEngine(None),
                     _tiny_tokenizer(), artifact)
    with TestClient(app) as client:
        spec = client.get("/openapi.json").json()
        chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
        assert {"400", "404", "503"} <= set(chat)
        assert chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert {"409"} <= set(spec["paths"]["/v1/feedback"]["post"]["responses"])
        wrong = client.get("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error"]["message"] == "Method Not Allowed"


class FreeFormModeEngine(FailingEngine):
    """An engine with a free-form mode: generated tokens get log-prob -0.2 calibrated; prompt log-probs (raw, read
    before logits processors) are -0.5 per token."""

    free_form_mode, prompt_logprobs = True, True

    def __init__(self):
        super().__init__(None)
        self.requests = []

    def describe(self) -> dict:
        return {"kind": "fake"}

    async def draw(self, request):
        from calm_core.engine import EngineDelta

        self.requests.append(request)
        if request.prompt_logprobs:
            ids = request.prompt_token_ids
            yield EngineDelta(text="", token_ids=[9], token_logprobs=[-1.0], top_logprobs=[{9: -1.0}],
                              prompt_logprobs=[math.nan] + [-0.5] * (len(ids) - 1), prompt_tokens=len(ids))
            return
        yield EngineDelta(text="Paris", token_ids=[7, 8], token_logprobs=[-0.2, -0.2],
                          top_logprobs=[{7: -0.2}, {8: -0.2}], prompt_tokens=3, finish_reason="stop")


def test_free_form_answers_go_to_the_artifacts_free_form_mode_with_a_raw_pass_from_prompt_logprobs(tmp_path):
    """An artifact fitted to multiple choice that carries a free-form mode: free-form answers are drawn on that mode's
    weights and read back through its head (not the multiple-choice adapter); raw confidence is the same answer's prompt log-probs without the
    head; multiple-choice requests keep the multiple-choice weights."""
    from fastapi.testclient import TestClient

    from calm_core.artifact import ArtifactManifest
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    manifest = ArtifactManifest.model_construct(
        reference_histograms={}, answer_format="letter", applies_to="multiple_choice", has_adapter=True,
        artifact_version="test-v1", free_form_version="ff-v1")
    artifact = _stub_artifact(manifest)
    engine = FreeFormModeEngine()
    app = create_app(GatewaySettings(db_path=tmp_path / "g.db", served_model_name="m"), engine, _tiny_tokenizer(), artifact)
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}],
            "calm": {"raw_confidence": True}}
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        cal = r.json()["choices"][0]["calibration"]
        assert cal["confidence"] == pytest.approx(math.exp(-0.2)) and cal["raw_confidence"] == pytest.approx(math.exp(-0.5))
        answer, raw = engine.requests  # (the read-back of each answer token is answered from the draw, unrecorded)
        assert answer.free_form and not answer.calibrated and not answer.adapter
        assert raw.free_form and not raw.calibrated and raw.prompt_logprobs and raw.prompt_token_ids[-2:] == (7, 8)
        health = client.get("/health", headers={"Authorization": "Bearer dev-admin-key"}).json()
        assert "free-form mode ff-v1: its adapter merged" in health["scoring"]["free_form"]
        assert "raw confidence (when asked) from the same weights" in health["scoring"]["free_form"]
        # Its verdict is a label for the free-form map: the token confidence as served, judged.
        assert client.post("/v1/feedback", json={"response_id": r.json()["id"], "correct": False}).status_code == 200
    from calm_core.db import Database
    from calm_core.served_answers import judged_free_form

    judged = judged_free_form(Database(tmp_path / "g.db"), "other", "test-v1")  # no domain named: "other"
    assert [(j.confidence, j.correct) for j in judged] == [(pytest.approx(math.exp(-0.2)), False)]
    # Without a free-form mode in the engine, free form falls back to the base weights without the head.
    engine = FreeFormModeEngine()
    engine.free_form_mode = False
    app = create_app(GatewaySettings(db_path=tmp_path / "g2.db", served_model_name="m"), engine, _tiny_tokenizer(), artifact)
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert not engine.requests[0].free_form and not engine.requests[0].calibrated and not engine.requests[0].adapter


def test_free_form_raw_confidence_is_asked_for_and_multiple_choice_raw_is_on_by_default(tmp_path):
    """Free-form raw confidence costs a second prefill (prompt + answer), so it is computed only when asked
    (`calm.raw_confidence` or CALM_FREE_FORM_RAW_CONFIDENCE); multiple choice keeps CALM_RAW_CONFIDENCE (on)."""
    from fastapi.testclient import TestClient

    from calm_core.artifact import ArtifactManifest
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    manifest = ArtifactManifest.model_construct(
        reference_histograms={}, answer_format="letter", applies_to="multiple_choice", has_adapter=True,
        artifact_version="test-v1", free_form_version="ff-v1")
    artifact = _stub_artifact(manifest)
    free = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
    cases = (({}, None, False), ({}, True, True), ({"free_form_raw_confidence": True}, None, True),
             ({"free_form_raw_confidence": True}, False, False), ({"raw_confidence": False}, True, True))
    for i, (settings, calm, raw_pass) in enumerate(cases):
        engine = FreeFormModeEngine()
        app = create_app(GatewaySettings(db_path=tmp_path / f"g{i}.db", served_model_name="m", **settings), engine,
                         _tiny_tokenizer(), artifact)
        body = {**free, "calm": {"raw_confidence": calm}} if calm is not None else free
        with TestClient(app) as client:
            r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        cal = r.json()["choices"][0]["calibration"]
        assert (len(engine.requests), cal["raw_confidence"] is not None) == (1 + raw_pass, raw_pass), (settings, calm)
    assert GatewaySettings.model_fields["raw_confidence"].default is True  # multiple choice: on unless turned off


def test_group_commit_writes_a_burst_in_few_transactions_and_fails_every_caller_of_a_failed_one():
    """Callers arriving while a transaction runs share the next one; each returns only once its rows are written; a
    failed write raises in every caller of its batch; a caller that gives up does not cancel the others' write."""
    import asyncio
    import threading

    from gateway.records.group_commit import GroupCommit

    written: list[list[int]] = []
    writing, release = threading.Event(), threading.Event()

    def write(rows):
        writing.set()
        assert release.wait(120)  # the first transaction is slow: the rest of the burst queues behind it
        if -1 in rows:
            raise OSError("disk full")
        written.append(list(rows))

    async def queued(commit, n: int):  # every caller so far has handed its rows to the commit
        while len(commit._pending) < n:
            await asyncio.sleep(0)

    async def burst():
        commit = GroupCommit(write)
        first = asyncio.create_task(commit.add([0]))
        await asyncio.to_thread(writing.wait, 120)  # its transaction is in progress
        rest = [asyncio.create_task(commit.add([i])) for i in range(1, 20)]
        quitter = asyncio.create_task(commit.add([99]))
        await queued(commit, 20)
        quitter.cancel()
        release.set()
        await asyncio.gather(first, *rest)
        assert written[0] == [0] and sorted(written[1]) == sorted([*range(1, 20), 99])  # 21 rows, 2 transactions
        release.clear()
        writing.clear()
        failing = [asyncio.create_task(commit.add([i])) for i in (-1, 5)]
        await asyncio.to_thread(writing.wait, 120)
        release.set()
        return await asyncio.gather(*failing, return_exceptions=True)

    errors = asyncio.run(burst())
    assert all(isinstance(e, OSError) for e in errors) and len(written) == 2


def test_group_commit_writes_a_lone_request_on_the_loop_and_anything_else_in_the_thread():
    """Alone, with no transaction in progress, a request's rows are written at once on the event loop; where that
    write declines (the lock is busy), where other requests are in flight, or where a transaction is in progress (its
    batch may still take the rows), they go to the writer thread."""
    import asyncio
    import threading

    from gateway.records.group_commit import GroupCommit

    loop_thread = threading.get_ident()
    writes: list[tuple[str, list[int]]] = []
    writing, release = threading.Event(), threading.Event()
    alone = True

    def write(rows):
        writes.append(("thread" if threading.get_ident() != loop_thread else "loop?", list(rows)))
        if 9 in rows:
            writing.set()
            assert release.wait(120)

    def write_at_once(rows) -> bool:
        if 0 in rows:  # busy
            return False
        writes.append(("loop" if threading.get_ident() == loop_thread else "thread?", list(rows)))
        return True

    async def requests():
        nonlocal alone
        commit = GroupCommit(write, write_at_once, lambda: alone)
        await commit.add([1])
        await commit.add([0])
        alone = False
        await commit.add([2])
        slow = asyncio.create_task(commit.add([9]))
        await asyncio.to_thread(writing.wait, 120)
        alone = True
        queued = asyncio.create_task(commit.add([3]))  # a transaction is in progress: joins the next batch
        while not (commit._pending or queued.done()):
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(slow, queued)
        await commit.add([4])

    asyncio.run(requests())
    assert writes == [("loop", [1]), ("thread", [0]), ("thread", [2]), ("thread", [9]), ("thread", [3]), ("loop", [4])]


def test_the_prompt_token_bound_is_never_below_the_token_count(embedded_model_dir):
    """The cheap bound that spares tokenizing short prompts (gateway/serving/prepare.py) holds on real questions under the
    chat template, in several scripts."""
    from calm_core.data import load_open
    from calm_core.prompts import render_chat
    from gateway.serving.prepare import prompt_token_bound

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    texts = [q.question for q in load_open("triviaqa")[:200] + load_open("popqa")[:200]]
    texts += ["Quelle est la capitale de la France ?", "東京は日本の首都ですか？", "Ответь: 2+2=?", "🙂" * 50, "", " \n\t"]
    for text in texts:
        prompt = render_chat(tokenizer, [{"role": "user", "content": text}])
        assert prompt_token_bound(prompt) >= len(tokenizer.encode(prompt, add_special_tokens=False))


def test_blank_text_is_what_the_schemas_nonblank_pattern_refuses():
    """The OpenAPI document says `pattern: \\S`; a text the pattern accepts must not be refused as blank by the
    handler (schemathesis found U+001D, which Python's str.strip() removes but the schema's regex engines keep)."""
    from typing import Annotated

    from pydantic import StringConstraints, TypeAdapter, ValidationError

    from gateway.protocol.common import NONBLANK, blank

    pattern = TypeAdapter(Annotated[str, StringConstraints(pattern=NONBLANK)])
    for code in [*range(0x3100), 0xFEFF]:
        text = chr(code) * 2
        try:
            pattern.validate_python(text)
            accepted = True
        except ValidationError:
            accepted = False
        assert blank(text) != accepted, hex(code)


def test_the_added_latency_benchmark_sends_the_gateways_exact_request_directly(tmp_path, embedded_model_dir):
    """benchmarks/gateway/bench_added_latency.py compares the gateway with its own engine request sent directly (the
    `text-prompt` variant): that request must be the one the gateway makes (it once was not: the benchmark sent token
    ids where the gateway sends the prompt's text)."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from adapters.clients.upstream import _payload
    from benchmarks.gateway.bench_added_latency import MODEL, variants
    from calm_core.artifact import ArtifactManifest
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    manifest = ArtifactManifest.model_construct(reference_histograms={}, answer_format="letter", applies_to="all",
                                                has_adapter=False, artifact_version="test-v1")
    engine = FreeFormModeEngine()
    engine.free_form_mode, engine.prompt_logprobs, engine.model_name = False, False, MODEL
    app = create_app(GatewaySettings(db_path=tmp_path / "g.db"), engine, tokenizer, _stub_artifact(manifest))
    question = "Which American-born Sinclair won the Nobel Prize for Literature in 1930?"
    bench = variants(tokenizer, question, head="test-v1")
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=bench["gateway"][1])
        assert r.status_code == 200, r.text
    (sent,) = engine.requests
    assert _payload(MODEL, "test-v1", sent, stream=False) == bench["text-prompt"][1]
    assert _payload(MODEL, "test-v1", sent, stream=True) == bench["+stream"][1]
