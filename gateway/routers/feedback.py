"""Feedback on served answers: a verdict per choice, stored durably, feeding online calibration and guarantees."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from gateway.errors import APIError
from gateway.keys import ClientKey
from gateway.pipeline import response_key
from gateway.protocol.feedback import FeedbackRequest, FeedbackResponse
from gateway.routers.deps import client, documented, state
from gateway.state import GatewayState

router = APIRouter()


@router.post("/v1/feedback", responses=documented(400, 401, 403, 404, 409, 429))
async def feedback(req: FeedbackRequest, client_key: ClientKey | None = Depends(client),
                   gateway: GatewayState = Depends(state)) -> FeedbackResponse:
    store = gateway.store
    key = response_key(req.response_id, req.choice_index)
    found = await asyncio.to_thread(store.get_response, key)  # database work stays off the event loop
    if found is None:
        what = f"choice {req.choice_index} of " if req.choice_index else ""
        whole = req.choice_index and await asyncio.to_thread(store.get_response, req.response_id)
        raise APIError(404, f"no {what}response with id {req.response_id!r}", "not_found_error",
                       "choice_index" if whole else "response_id")
    domain, _ = found
    gateway.keyring.admit(client_key, domain)

    def record() -> bool | None:  # stored durably before the answer: an acknowledged verdict is never lost
        stored = store.add_feedback(key, req.correct)
        if stored:
            confidences, outcomes = store.recent_feedback(domain, gateway.settings.feedback_window)
            gateway.monitor.observe_feedback(domain, req.correct, confidences, outcomes)
            gateway.shared.guarantees.on_feedback(domain)
        return stored

    stored = await asyncio.to_thread(record)
    if stored is None:
        raise APIError(409, f"response {req.response_id!r} already has different feedback", "conflict_error", "correct")
    return FeedbackResponse(response_id=req.response_id, correct=req.correct, recorded=stored, domain=domain)
