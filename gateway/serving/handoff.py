"""Below the threshold of an escalate or review policy: the unsure choices are handed off before anything is sent.

- escalate: one call to the target for the unsure choices of a request (n = their count); the target's answers replace
  them, their calibration saying `escalated`, naming the target and keeping the first model's confidence. When the
  target fails, the policy's `on_failure` applies: `annotate` serves the first answer, `abstain` the message; either
  way the calibration says why (`escalation.fallback`).
- review: each unsure choice is queued for an operator (database, and the policy's webhook if it names one); the
  caller gets the policy's message and the review id.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace

from gateway.serving.context import RequestContext
from gateway.serving.escalation import Escalator, TargetFailed, call_headers, operator_target
from gateway.records.handoff_store import HandoffStore, Review
from gateway.observe.monitoring import Metrics
from gateway.policy.policies import Action, ReviewTarget
from gateway.protocol.openai import Escalation
from gateway.serving.wire import Answer, Served, no_positions

log = logging.getLogger("calm.gateway")


class Handoff:
    def __init__(self, store: HandoffStore, metrics: Metrics, escalator: Escalator | None = None):
        self.store, self.metrics = store, metrics
        self.escalator = escalator or Escalator()
        self._webhooks: set[asyncio.Task] = set()

    async def apply(self, served: Served, ctx: RequestContext) -> Served:
        unsure = [i for i, a in enumerate(served.answers) if ctx.policy.below(a.calibration.confidence)]
        if unsure and ctx.policy.action is Action.ESCALATE:
            await self._escalate(served, unsure, ctx)
        elif unsure and ctx.policy.action is Action.REVIEW:
            await self._review(served, unsure, ctx)
        return served

    def withhold(self, served: Served, ctx: RequestContext) -> Served:
        """A request a peer gateway escalated here is never handed off again: an answer its policy would hand off is
        withheld instead (the policy's message), never returned."""
        if ctx.policy.action not in (Action.ESCALATE, Action.REVIEW):
            return served
        for i, answer in enumerate(served.answers):
            if ctx.policy.below(answer.calibration.confidence):
                self.metrics.abstentions.labels(ctx.domain).inc()
                served.answers[i] = replace(answer, text=ctx.policy.message, positions=no_positions,
                                            calibration=answer.calibration.model_copy(update=dict(abstained=True)))
        return served

    # -- escalate -----------------------------------------------------------------------------------------------------
    async def _escalate(self, served: Served, unsure: list[int], ctx: RequestContext) -> None:
        target, domain, started = ctx.policy.escalate, ctx.domain, time.perf_counter()
        try:
            replies = await self.escalator.ask(target, ctx.request, len(unsure), ctx.prompt.option_letters)
        except TargetFailed as failure:
            self._fall_back(served, unsure, ctx, failure, time.perf_counter() - started)
            return
        seconds = time.perf_counter() - started
        self.metrics.escalation_latency.labels(domain).observe(seconds)
        self.metrics.escalations.labels(domain, "escalated").inc(len(unsure))
        rows = []
        for i, theirs in zip(unsure, replies):
            first = served.answers[i].calibration
            info = Escalation(target_model=target.model, confidence=theirs.confidence,
                              target_abstained=theirs.abstained, latency_ms=seconds * 1000)
            served.answers[i] = Answer(theirs.text, theirs.finish_reason,
                                       first.model_copy(update=dict(escalated=True, escalation=info)),
                                       theirs.completion_tokens, lambda p=theirs.positions: p)
            rows.append((served.key(i), domain, first.confidence, target.model, theirs.confidence, ctx.caller.key_id))
        await asyncio.to_thread(self.store.record_escalations, rows)

    def _fall_back(self, served: Served, unsure: list[int], ctx: RequestContext, failure: TargetFailed,
                   seconds: float) -> None:
        target, domain = ctx.policy.escalate, ctx.domain
        withhold = target.on_failure == "abstain"
        log.warning("escalation to %s failed for domain %s (%s): %s", target.model, domain, failure.reason,
                    failure.detail)
        self.metrics.escalation_latency.labels(domain).observe(seconds)
        self.metrics.escalation_errors.labels(domain, failure.reason).inc()
        self.metrics.escalations.labels(domain, f"fallback_{target.on_failure}").inc(len(unsure))
        if withhold:
            self.metrics.abstentions.labels(domain).inc(len(unsure))
        why = f"{failure.reason}: {failure.public}; " + ("answer withheld" if withhold else "the first answer stands")
        for i in unsure:
            answer = served.answers[i]
            info = Escalation(target_model=target.model, latency_ms=seconds * 1000, fallback=why)
            calibration = answer.calibration.model_copy(update=dict(escalation=info, abstained=withhold))
            served.answers[i] = (replace(answer, text=ctx.policy.message, calibration=calibration,
                                         positions=no_positions) if withhold
                                 else replace(answer, calibration=calibration))

    # -- review -------------------------------------------------------------------------------------------------------
    async def _review(self, served: Served, unsure: list[int], ctx: RequestContext) -> None:
        request = ctx.request.model_dump(mode="json", include={"messages", "prompt", "options"}, exclude_none=True)
        now, reviews = time.time(), []
        for i in unsure:
            answer = served.answers[i]
            review = Review(f"rev-{uuid.uuid4().hex[:24]}", ctx.domain, served.key(i), request,
                            answer.text, answer.calibration.confidence, now)
            reviews.append(review)
            served.answers[i] = replace(answer, text=ctx.policy.message, positions=no_positions,
                                        calibration=answer.calibration.model_copy(
                                            update=dict(abstained=True, review_id=review.id)))
        await asyncio.to_thread(self.store.open_reviews, reviews)  # stored before the caller hears of them
        self.metrics.reviews.labels(ctx.domain, "opened").inc(len(reviews))
        hook = ctx.policy.review
        if hook is not None and (hook.webhook or hook.legacy_url):
            for review in reviews:  # the caller does not wait for the operator's webhook
                task = asyncio.get_running_loop().create_task(self._notify(hook, review))
                self._webhooks.add(task)
                task.add_done_callback(self._webhooks.discard)

    async def _notify(self, hook: ReviewTarget, review: Review) -> None:
        body = {"review_id": review.id, "domain": review.domain, "response_id": review.response_id,
                "request": review.request, "answer": review.answer, "answer_option": review.answer_option,
                "confidence": review.confidence,
                "created_at": review.created_at}
        try:
            target = operator_target(self.escalator.targets, hook.webhook, hook.legacy_url, kind="webhook")
            response = await self.escalator.post(target, target.url, hook.timeout_s, json=body,
                                                 headers=call_headers(target))
            response.raise_for_status()
        except Exception as e:  # any failure: the review is in the database queue all the same
            self.metrics.review_webhook_errors.labels(review.domain).inc()
            log.warning("review webhook for %s failed: %s", review.id, e)

    async def close(self) -> None:
        for task in list(self._webhooks):
            task.cancel()
        await self.escalator.close()
