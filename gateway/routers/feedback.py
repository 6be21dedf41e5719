"""Feedback on served answers: a verdict per choice, stored durably, feeding online calibration and guarantees.
A verdict on an escalated answer judges the target's answer: it is kept with the escalation and counted apart, never
taken as a label of the first model. An answer withheld for review takes no feedback from the caller, who saw only the
policy's message: the reviewer's verdict is its label (gateway/records/handoff_store.py)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from gateway.errors import APIError
from gateway.records.client_keys import ClientKey
from gateway.serving.wire import response_key
from gateway.protocol.feedback import FeedbackRequest, FeedbackResponse
from gateway.routers.deps import client, documented, state
from gateway.state import GatewayState

router = APIRouter()


def may_judge(client_key: ClientKey | None, owner: str | None) -> None:
    """Feedback moves every caller's thresholds (guaranteed-risk fits, recalibration, the retraining gate), so it comes
    from the key that received the answer, or from a key granted the labeller role; an answer served without keys
    (development) takes it from anyone."""
    if owner is None or (client_key is not None and (client_key.id == owner or client_key.labeller)):
        return
    raise APIError(403, "feedback on this answer comes from the API key that received it, or from a labeller key",
                   "permission_error", "response_id", code="not_your_answer")


@router.post("/v1/feedback", responses=documented(400, 401, 403, 404, 409, 429))
async def feedback(req: FeedbackRequest, client_key: ClientKey | None = Depends(client),
                   gateway: GatewayState = Depends(state)) -> FeedbackResponse:
    store, escalations = gateway.store, gateway.shared.handoff.store
    key = response_key(req.response_id, req.choice_index)
    found = await asyncio.to_thread(store.get_response, key)  # database work stays off the event loop
    escalated = found is None
    domain, owner = (found[0], found[2]) if found else (await asyncio.to_thread(escalations.escalation_of, key)
                                                         or (None, None))
    if domain is None:
        what = f"choice {req.choice_index} of " if req.choice_index else ""
        whole = req.choice_index and await asyncio.to_thread(store.get_response, req.response_id)
        raise APIError(404, f"no {what}response with id {req.response_id!r}", "not_found_error",
                       "choice_index" if whole else "response_id")
    gateway.keyring.admit(client_key, domain)
    may_judge(client_key, owner)
    review_id = None if escalated else await asyncio.to_thread(escalations.review_of, key)
    if review_id is not None:
        raise APIError(409, f"this answer was withheld for review {review_id}: the caller was sent the policy's message, "
                       "not the model's answer, so the reviewer's verdict is its feedback", "conflict_error",
                       "response_id", code="withheld_for_review")
    # Stored durably before the answer, with the key that gave it: an acknowledged verdict is never lost.
    judge = client_key.id if client_key is not None else None
    if escalated:
        stored = await asyncio.to_thread(escalations.judge_escalation, key, req.correct, judge)
        if stored:
            gateway.metrics.escalated_feedback.labels(domain, str(req.correct).lower()).inc()
    else:
        stored = await asyncio.to_thread(gateway.shared.record_verdict, key, domain, req.correct, judge)
    if stored is None:
        raise APIError(409, f"response {req.response_id!r} already has different feedback", "conflict_error", "correct")
    return FeedbackResponse(response_id=req.response_id, correct=req.correct, recorded=stored, domain=domain,
                            escalated=escalated)
