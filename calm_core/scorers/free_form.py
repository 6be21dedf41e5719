"""Free-form scorers: token confidence of the generated answer, and semantic confidence of the same answer from how
many sampled answers agree with it (calm_core/semantic.py says why the samples are drawn without the head).

An answer is drawn from the served weights' own distribution (α head off) with the caller's sampling parameters, as
vLLM would draw it; its confidence is read back through the version's calibration at temperature 1 with no
truncation (`read_back`), so the same answer gets the same confidence however it was sampled, and no sampling
parameter can move a policy's decision. Token confidence is calm_core/scoring.py's `sequence_confidence` of those
read-back log-probs; its raw counterpart reads the same answer's prompt log-probs on the same weights (one prefill,
taken before logits processors), so it needs an engine that returns prompt log-probs.
"""

from __future__ import annotations

import asyncio
import hashlib
import weakref
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import ClassVar

from calm_core.answers import AgreementReader, cluster_entropy, semantic_clusters
from calm_core.engine import (
    EngineClient, EngineDelta, EngineOutput, EngineRequest, EngineUnavailable, charged, generate, generate_choices,
    prepaid,
)
from calm_core.scorers.base import (
    AnswerKind, PostHoc, ScoredChoice, Scoring, ScoringJob, ScoringPath, WholeAnswer, raw_request,
)
from calm_core.recalibration import powered
from calm_core.scoring import sequence_confidence, topk_entropy
from calm_core.semantic import SemanticCalibration

AGREES = 0.5  # a sample says the same as an answer when half its new words do (word F1 of what the prompt did not say)


READ_TOP_K = 5  # top-k log-probs read back per answer token: the entropy beside the confidence
# Read-back requests in flight in this process at once, whatever the answers' lengths and n: one call may ask for
# n x max_tokens of them, and an upstream engine's connection pool is shared by every request of the gateway.
READS_IN_FLIGHT = 128
_READ_LIMITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its semaphore


def _read_limit() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if loop not in _READ_LIMITS:
        _READ_LIMITS[loop] = asyncio.Semaphore(READS_IN_FLIGHT)
    return _READ_LIMITS[loop]


async def _limited(engine: EngineClient, request: EngineRequest) -> EngineOutput:
    async with _read_limit():
        return await generate(engine, request)


def answer_request(request: EngineRequest, head_keeps_order: bool) -> EngineRequest:
    """The request that draws free-form answers, the caller's sampling parameters unchanged (greedy where none were
    given): through the head where the draw carries its own numbers (`read_while_drawn`), else the served weights
    with the α head off."""
    return request if read_while_drawn(request, head_keeps_order) else replace(request, calibrated=False)


def read_while_drawn(request: EngineRequest, head_keeps_order: bool) -> bool:
    """Whether the draw itself can carry the read-back's numbers, saving its one request per answer token: a plain
    greedy draw (no truncation, penalty, bias or structured output: vLLM's greedy log-probs then carry no sampling
    transform) through a head that keeps the model's order of tokens (or through none) is the model's own greedy
    answer, and its log-probs are the calibrated ones at temperature 1. Every other draw is read back."""
    plain = (request.temperature == 0 and request.top_p == 1.0 and request.top_k in (0, -1) and request.min_p == 0
             and request.presence_penalty == 0 and request.frequency_penalty == 0 and request.repetition_penalty == 1
             and not request.logit_bias and request.json_schema is None and not request.json_object)
    return plain and (head_keeps_order or not request.calibrated)


def prompt_ids(request: EngineRequest, tokenizer, out: EngineOutput | None = None) -> list[int]:
    """The prompt an answer continues: as the engine tokenized it where it says (a tokenizer that adds a BOS token to
    a text prompt), else the request's ids, else the text without special tokens (as upstream engines get it)."""
    if out is not None and out.prompt_token_ids:
        return list(out.prompt_token_ids)
    return list(request.prompt_token_ids) or tokenizer.encode(request.prompt, add_special_tokens=False)


