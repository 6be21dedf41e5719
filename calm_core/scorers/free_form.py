"""Free-form scorers: token confidence of the generated answer, and semantic confidence from sampled answers.

Token confidence is calm_core/scoring.py's `sequence_confidence` of the answer's calibrated token log-probs; its raw
counterpart reads the same answer's prompt log-probs on the same weights (one prefill, taken before logits
processors), so it needs an engine that returns prompt log-probs.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import ClassVar

from calm_core.answers import in_cluster, semantic_choice
from calm_core.engine import EngineClient, EngineOutput, EngineRequest, EngineUnavailable, generate, generate_choices
from calm_core.scorers.base import AnswerKind, ScoredChoice, Scoring, ScoringJob, ScoringPath, raw_request
from calm_core.scoring import sequence_confidence, topk_entropy


class TokenScorer:
    path: ClassVar[ScoringPath] = ScoringPath.TOKEN
    kind: ClassVar[AnswerKind] = AnswerKind.FREE_FORM
    description: ClassVar[str] = "token: the answer's calibrated token log-probs"
    streams: ClassVar[bool] = True

    def __init__(self, engine: EngineClient, tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer

    async def score(self, job: ScoringJob) -> Scoring:
        return await self.read(job, await generate_choices(self.engine, job.request))

    async def read(self, job: ScoringJob, outs: list[EngineOutput]) -> Scoring:
        """The scoring of outputs already generated (the streamed path collects them from its deltas)."""
        if job.with_raw and self.engine.prompt_logprobs:
            raws = await asyncio.gather(*(self.raw_confidence(o, job.request, i) for i, o in enumerate(outs)))
        else:
            raws = [None] * len(outs)
        choices = [ScoredChoice(o.text, o.finish_reason, sequence_confidence(o.token_logprobs), raw,
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


class SemanticScorer:
    path: ClassVar[ScoringPath] = ScoringPath.SEMANTIC
    kind: ClassVar[AnswerKind] = AnswerKind.FREE_FORM
    description: ClassVar[str] = "semantic: answers sampled in one engine call, grouped by meaning"
    streams: ClassVar[bool] = False

    def __init__(self, engine: EngineClient, tokenizer=None):
        self.engine = engine

    async def score(self, job: ScoringJob) -> Scoring:
        """n answers sampled in one engine call, grouped by meaning; the answer is the largest group's most probable
        member and its confidence the group's share. Raw: the share of that group among samples without the head."""
        sampled = replace(job.request, n=job.samples, temperature=job.request.temperature or 1.0)
        runs = [generate_choices(self.engine, sampled)]
        if job.with_raw:
            runs.append(generate_choices(self.engine, raw_request(sampled)))
        outs, *raw = await asyncio.gather(*runs)
        choice = semantic_choice([o.text for o in outs], [sequence_confidence(o.token_logprobs) for o in outs])
        top = choice.clusters[0]
        raw_conf = (sum(in_cluster(o.text, top) for o in raw[0]) / len(raw[0])) if raw else None
        clusters = [(outs[i].text, c.size) for i, c in zip(choice.best, choice.clusters)]
        out = outs[choice.answer]
        scored = ScoredChoice(out.text, out.finish_reason, choice.confidence, raw_conf, choice.entropy,
                              sum(len(o.token_ids) for o in outs), clusters=clusters, output=out)
        return Scoring(self.path, self.kind, [scored], outs[0].prompt_tokens)
