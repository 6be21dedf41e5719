"""Multiple-choice scorers: the options' calibrated distribution, one chosen option per requested choice.

- letter: one request per question, the answer letters' calibrated log-probs at the first position;
- cloze per token: one greedy one-token request per option token, teacher-forced on the option's earlier tokens
  (the logits processor applies the α head, so every engine can serve it);
- cloze one pass: one request per option, the prompt log-probs of its tokens on weights with the α head folded in
  (engines with `folded_scoring`).
The rules (softmax over options, cloze means) are calm_core/scoring.py's.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import ClassVar

import numpy as np

from calm_core.engine import (
    EngineClient, EngineOutput, EngineRequest, EngineUnavailable, generate, generate_choices, prepaid,
)
from calm_core.prompts import LETTERS, ClozeTokens, letter_token_ids
from calm_core.scorers.base import (
    AnswerKind, PostHoc, ScoredChoice, Scoring, ScoringJob, ScoringPath, WholeAnswer, raw_request,
)
from calm_core.scoring import OptionDistribution, cloze_scores, option_distribution, options_softmax


def option_choice(dist: OptionDistribution, raw_probs: np.ndarray | None, letters, completion_tokens: int) -> ScoredChoice:
    raw = float(raw_probs[dist.chosen]) if raw_probs is not None else None
    return ScoredChoice(letters[dist.chosen], "stop", dist.confidence, raw, dist.entropy, completion_tokens,
                        option_probs=tuple(float(p) for p in dist.probs), chosen=dist.chosen)


def sample_options(scores: np.ndarray, request: EngineRequest) -> list[int | None]:
    """Greedy requests take the most probable option (None) every time; others sample n options from
    softmax(scores / temperature)."""
    if request.temperature <= 0:
        return [None] * request.n
    p = options_softmax(scores / request.temperature).probs
    return [int(i) for i in np.random.default_rng(request.seed).choice(len(p), size=request.n, p=p)]


class LetterScorer(WholeAnswer):
    path: ClassVar[ScoringPath] = ScoringPath.LETTER
    kind: ClassVar[AnswerKind] = AnswerKind.MULTIPLE_CHOICE
    description: ClassVar[str] = "letter: one request per question, α head in the logits processor"

    def __init__(self, engine: EngineClient, tokenizer, post_hoc: PostHoc = PostHoc()):
        self.engine = engine
        self.letter_ids = dict(zip(LETTERS, letter_token_ids(tokenizer)))
        self.temperature = post_hoc.option_temperature

    def plan(self, job: ScoringJob) -> EngineRequest:
        ids = tuple(self.letter_ids[letter] for letter in job.prompt.option_letters)
        return replace(job.request, max_tokens=1, option_token_ids=ids)

    async def score(self, job: ScoringJob) -> Scoring:
        request = self.plan(job)
        ids = list(request.option_token_ids)
        asked = [request] + ([raw_request(request, n=1)] if job.with_raw else [])
        with prepaid(asked):
            outs, *raw = await asyncio.gather(*(generate_choices(self.engine, r) for r in asked))
        raw_probs = option_distribution(first_logprobs(raw[0][0]), ids).probs if raw and raw[0][0].top_logprobs else None
        # A recalibrated version's temperature applies to the reported distribution; a sampled letter was drawn in the
        # engine from the head's (greedy answers, the default, are the same under any temperature).
        dists = [option_distribution(first_logprobs(out), ids, out.token_ids[0] if out.token_ids else None,
                                     self.temperature) for out in outs]
        letters = job.prompt.option_letters
        choices = [option_choice(d, raw_probs, letters, len(o.token_ids)) for d, o in zip(dists, outs)]
        return Scoring(self.path, self.kind, choices, outs[0].prompt_tokens)


def first_logprobs(out: EngineOutput) -> dict[int, float]:
    return out.top_logprobs[0] if out.top_logprobs else {}


class _ClozeScorer(WholeAnswer):
    """What both cloze scorers share: a distribution from the options' scores, sampled n times where asked."""

    kind: ClassVar[AnswerKind] = AnswerKind.MULTIPLE_CHOICE
    path: ClassVar[ScoringPath]

    def __init__(self, engine: EngineClient, tokenizer=None, post_hoc: PostHoc = PostHoc()):
        self.engine = engine
        self.temperature = post_hoc.option_temperature

    async def option_scores(self, tokens: ClozeTokens, request: EngineRequest, calibrated: bool) -> np.ndarray:
        raise NotImplementedError

    async def score(self, job: ScoringJob) -> Scoring:
        tokens = job.prompt.cloze
        runs = [self.option_scores(tokens, job.request, calibrated=True)]
        if job.with_raw:
            runs.append(self.option_scores(tokens, replace(job.request, request_id=job.request.request_id + "-raw"),
                                           calibrated=False))
        scores = await asyncio.gather(*runs)
        raw_probs = options_softmax(scores[1]).probs if job.with_raw else None
        letters = job.prompt.option_letters
        calibrated = scores[0] / self.temperature  # the version's post-hoc temperature (1 unless recalibrated)
        choices = [option_choice(options_softmax(calibrated, chosen), raw_probs, letters, 0)
                   for chosen in sample_options(calibrated, job.request)]
        return Scoring(self.path, self.kind, choices, len(tokens.prompt) + sum(map(len, tokens.options)))


