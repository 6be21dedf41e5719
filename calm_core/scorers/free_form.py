"""Free-form scorers: token confidence of the generated answer, and semantic confidence of the same answer from how
many sampled answers agree with it (calm_core/semantic.py says why the samples are drawn without the head).

Token confidence is calm_core/scoring.py's `sequence_confidence` of the answer's calibrated token log-probs; its raw
counterpart reads the same answer's prompt log-probs on the same weights (one prefill, taken before logits
processors), so it needs an engine that returns prompt log-probs.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import ClassVar

from calm_core.answers import AgreementReader, cluster_entropy, semantic_clusters
from calm_core.engine import EngineClient, EngineOutput, EngineRequest, EngineUnavailable, generate, generate_choices
from calm_core.scorers.base import AnswerKind, PostHoc, ScoredChoice, Scoring, ScoringJob, ScoringPath, raw_request
from calm_core.recalibration import powered
from calm_core.scoring import sequence_confidence, topk_entropy
from calm_core.semantic import SemanticCalibration

AGREES = 0.5  # a sample says the same as an answer when half its new words do (word F1 of what the prompt did not say)


class TokenScorer:
    path: ClassVar[ScoringPath] = ScoringPath.TOKEN
    kind: ClassVar[AnswerKind] = AnswerKind.FREE_FORM
    description: ClassVar[str] = "token: the answer's calibrated token log-probs"
    streams: ClassVar[bool] = True

    def __init__(self, engine: EngineClient, tokenizer, post_hoc: PostHoc = PostHoc()):
        self.engine = engine
        self.tokenizer = tokenizer
        self.token_temperature = post_hoc.token_temperature

    async def score(self, job: ScoringJob) -> Scoring:
        return await self.read(job, await generate_choices(self.engine, job.request))

    async def read(self, job: ScoringJob, outs: list[EngineOutput]) -> Scoring:
        """The scoring of outputs already generated (the streamed path collects them from its deltas)."""
        if job.with_raw and self.engine.prompt_logprobs:
            raws = await asyncio.gather(*(self.raw_confidence(o, job.request, i) for i, o in enumerate(outs)))
        else:
            raws = [None] * len(outs)
        choices = [ScoredChoice(o.text, o.finish_reason, float(powered(sequence_confidence(o.token_logprobs), self.token_temperature)), raw,
                                topk_entropy(o.top_logprobs), len(o.token_ids), output=o) for o, raw in zip(outs, raws)]
        return Scoring(self.path, self.kind, choices, outs[0].prompt_tokens)

    async def raw_confidence(self, out: EngineOutput, request: EngineRequest, index: int = 0) -> float | None:
        """The token confidence of the same answer without the α head: the prompt log-probs of prompt + answer on the
        same weights (one prefill, no generation; prompt log-probs are taken before logits processors)."""
        if not out.token_ids:
            return None
        prompt_ids = list(request.prompt_token_ids) or self.tokenizer.encode(request.prompt, add_special_tokens=False)
        raw = await generate(self.engine, EngineRequest(
            request_id=f"{request.request_id}-raw{index}", prompt="", prompt_token_ids=tuple(prompt_ids + out.token_ids),
            max_tokens=1, prompt_logprobs=True, calibrated=False, adapter=request.adapter, free_form=request.free_form))
        lps = (raw.prompt_logprobs or [])[len(prompt_ids):]
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


class SemanticScorer:
    path: ClassVar[ScoringPath] = ScoringPath.SEMANTIC
    kind: ClassVar[AnswerKind] = AnswerKind.FREE_FORM
    description: ClassVar[str] = ("semantic: the token answer; its confidence from how many answers sampled without the "
                                  "head say the same")
    streams: ClassVar[bool] = False

    def __init__(self, engine: EngineClient, tokenizer=None, post_hoc: PostHoc = PostHoc()):
        self.engine = engine
        self.calibration = post_hoc.semantic or SemanticCalibration()

    async def score(self, job: ScoringJob) -> Scoring:
        """The answers are those token confidence would return for the same request (a confidence method never changes
        an answer). Beside them, `job.samples` answers are drawn in one engine call from the same weights without the
        α head, at the version's sampling temperature (seeded: `samples_seed`); each answer's confidence is the
        version's map of the share of samples that agree with it (`calm_core/answers.agreement` ≥ 1/2), its raw
        confidence that share unmapped."""
        cal = self.calibration
        sampled = raw_request(job.request, n=job.samples, temperature=cal.temperature,
                              max_tokens=min(job.request.max_tokens, cal.max_tokens), seed=samples_seed(job.request))
        outs, samples = await asyncio.gather(generate_choices(self.engine, job.request),
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
