"""Each scorer against a scripted engine: what it asks the engine for, and the numbers it reads back (pure logic; the
real engines are checked against each other in test_offline_scoring.py and the gateway suites)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import numpy as np
import pytest

from calm_core.engine import EngineDelta, EngineRequest
from calm_core.prompts import LETTERS, ClozeTokens, PreparedPrompt, letter_token_ids
from calm_core.scorers.base import AnswerKind, ConfidenceMethod, PostHoc, ScoringJob, ScoringPath
from calm_core.scorers.free_form import SemanticScorer, TokenScorer
from calm_core.scorers.options import ClozeOnePassScorer, ClozePerTokenScorer, LetterScorer
from calm_core.scorers.registry import SCORERS, Scorers
from calm_core.semantic import SemanticCalibration
from tests.test_gateway_logic import _tiny_tokenizer


class Scripted:
    """An engine whose answers a test writes: `answer(request)` returns the one delta per completion."""

    model_name, artifact_version, max_model_len = "m", "v", 2048
    folded_scoring = free_form_mode = prompt_logprobs = False

    def __init__(self, answer, **capabilities):
        self.answer, self.requests = answer, []
        self.__dict__.update(capabilities)

    async def stream(self, request: EngineRequest):
        self.requests.append(request)
        for delta in self.answer(request):
            yield delta


def run(scorer, job):
    return asyncio.run(scorer.score(job))


def letter_job(n_options=3, **request):
    return ScoringJob(PreparedPrompt("question?", LETTERS[:n_options]), EngineRequest(request_id="r", prompt="question?",
                                                                                        max_tokens=1, **request))


def test_letter_scorer_asks_for_the_letters_and_renormalises_over_them_with_a_raw_pass():
    tokenizer = _tiny_tokenizer()
    a, b, c = letter_token_ids(tokenizer)[:3]

    def answer(request):  # calibrated: 0.5 / 0.3 / 0.1 of the vocabulary; raw: uniform over the options
        lps = {a: math.log(0.5), b: math.log(0.3), c: math.log(0.1)} if request.calibrated else {a: -1.0, b: -1.0, c: -1.0}
        return [EngineDelta(text="B", token_ids=[b], token_logprobs=[lps[b]], top_logprobs=[lps], prompt_tokens=9,
                            index=i) for i in range(request.n)]

    engine = Scripted(answer)
    scoring = run(LetterScorer(engine, tokenizer), ScoringJob(letter_job().prompt, letter_job().request, with_raw=True))
    calibrated, raw = engine.requests
    assert calibrated.option_token_ids == (a, b, c) and calibrated.max_tokens == 1 and calibrated.calibrated
    assert not raw.calibrated and raw.n == 1 and raw.request_id == "r-raw"
    (choice,) = scoring.choices
    np.testing.assert_allclose(choice.option_probs, [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9])
    # The engine's sampled token is the answer (here B, not the most probable A); raw: B's share without the head.
    assert choice.text == "B" and choice.chosen == 1 and choice.confidence == pytest.approx(0.3 / 0.9)
    assert choice.raw_confidence == pytest.approx(1 / 3) and scoring.prompt_tokens == 9
    assert scoring.kind is AnswerKind.MULTIPLE_CHOICE and scoring.method is None
    two = run(LetterScorer(Scripted(answer), tokenizer), letter_job(n=2, temperature=1.0))
    assert len(two.choices) == 2 and all(c.raw_confidence is None for c in two.choices)


def cloze_job(**request):
    tokens = ClozeTokens(prompt=(1, 2, 3), options=((40, 41), (50,)))
    return ScoringJob(PreparedPrompt("Question: q\nAnswer:", LETTERS[:2], tokens),
                      EngineRequest(request_id="r", prompt="Question: q\nAnswer:", max_tokens=1, **request))


def per_token_answer(request):
    """Option token t after k prompt tokens has log-prob -(k + t / 100); raw ones 1 lower."""
    token = request.option_token_ids[0]
    value = -(len(request.prompt_token_ids) + token / 100) - (0.0 if request.calibrated else 1.0)
    return [EngineDelta(text="x", token_ids=[7], token_logprobs=[-1.0], top_logprobs=[{token: value, 7: -1.0}])]


def test_cloze_per_token_scorer_softmaxes_mean_token_log_probs_and_samples_options_at_temperature():
    engine = Scripted(per_token_answer)
    scoring = run(ClozePerTokenScorer(engine), ScoringJob(cloze_job().prompt, cloze_job().request, with_raw=True))
    scores = np.array([-(3.40 + 4.41) / 2, -3.50])
    expected = np.exp(scores - np.logaddexp(*scores))
    (choice,) = scoring.choices
    np.testing.assert_allclose(choice.option_probs, expected)
    assert choice.chosen == int(np.argmax(expected)) and choice.text == LETTERS[choice.chosen]
    assert choice.raw_confidence == pytest.approx(expected[choice.chosen])  # raw shifts every score by the same 1
    assert len(engine.requests) == 2 * 3  # one request per option token, calibrated and raw
    assert scoring.prompt_tokens == 3 + 3
    sampled = run(ClozePerTokenScorer(Scripted(per_token_answer)), cloze_job(temperature=1.0, n=50, seed=1))
    picks = [c.chosen for c in sampled.choices]
    assert set(picks) == {0, 1} and all(c.confidence == pytest.approx(expected[c.chosen]) for c in sampled.choices)


def test_cloze_one_pass_scorer_reads_folded_prompt_log_probs_one_request_per_option():
    def answer(request):
        ids = request.prompt_token_ids
        lps = [math.nan] + [-(i + t / 100) - (1.0 if request.folded else 0.0) for i, t in enumerate(ids) if i > 0]
        return [EngineDelta(text="x", token_ids=[7], token_logprobs=[-1.0], top_logprobs=[{7: -1.0}],
                            prompt_logprobs=lps)]

    engine = Scripted(answer, folded_scoring=True)
    (choice,) = run(ClozeOnePassScorer(engine), cloze_job()).choices
    scores = np.array([-(3.40 + 4.41) / 2 - 1, -3.50 - 1])
    np.testing.assert_allclose(choice.option_probs, np.exp(scores - np.logaddexp(*scores)))
    assert all(r.folded and r.prompt_logprobs and not r.calibrated for r in engine.requests)
    assert [r.prompt_token_ids for r in engine.requests] == [(1, 2, 3, 40, 41), (1, 2, 3, 50)]


def test_a_recalibrated_versions_temperature_divides_the_option_scores_and_leaves_raw_and_the_answer_alone():
    scores = np.array([-(3.40 + 4.41) / 2, -3.50])
    for temperature in (0.5, 2.0):
        job = ScoringJob(cloze_job().prompt, cloze_job().request, with_raw=True)
        (choice,) = run(ClozePerTokenScorer(Scripted(per_token_answer), None, PostHoc(option_temperature=temperature)),
                        job).choices
        tempered = scores / temperature
        np.testing.assert_allclose(choice.option_probs, np.exp(tempered - np.logaddexp(*tempered)))
        assert choice.chosen == int(np.argmax(scores))  # the answer never changes
        assert choice.raw_confidence == pytest.approx(np.exp(scores - np.logaddexp(*scores))[choice.chosen])


def free_job(samples=0, **request):
    return ScoringJob(PreparedPrompt("<q>", None), EngineRequest(request_id="r", prompt="<q>", max_tokens=8, **request),
                      samples=samples)


# Read back through the head at each position of the answer "Paris" (tokens 5, 6): the calibrated top-k there.
READ = [{5: -0.2, 9: -1.9}, {3: -0.1, 4: -2.5}]  # token 6 is not in position 1's top-k: asked for by id
ASKED = {6: -2.0}


def free_answer(request, prompt_len: int):
    """Generation: "Paris" with the sampler's own log-probs. Read-back (one greedy token after the prompt and k answer
    tokens): READ[k], or ASKED for a token asked by id. The raw pass (prompt log-probs): -0.5 a token."""
    if request.prompt_logprobs:
        return [EngineDelta(token_ids=[1], prompt_logprobs=[math.nan] + [-0.5] * (len(request.prompt_token_ids) - 1))]
    if request.prompt_token_ids:
        top = {t: ASKED[t] for t in request.option_token_ids} or READ[len(request.prompt_token_ids) - prompt_len]
        token = next(iter(top))
        return [EngineDelta(text="x", token_ids=[token], token_logprobs=[top[token]], top_logprobs=[top])]
    return [EngineDelta(text="Paris", token_ids=[5, 6], token_logprobs=[-0.1, -0.3],
                        top_logprobs=[{5: -0.1, 9: -2.4}, {6: -0.3}], prompt_tokens=4, finish_reason="stop")]


def test_token_scorer_draws_without_the_head_and_reads_the_answer_back_through_it():
    """An answer is the served weights' own draw under the caller's sampling parameters (head off); its confidence is
    the geometric mean of its tokens' probabilities read back one greedy token at a time through the version's
    calibration, whatever temperature or truncation drew it; raw confidence from prompt log-probs without the head."""
    tokenizer = _tiny_tokenizer()
    prompt_len = len(tokenizer.encode("<q>", add_special_tokens=False))
    confidences = set()
    for sampling in ({}, {"temperature": 0.3}, {"temperature": 1.0, "top_p": 0.01}, {"temperature": 0.8, "top_k": 1}):
        engine = Scripted(lambda r: free_answer(r, prompt_len), prompt_logprobs=True)
        job = free_job(**sampling)
        scoring = run(TokenScorer(engine, tokenizer), ScoringJob(job.prompt, job.request, with_raw=True))
        (choice,) = scoring.choices
        confidences.add(choice.confidence)
        assert choice.text == "Paris" and choice.confidence == pytest.approx(math.exp((-0.2 - 2.0) / 2))
        assert choice.calibrated_logprobs == [-0.2, -2.0] and choice.output.token_logprobs == [-0.1, -0.3]
        assert choice.raw_confidence == pytest.approx(math.exp(-0.5)) and choice.completion_tokens == 2
        generation, *reads = engine.requests
        assert generation == replace(job.request, calibrated=False)  # the caller's parameters, head off
        raw = next(r for r in reads if r.prompt_logprobs)
        assert raw.prompt_token_ids[-2:] == (5, 6) and not raw.calibrated and raw.max_tokens == 1
        reads = [r for r in reads if not r.prompt_logprobs]
        assert [r.prompt_token_ids[prompt_len:] for r in reads] == [(), (5,), (5,)]  # position 1 asked again, by id
        assert [r.option_token_ids for r in reads] == [(), (), (6,)] and not reads[2].restrict_to_options
        assert all(r.calibrated and r.temperature == 0.0 and r.top_p == 1.0 and r.top_k == 0 and r.max_tokens == 1
                   for r in reads)
        assert scoring.method is ConfidenceMethod.TOKEN and scoring.kind is AnswerKind.FREE_FORM
    assert len(confidences) == 1
    without = Scripted(lambda r: free_answer(r, prompt_len))  # no prompt log-probs: raw confidence stays unknown
    job = free_job()
    assert run(TokenScorer(without, tokenizer), ScoringJob(job.prompt, job.request, with_raw=True)
               ).choices[0].raw_confidence is None and not any(r.prompt_logprobs for r in without.requests)


def test_a_recalibrated_free_form_modes_temperature_divides_the_mean_log_prob_and_leaves_raw_and_the_answer_alone():
    tokenizer = _tiny_tokenizer()
    prompt_len = len(tokenizer.encode("<q>", add_special_tokens=False))
    job = ScoringJob(free_job().prompt, free_job().request, with_raw=True)
    for temperature in (0.5, 2.0):
        engine = Scripted(lambda r: free_answer(r, prompt_len), prompt_logprobs=True)
        (choice,) = run(TokenScorer(engine, tokenizer, PostHoc(token_temperature=temperature)), job).choices
        assert choice.text == "Paris" and choice.confidence == pytest.approx(math.exp(-2.2 / 2 / temperature))
        assert choice.raw_confidence == pytest.approx(math.exp(-0.5))  # the raw model's number is not remapped


def test_semantic_scorer_keeps_the_token_answer_and_measures_agreement_on_raw_samples():
    samples = ["Paris", "It is Paris.", "London", "paris"]

    def answer(request):
        if request.n == 1:  # the answer: as token confidence would generate it
            return [EngineDelta(text="The capital is Paris.", token_ids=[7, 8], token_logprobs=[-0.1, -0.2],
                                top_logprobs=[{7: -0.1}, {8: -0.2}], prompt_tokens=3, index=0, finish_reason="stop")]
        return [EngineDelta(text=samples[i % 4], token_ids=[7], token_logprobs=[-0.5], top_logprobs=[{7: -0.5}],
                            prompt_tokens=3, index=i, finish_reason="stop") for i in range(request.n)]

    engine = Scripted(answer)
    calibration = SemanticCalibration(temperature=0.5, max_tokens=4, slope=2.0, intercept=-1.0)
    job = free_job(samples=4)
    scoring = run(SemanticScorer(engine, None, PostHoc(semantic=calibration)), ScoringJob(job.prompt, job.request, with_raw=True,
                                                                       samples=4))
    answer_request, sampled = engine.requests
    assert answer_request == replace(job.request, calibrated=False)  # exactly the token scorer's draw
    assert sampled.n == 4 and sampled.temperature == 0.5 and not sampled.calibrated  # raw weights, moderate T
    assert sampled.max_tokens == min(job.request.max_tokens, 4)
    (choice,) = scoring.choices
    assert choice.text == "The capital is Paris."  # never a sample
    assert choice.raw_confidence == 0.75  # 3 of 4 samples say Paris
    assert choice.confidence == pytest.approx(calibration.confidence(3, 4))
    assert choice.clusters == [("Paris", 3), ("London", 1)] and choice.completion_tokens == 2 + 4
    assert scoring.method is ConfidenceMethod.SEMANTIC
    # Without a raw request the raw share is not reported, and nothing else changes.
    assert run(SemanticScorer(engine), free_job(samples=4)).choices[0].raw_confidence is None


def test_semantic_samples_are_seeded_by_the_question_unless_the_caller_seeds_them():
    """The same question twice got 0.129 and 0.208 from the shipped gateway (fresh random samples each call), so a
    policy's answer-or-abstain could flip on a repeat; seeded from the prompt, a repeat gets the same samples."""
    from calm_core.scorers.free_form import samples_seed

    engine = Scripted(lambda request: [EngineDelta(text="Paris", token_ids=[7], token_logprobs=[-0.1],
                                                   top_logprobs=[{7: -0.1}], prompt_tokens=3, index=i,
                                                   finish_reason="stop") for i in range(request.n)])
    job = free_job(samples=4)
    for _ in range(2):
        run(SemanticScorer(engine), job)
    first, second = engine.requests[1].seed, engine.requests[3].seed
    assert first == second == samples_seed(job.request) and 0 <= first < 2**31
    assert engine.requests[0].seed is None  # the answer itself: the caller's request as it is
    other = replace(job.request, prompt=job.request.prompt + " Answer briefly.")
    assert samples_seed(other) != first and samples_seed(replace(job.request, seed=11)) == 11
    assert samples_seed(replace(job.request, prompt="", prompt_token_ids=(5, 6))) == samples_seed(
        replace(job.request, prompt="", prompt_token_ids=(5, 6))) != samples_seed(replace(job.request, prompt="",
                                                                                          prompt_token_ids=(6, 5)))