async def read_back(engine: EngineClient, prompt: list[int], request: EngineRequest, out: EngineOutput,
                    index: int = 0) -> tuple[list[float], list[dict[int, float]]]:
    """Each answer token's log-prob, and the top-k there, under the version's calibration (`request.calibrated`) at
    temperature 1 with no truncation: one greedy one-token request per answer token, its prompt the question and the
    answer's tokens before it (sharing the engine's prefix cache), so none of the caller's sampling parameters reach
    the numbers. A token outside its position's top-k is asked for by id in a second request."""
    def at(i: int, **asked) -> EngineRequest:
        return EngineRequest(request_id=f"{request.request_id}-read{index}-{i}", prompt="", max_tokens=1,
                             prompt_token_ids=tuple(prompt + out.token_ids[:i]), calibrated=request.calibrated,
                             adapter=request.adapter, free_form=request.free_form, **asked)

    reads = [at(i, top_logprobs=READ_TOP_K) for i in range(len(out.token_ids))]
    with prepaid(reads):
        tops = [o.top_logprobs[0] if o.top_logprobs else {}
                for o in await asyncio.gather(*(_limited(engine, r) for r in reads))]
    missing = [i for i, token in enumerate(out.token_ids) if token not in tops[i]]
    by_id = [at(i, option_token_ids=(out.token_ids[i],), restrict_to_options=False) for i in missing]
    with prepaid(by_id):
        asked = await asyncio.gather(*(_limited(engine, r) for r in by_id))
    found = {i: o.top_logprobs[0].get(out.token_ids[i]) if o.top_logprobs else None for i, o in zip(missing, asked)}
    if None in found.values():
        raise EngineUnavailable("the engine returned no log-prob for an answer token asked for by id")
    return [found[i] if i in found else tops[i][t] for i, t in enumerate(out.token_ids)], tops


class TokenScorer:
    path: ClassVar[ScoringPath] = ScoringPath.TOKEN
    kind: ClassVar[AnswerKind] = AnswerKind.FREE_FORM
    description: ClassVar[str] = "token: the answer's calibrated token log-probs"
    streams: ClassVar[bool] = True

    def __init__(self, engine: EngineClient, tokenizer, post_hoc: PostHoc = PostHoc()):
        self.engine = engine
        self.tokenizer = tokenizer
        self.token_temperature = post_hoc.token_temperature
        self.head_keeps_order = post_hoc.head_keeps_order

    def _generation(self, job: ScoringJob) -> EngineRequest:
        """What the answers are drawn with."""
        return answer_request(job.request, self.head_keeps_order)

    async def score(self, job: ScoringJob) -> Scoring:
        return await self._read(job, await generate_choices(self.engine, self._generation(job)))

    async def stream(self, job: ScoringJob) -> AsyncIterator[EngineDelta | Scoring]:
        deltas = []
        async for delta in self.engine.stream(charged(self._generation(job))):
            deltas.append(delta)
            yield delta
        yield await self._read(job, EngineOutput.collect_choices(deltas, job.request.n))

    async def _read(self, job: ScoringJob, outs: list[EngineOutput]) -> Scoring:
        """The scoring of outputs already generated: each read back through the version's calibration, and without
        it where the raw confidence is wanted."""
        readings = asyncio.gather(*(self._reading(job.request, o, i) for i, o in enumerate(outs)))
        if job.with_raw and self.engine.prompt_logprobs:
            raws = asyncio.gather(*(self.raw_confidence(o, job.request, i) for i, o in enumerate(outs)))
            readings, raws = await asyncio.gather(readings, raws)
        else:
            readings, raws = await readings, [None] * len(outs)
        choices = [ScoredChoice(o.text, o.finish_reason, float(powered(sequence_confidence(lps), self.token_temperature)),
                                raw, topk_entropy(tops), len(o.token_ids), output=o, calibrated_logprobs=lps)
                   for o, (lps, tops), raw in zip(outs, readings, raws)]
        return Scoring(self.path, self.kind, choices, outs[0].prompt_tokens)

    async def _reading(self, request: EngineRequest, out: EngineOutput, index: int):
        if read_while_drawn(request, self.head_keeps_order):
            return out.token_logprobs, out.top_logprobs
        return await read_back(self.engine, prompt_ids(request, self.tokenizer, out), request, out, index)

    async def raw_confidence(self, out: EngineOutput, request: EngineRequest, index: int = 0) -> float | None:
        """The token confidence of the same answer without the α head: the prompt log-probs of prompt + answer on the
        same weights (one prefill, no generation; prompt log-probs are taken before logits processors)."""
        if not out.token_ids:
            return None
        prompt = prompt_ids(request, self.tokenizer, out)
        raw = await generate(self.engine, EngineRequest(
            request_id=f"{request.request_id}-raw{index}", prompt="", prompt_token_ids=tuple(prompt + out.token_ids),
            max_tokens=1, prompt_logprobs=True, calibrated=False, adapter=request.adapter, free_form=request.free_form))
        lps = (raw.prompt_logprobs or [])[len(prompt):]
        if len(lps) != len(out.token_ids):
            raise EngineUnavailable("the engine returned no prompt log-probs for the answer")
        return sequence_confidence(lps)


