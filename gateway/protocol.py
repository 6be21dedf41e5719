"""OpenAI-compatible request and response models (pydantic only, no logic).

Extras live where OpenAI clients tolerate them: request fields passed as `extra_body` (`options`, `calm`), the
standard `metadata` map, and a `calibration` object on each choice that clients ignore.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from calm_core.data import MAX_OPTIONS, MIN_OPTIONS


class OpenAIModel(BaseModel):
    # Unknown OpenAI parameters are accepted and ignored, as vLLM does; known ones are type-checked strictly.
    model_config = ConfigDict(extra="allow")


class CalmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threshold: float | None = Field(default=None, ge=0.0, le=1.0)  # stricter than the policy's, never looser
    domain: StrictStr | None = None
    raw_confidence: StrictBool | None = None  # multiple choice: also score with the raw model (one more engine row)


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class SamplingFields(OpenAIModel):
    model: StrictStr
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=1)  # one choice per request
    stream: StrictBool = False
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    options: list[StrictStr] | None = Field(default=None, min_length=MIN_OPTIONS, max_length=MAX_OPTIONS)
    calm: CalmOptions | None = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    @field_validator("messages")
    @classmethod
    def _has_user_text(cls, messages):
        if not any(m.role == "user" and m.text().strip() for m in messages):
            raise ValueError("messages must contain at least one non-empty user message")
        return messages


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr]
    max_tokens: StrictInt = Field(default=16, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt):
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError("exactly one prompt per request is supported")
            prompt = prompt[0]
        if not prompt.strip():
            raise ValueError("prompt must not be empty")
        return prompt


class OptionProbability(BaseModel):
    label: str
    probability: float


class Calibration(BaseModel):
    confidence: float
    raw_confidence: float | None
    abstained: bool
    threshold: float
    policy: str
    domain: str
    artifact_version: str
    mode: Literal["multiple_choice", "free_form"]
    entropy: float
    options: list[OptionProbability] | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: dict | None = None
    calibration: Calibration


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: dict | None = None
    calibration: Calibration


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "calm-gateway"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    response_id: StrictStr = Field(min_length=1)
    correct: StrictBool


class FeedbackResponse(BaseModel):
    response_id: str
    correct: bool
    recorded: bool  # False when the same feedback had been recorded before (idempotent repeat)
    domain: str


class PolicyOut(BaseModel):
    domain: str
    version: int
    policy: dict
    effective_threshold: float


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