def test_semantic_scorer_scores_each_of_n_answers_against_the_same_samples():
    def answer(request):
        if request.request_id == "r":  # the answers (the samples' request has an id of its own)
            return [EngineDelta(text=["Paris", "Lyon"][i], token_ids=[7], token_logprobs=[-0.1], top_logprobs=[{7: -0.1}],
                                prompt_tokens=3, index=i, finish_reason="stop") for i in range(request.n)]
        return [EngineDelta(text="Paris", token_ids=[7], token_logprobs=[-0.5], top_logprobs=[{7: -0.5}],
                            prompt_tokens=3, index=i, finish_reason="stop") for i in range(request.n)]

    job = free_job(samples=5)
    job = ScoringJob(job.prompt, replace(job.request, n=2, temperature=1.0), with_raw=True, samples=5)
    scoring = run(SemanticScorer(Scripted(answer)), job)
    assert [(c.text, c.raw_confidence) for c in scoring.choices] == [("Paris", 1.0), ("Lyon", 0.0)]
    assert scoring.choices[0].confidence > 0.9 > 0.1 > scoring.choices[1].confidence


def test_the_registry_chooses_by_answer_format_engine_and_method():
    tokenizer = _tiny_tokenizer()
    assert set(SCORERS) == set(ScoringPath)
    mc, free = PreparedPrompt("q", ("A", "B")), PreparedPrompt("q", None)
    letter = Scorers(Scripted(None), tokenizer, "letter")
    assert letter.for_prompt(mc).path is ScoringPath.LETTER
    assert letter.for_prompt(free).path is ScoringPath.TOKEN
    assert letter.for_prompt(free, ConfidenceMethod.SEMANTIC).path is ScoringPath.SEMANTIC
    assert Scorers(Scripted(None), tokenizer, "cloze").for_prompt(mc).path is ScoringPath.CLOZE_PER_TOKEN
    assert Scorers(Scripted(None, folded_scoring=True), tokenizer, "cloze").for_prompt(mc).path is ScoringPath.CLOZE_ONE_PASS
    assert Scorers(Scripted(None), tokenizer, "generative").for_prompt(mc).path is ScoringPath.LETTER
    with pytest.raises(ValueError):
        Scorers(Scripted(None), tokenizer, "guess")


