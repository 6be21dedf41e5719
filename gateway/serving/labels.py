"""Uploaded labelled questions scored as served answers, their verdicts stored as the domain's labels."""

from __future__ import annotations

import asyncio
import uuid

from calm_core.answers import ANSWER_TOKENS, is_correct
from calm_core.scorers.base import ScoringJob
from gateway.serving.service import CalibratedService
from gateway.serving.prompting import prepare_chat
from gateway.protocol.admin import LabelledOpenQuestion, LabelledQuestion
from gateway.protocol.openai import ChatCompletionRequest


async def score_labelled(service: CalibratedService, domain: str,
                         questions: list[LabelledQuestion | LabelledOpenQuestion], concurrency: int = 32) -> list[bool]:
    """Score labelled questions as served answers (greedy, calibrated, no raw pass) and store each one's confidence
    and verdict as a label of the domain; neither metrics nor drift windows see them. Multiple choice: right when the
    chosen option is the answer; free form: when the greedy answer (at most ANSWER_TOKENS tokens, as `calm eval`
    judges it) matches an alias. 32 at a time: free-form answers in batches of 32 cost the engine 0.59x the CPU of
    batches of 8 (benchmarks/results/free_form_batching.md); live requests share those batches meanwhile."""
    if any(isinstance(q, LabelledOpenQuestion) for q in questions):  # before any is scored: none stored then
        service.planner.check_free_form_served("questions", "upload the domain's multiple-choice questions only")
    limit = asyncio.Semaphore(concurrency)
    store = service.shared.store

    async def one(q: LabelledQuestion | LabelledOpenQuestion) -> bool:
        open_ended = isinstance(q, LabelledOpenQuestion)
        req = ChatCompletionRequest(model=service.engine.model_name, options=None if open_ended else q.options,
                                    messages=[{"role": "user", "content": q.question}])
        prompt = prepare_chat(service.tokenizer, req, service.artifact.answer_format)
        job = ScoringJob(prompt, service.planner.template(req, prompt, ANSWER_TOKENS if open_ended else 1, 0))
        async with limit:
            choice = (await service.scorers.for_prompt(prompt).score(job)).choices[0]
        correct = is_correct(choice.text, q.answers, q.question) if open_ended else choice.chosen == q.answer
        response_id = f"label-{uuid.uuid4().hex}"

        def store_label() -> None:  # off the event loop, like every other write
            store.record_response(response_id, domain, choice.confidence)
            store.add_feedback(response_id, correct)

        await asyncio.to_thread(store_label)
        return correct

    verdicts = await asyncio.gather(*(one(q) for q in questions))
    service.shared.guarantees.refit_domain(domain)
    return list(verdicts)
