"""Admin API models: labelled questions, abstention policies, client API keys, the review queue (pydantic only)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictStr, StringConstraints, model_validator

from calm_core.data import MAX_OPTIONS, MIN_OPTIONS
from calm_core.domains import DOMAIN_NAME
from gateway.protocol.common import StrictInt


class LabelledQuestion(BaseModel):
    # `answer` indexes `options`: the schema says so per option count (JSON Schema cannot compare a number with a length).
    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [
        {"if": {"properties": {"options": {"maxItems": k}}}, "then": {"properties": {"answer": {"maximum": k - 1}}}}
        for k in range(MIN_OPTIONS, MAX_OPTIONS + 1)]})

    question: StrictStr = Field(min_length=1)
    options: list[StrictStr] = Field(min_length=MIN_OPTIONS, max_length=MAX_OPTIONS)
    answer: StrictInt = Field(ge=0)

    @model_validator(mode="after")
    def _answer_is_an_option(self):
        if self.answer >= len(self.options):
            raise ValueError(f"answer {self.answer} is not one of the {len(self.options)} options (0-based)")
        return self


class LabelledOpenQuestion(BaseModel):
    """A free-form question and its accepted answers (aliases): the served greedy answer is right when one of them
    matches it (calm_core/answers.py)."""

    model_config = ConfigDict(extra="forbid")

    question: StrictStr = Field(min_length=1)
    answers: list[Annotated[StrictStr, StringConstraints(min_length=1)]] = Field(min_length=1, max_length=64)


class LabelUpload(BaseModel):
    """Labelled questions of a domain, multiple choice or free form: the served artifact scores them, their verdicts
    become labels for guaranteed-risk policies, and they judge the domain's retraining candidates."""

    model_config = ConfigDict(extra="forbid")

    questions: list[LabelledQuestion | LabelledOpenQuestion] = Field(min_length=1, max_length=2000)


class LabelUploadResult(BaseModel):
    domain: str
    scored: int
    accuracy: float
    labels: int  # the domain's labelled answers now


class PolicyOut(BaseModel):
    domain: str
    version: int
    policy: dict
    effective_threshold: float
    state: str | None = None  # guaranteed-risk policies: guaranteed, or the fallback in force and why


class KeyCreate(BaseModel):
    """A client API key to create: who it is for, the domains it may use (all when omitted), its rate limit."""

    model_config = ConfigDict(extra="forbid")

    name: StrictStr = Field(min_length=1, max_length=128)
    domains: list[Annotated[str, StringConstraints(strict=True, pattern=DOMAIN_NAME)]] | None = Field(
        default=None, min_length=1)
    requests_per_minute: StrictFloat | None = Field(default=None, gt=0, le=1_000_000)
    # May give feedback on answers other keys received (a labelling team, a review tool); any other key only on the
    # answers it received itself.
    labeller: StrictBool = False
    # Engine sequences per minute over every replica sharing the database (options x option tokens, samples, n,
    # read-backs: what its requests cost the engines, not their count); unlimited when omitted.
    sequences_per_minute: StrictInt | None = Field(default=None, gt=0, le=100_000_000)


class KeyOut(BaseModel):
    id: str
    name: str
    domains: list[str] | None
    requests_per_minute: float | None
    created_at: float
    revoked_at: float | None = None
    labeller: bool = False
    sequences_per_minute: int | None = None


class KeyCreated(KeyOut):
    key: str  # shown once; only its hash is stored


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyOut]


class ReviewOut(BaseModel):
    id: str
    domain: str
    response_id: str  # the withheld answer's response (and choice) id
    request: dict  # the caller's messages or prompt, and options
    answer: str  # the first model's answer, withheld from the caller
    answer_option: str | None = None  # a multiple-choice answer's option text (the answer is its letter)
    confidence: float
    created_at: float
    status: Literal["open", "closed"]
    correct: bool | None = None
    reviewer: str | None = None
    note: str | None = None
    closed_at: float | None = None


class ReviewList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ReviewOut]


class ReviewVerdict(BaseModel):
    """An operator's verdict on the withheld answer: it closes the review and becomes that answer's feedback."""

    model_config = ConfigDict(extra="forbid")

    correct: bool = Field(strict=True)
    note: StrictStr | None = Field(default=None, max_length=2000)


class ReviewClosed(ReviewOut):
    recorded: bool  # False when the same verdict had been recorded before (idempotent repeat)
