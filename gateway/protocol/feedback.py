"""Feedback on a served answer: the request and what was recorded (pydantic only)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from gateway.protocol.common import StrictInt
from gateway.protocol.openai import MAX_CHOICES, MAX_PROMPTS


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    response_id: StrictStr = Field(min_length=1)
    correct: StrictBool
    # Which choice of a response with several (n > 1, or several prompts: prompt i's answer j is choice i * n + j).
    choice_index: StrictInt = Field(default=0, ge=0, lt=MAX_CHOICES * MAX_PROMPTS)


class FeedbackResponse(BaseModel):
    response_id: str
    correct: bool
    recorded: bool  # False when the same feedback had been recorded before (idempotent repeat)
    domain: str
    escalated: bool = False  # the verdict judged an escalation target's answer (kept apart from the domain's labels)