class ClozePerTokenScorer(_ClozeScorer):
    path: ClassVar[ScoringPath] = ScoringPath.CLOZE_PER_TOKEN
    description: ClassVar[str] = "cloze per-token: one request per option token, α head in the logits processor"

    async def option_scores(self, tokens: ClozeTokens, request: EngineRequest, calibrated: bool) -> np.ndarray:
        """Each option token's log-prob from a greedy one-token request teacher-forced on the option's earlier tokens.
        Not restricted to the option tokens, so the log-prob is the engine's full-vocabulary softmax of d ⊙ z + l
        (prompt log-probs would skip the α head inside vLLM)."""
        jobs, owner = [], []
        for k, option in enumerate(tokens.options):
            for j, token in enumerate(option):
                jobs.append(replace(request, request_id=f"{request.request_id}-{k}-{j}", prompt="",
                                    prompt_token_ids=tokens.prompt + option[:j], max_tokens=1, temperature=0.0,
                                    top_p=1.0, seed=None, n=1, option_token_ids=(token,), restrict_to_options=False,
                                    calibrated=calibrated))
                owner.append((k, token))
        with prepaid(jobs):
            outs = await asyncio.gather(*(generate(self.engine, job) for job in jobs))
        per_option: list[list[float]] = [[] for _ in tokens.options]
        for (k, token), out in zip(owner, outs):
            if not out.top_logprobs or token not in out.top_logprobs[0]:
                raise EngineUnavailable("the engine returned no log-prob for an option token")
            per_option[k].append(out.top_logprobs[0][token])
        return cloze_scores(per_option)


class ClozeOnePassScorer(_ClozeScorer):
    path: ClassVar[ScoringPath] = ScoringPath.CLOZE_ONE_PASS
    description: ClassVar[str] = ("cloze one-pass: one request per option, prompt log-probs of weights with the α head "
                                  "folded in")

    async def option_scores(self, tokens: ClozeTokens, request: EngineRequest, calibrated: bool) -> np.ndarray:
        """The prompt log-probs of each option's tokens after the question. Prompt log-probs skip logits processors, so
        the calibrated run reads the weights that carry the α head (`folded`) and the raw run the unfolded weights,
        the processor switched off in both.

        On an engine with `prefix_reuse`, the first option is read alone and fills vLLM's prefix cache; the others then
        read the question's full cache blocks instead of recomputing them, and only their tails get prompt log-probs.
        An option whose own tokens came out of the cache (an earlier prompt shared them up to a block boundary) is
        asked again without the cache."""
        n_prompt = len(tokens.prompt)

        def job(k: int, option: tuple[int, ...], reuse: bool) -> EngineRequest:
            return replace(request, request_id=f"{request.request_id}-{k}{'' if reuse or k == 0 else '-whole'}",
                           prompt="", prompt_token_ids=tokens.prompt + option, max_tokens=1, temperature=0.0, top_p=1.0,
                           seed=None, n=1, option_token_ids=(), top_logprobs=0, prompt_logprobs=True,
                           folded=calibrated, calibrated=False, reuse_prefix=reuse, prompt_logprobs_from=n_prompt)

        def option_logprobs(option: tuple[int, ...], out: EngineOutput) -> list[float]:
            return (out.prompt_logprobs or [])[n_prompt : n_prompt + len(option)]

        def complete(option: tuple[int, ...], lps: list[float]) -> bool:
            return len(lps) == len(option) and all(math.isfinite(lp) for lp in lps)

        options = tokens.options
        # Worth it once the question fills a cache block; shorter ones would only wait for the first option.
        if getattr(self.engine, "prefix_reuse", False) and len(options) > 1 and n_prompt >= self.engine.prefix_block:
            first, rest = job(0, options[0], reuse=False), [job(k, o, reuse=True) for k, o in enumerate(options[1:], 1)]
            with prepaid([first, *rest]):
                outs = [await generate(self.engine, first),
                        *await asyncio.gather(*(generate(self.engine, r) for r in rest))]
        else:
            jobs = [job(k, o, reuse=False) for k, o in enumerate(options)]
            with prepaid(jobs):
                outs = await asyncio.gather(*(generate(self.engine, r) for r in jobs))
        per_option = []
        for k, (option, out) in enumerate(zip(options, outs)):
            lps = option_logprobs(option, out)
            if not complete(option, lps) and k > 0:
                lps = option_logprobs(option, await generate(self.engine, job(k, option, reuse=False)))
            if not complete(option, lps):
                raise EngineUnavailable("the engine returned no prompt log-probs for an option")
            per_option.append(lps)
        return cloze_scores(per_option)