def test_the_read_back_keeps_at_most_its_limit_of_requests_in_flight(monkeypatch):
    """One call may ask for n x max_tokens read-back requests (16 x 1,024); at most READS_IN_FLIGHT are sent at once."""
    import calm_core.scorers.free_form as free_form

    monkeypatch.setattr(free_form, "READS_IN_FLIGHT", 3)
    in_flight, most = 0, 0

    class Slow:
        model_name, artifact_version, max_model_len = "m", "v", 2048
        folded_scoring = free_form_mode = prompt_logprobs = False

        async def stream(self, request):
            nonlocal in_flight, most
            if not request.prompt_token_ids:  # the draw: 40 tokens
                yield EngineDelta(text="x" * 40, token_ids=list(range(40)), token_logprobs=[-0.1] * 40,
                                  top_logprobs=[{t: -0.1} for t in range(40)], prompt_tokens=3, finish_reason="stop")
                return
            in_flight += 1
            most = max(most, in_flight)
            await asyncio.sleep(0)
            in_flight -= 1
            token = len(request.prompt_token_ids) - 1  # anything: read back as -0.1 for whatever was asked
            top = {t: -0.1 for t in request.option_token_ids} or {t: -0.1 for t in range(40)}
            yield EngineDelta(text="x", token_ids=[token], token_logprobs=[-0.1], top_logprobs=[top])

    job = free_job()
    (choice,) = run(TokenScorer(Slow(), _tiny_tokenizer()), ScoringJob(job.prompt, job.request)).choices
    assert choice.confidence == pytest.approx(math.exp(-0.1)) and most == 3