def samples_seed(request: EngineRequest) -> int:
    """The seed of a request's semantic samples: the caller's, else one drawn from the prompt, so the same question
    gets the same samples and its confidence (and whether a policy answers it) does not change from call to call."""
    if request.seed is not None:
        return request.seed
    prompt = request.prompt or " ".join(map(str, request.prompt_token_ids or ()))
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big") >> 1  # vLLM takes any int; keep it 31-bit


class SemanticScorer(WholeAnswer):
    path: ClassVar[ScoringPath] = ScoringPath.SEMANTIC
    kind: ClassVar[AnswerKind] = AnswerKind.FREE_FORM
    description: ClassVar[str] = ("semantic: the token answer; its confidence from how many answers sampled without the "
                                  "head say the same")

    def __init__(self, engine: EngineClient, tokenizer=None, post_hoc: PostHoc = PostHoc()):
        self.engine = engine
        self.calibration = post_hoc.semantic or SemanticCalibration()
        self.head_keeps_order = post_hoc.head_keeps_order

    async def score(self, job: ScoringJob) -> Scoring:
        """The answers are those token confidence would return for the same request (a confidence method never changes
        an answer). Beside them, `job.samples` answers are drawn in one engine call from the same weights without the
        α head, at the version's sampling temperature (seeded: `samples_seed`); each answer's confidence is the
        version's map of the share of samples that agree with it (`calm_core/answers.agreement` ≥ 1/2), its raw
        confidence that share unmapped."""
        cal = self.calibration
        sampled = raw_request(job.request, n=job.samples, temperature=cal.temperature,
                              max_tokens=min(job.request.max_tokens, cal.max_tokens), seed=samples_seed(job.request))
        answers = answer_request(job.request, self.head_keeps_order)  # as token confidence draws them
        with prepaid([answers, sampled]):
            outs, samples = await asyncio.gather(generate_choices(self.engine, answers),
                                                 generate_choices(self.engine, sampled))
        texts, reader = [s.text for s in samples], AgreementReader(job.prompt.text)
        words = [reader.words(t) for t in texts]
        clusters = semantic_clusters(texts, threshold=AGREES, words=words)
        listed = [(texts[c.representative], c.size) for c in clusters]
        sampled_tokens = sum(len(s.token_ids) for s in samples)  # generated for this request: counted once, choice 0
        choices = []
        for i, out in enumerate(outs):
            answer = reader.words(out.text)
            agreeing = sum(reader.f1(answer, w) >= AGREES for w in words)
            choices.append(ScoredChoice(
                out.text, out.finish_reason, cal.confidence(agreeing, len(texts)),
                agreeing / len(texts) if job.with_raw else None, cluster_entropy(clusters),
                len(out.token_ids) + (sampled_tokens if i == 0 else 0), clusters=listed, output=out))
        return Scoring(self.path, self.kind, choices, outs[0].prompt_tokens)
