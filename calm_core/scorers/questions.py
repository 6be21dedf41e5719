"""Offline evaluation through the scorers: labelled multiple-choice questions scored exactly as the gateway serves an
explicit-options chat request (the prompt of `calm_core.prompts.options_prompt`, greedy, calibrated, the artifact's
adapter), on whatever engine the caller injects."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from calm_core.data import MCQuestion
from calm_core.engine import EngineClient, EngineRequest
from calm_core.prompts import options_prompt
from calm_core.scorers.base import PostHoc, ScoredChoice, ScoringJob
from calm_core.prompts import AnswerFormat
from calm_core.scorers.registry import Scorers


async def score_options(engine: EngineClient, tokenizer, questions: list[MCQuestion], answer_format: AnswerFormat | str,
                        adapter: bool = True, progress: Callable[[int], None] | None = None,
                        post_hoc: PostHoc = PostHoc()) -> list[ScoredChoice]:
    """Each question's greedy calibrated choice (its options' distribution), in the questions' order."""
    scorers = Scorers(engine, tokenizer, answer_format, post_hoc)
    fmt = scorers.answer_format.value

    async def one(i: int, q: MCQuestion) -> ScoredChoice:
        prompt = options_prompt(tokenizer, q.question, q.choices, fmt)
        request = EngineRequest(request_id=f"q{i}", prompt=prompt.text, max_tokens=1, adapter=adapter)
        scored = (await scorers.for_prompt(prompt).score(ScoringJob(prompt, request))).choices[0]
        if progress is not None:
            progress(1)
        return scored

    return list(await asyncio.gather(*(one(i, q) for i, q in enumerate(questions))))


def option_matrix(choices: list[ScoredChoice]) -> np.ndarray:
    """(N, max options) the options' probabilities per question, padding columns 0."""
    width = max(len(c.option_probs) for c in choices)
    probs = np.zeros((len(choices), width), dtype=np.float64)
    for row, choice in enumerate(choices):
        probs[row, : len(choice.option_probs)] = choice.option_probs
    return probs