def test_an_answer_is_read_back_after_the_prompt_as_the_engine_tokenized_it():
    """An engine that reports its prompt's ids (in-process vLLM adds a tokenizer's BOS to a text prompt) has the
    answer read back, and the raw pass read, after exactly those ids, not the text re-tokenized without them."""
    tokenizer = _tiny_tokenizer()
    engine_ids = [99, *tokenizer.encode("<q>", add_special_tokens=False)]

    def answer(request):
        if request.prompt_logprobs:
            return [EngineDelta(token_ids=[1], prompt_logprobs=[math.nan] + [-0.5] * (len(request.prompt_token_ids) - 1))]
        if request.prompt_token_ids:
            return [EngineDelta(text="x", token_ids=[5], token_logprobs=[-0.2], top_logprobs=[{5: -0.2}])]
        return [EngineDelta(text="Paris", token_ids=[5], token_logprobs=[-0.1], top_logprobs=[{5: -0.1}],
                            prompt_tokens=len(engine_ids), prompt_token_ids=engine_ids, finish_reason="stop")]

    engine = Scripted(answer, prompt_logprobs=True)
    job = free_job()
    run(TokenScorer(engine, tokenizer), ScoringJob(job.prompt, job.request, with_raw=True))
    assert [list(r.prompt_token_ids) for r in engine.requests[1:]] in (
        [engine_ids, engine_ids + [5]], [engine_ids + [5], engine_ids])  # the read-back and the raw pass


def test_a_plain_greedy_draw_through_an_order_keeping_head_is_its_own_read_back():
    """A head that is one scale and shift for every token keeps the model's greedy answer, and vLLM's greedy
    log-probs carry no sampling transform: such a draw is taken through the head and scored from its own log-probs
    (no request per token). Any sampling parameter, or a head that reorders tokens, sends it to the read-back."""
    tokenizer = _tiny_tokenizer()
    prompt_len = len(tokenizer.encode("<q>", add_special_tokens=False))
    keeps = PostHoc(head_keeps_order=True)
    for sampling, post_hoc, one_pass in (({}, keeps, True), ({"temperature": 0.3}, keeps, False),
                                         ({"top_k": 1}, keeps, False), ({"repetition_penalty": 1.1}, keeps, False),
                                         ({}, PostHoc(), False)):
        engine = Scripted(lambda r: free_answer(r, prompt_len))
        job = free_job(**sampling)
        (choice,) = run(TokenScorer(engine, tokenizer, post_hoc), ScoringJob(job.prompt, job.request)).choices
        draw = engine.requests[0]
        if one_pass:
            assert draw == job.request and len(engine.requests) == 1  # through the head, nothing read back
            assert choice.confidence == pytest.approx(math.exp((-0.1 - 0.3) / 2))
        else:
            assert not draw.calibrated and len(engine.requests) == 4, sampling
            assert choice.confidence == pytest.approx(math.exp((-0.2 - 2.0) / 2))
