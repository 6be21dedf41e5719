"""OpenAI-compatible request and response models: chat, completions, models (pydantic only, no logic).

Extras live where OpenAI clients tolerate them: request fields passed as `extra_body` (`options`, `calm`), the
standard `metadata` map, and a `calibration` object on each choice that clients ignore.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import (
    BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictStr, StringConstraints, field_validator,
    model_validator,
)

from calm_core.artifact import VERSION_NAME
from calm_core.data import MAX_OPTIONS, MIN_OPTIONS
from gateway.protocol.common import NONBLANK, NonBlankStr, StrictInt, blank

MAX_CHOICES = 16  # n; each choice is a full generation
MAX_PROMPTS = 64  # completions: prompts in one request (each answered as its own request would be)
MAX_TOP_LOGPROBS = 20  # the engines' max_logprobs
MAX_STOP = 4
MAX_SAMPLES = 32  # semantic confidence: answers sampled in one engine call


class OpenAIModel(BaseModel):
    # Every parameter the gateway honours is declared; anything else is refused with a 400 that names it (nothing is
    # silently ignored). gateway/errors.py words the refusal, with the reason for parameters refused by design.
    model_config = ConfigDict(extra="forbid")


class CalmOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threshold: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)  # stricter than the policy's, never looser
    domain: StrictStr | None = None
    # Also the raw model's number (semantic: the unmapped agreeing share); default: CALM_RAW_CONFIDENCE for multiple
    # choice (on), CALM_FREE_FORM_RAW_CONFIDENCE for free form (off).
    raw_confidence: StrictBool | None = None
    confidence: Literal["token", "semantic"] | None = None  # free form; default: the domain's policy, else token
    samples: StrictInt | None = Field(default=None, ge=2, le=MAX_SAMPLES)  # semantic: answers sampled per request
    # Served by this artifact version instead of the domain's (one this gateway serves: canaries, reproducing an answer);
    # a name, never a path.
    version: StrictStr | None = Field(default=None, pattern=VERSION_NAME)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None  # accepted as OpenAI does; the chat template has no place for it

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False  # a last chunk with the usage and no choices


class JsonSchemaFormat(OpenAIModel):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"if": {"properties": {"type": {"const": "json_schema"}}},
                                                                 "then": {"required": ["json_schema"], "properties": {
                                                                     "json_schema": {"type": "object", "required": ["schema"],
                                                                                     "properties": {"schema": {"type": "object"}}}}}})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
        return self


# Fields the chat, completions and Responses requests share.
Temperature = Annotated[StrictFloat | None, Field(ge=0.0, le=2.0)]  # omitted: greedy (the gateway's default)
TopP = Annotated[StrictFloat | None, Field(gt=0.0, le=1.0)]
Options = Annotated[list[NonBlankStr] | None, Field(min_length=MIN_OPTIONS, max_length=MAX_OPTIONS)]  # multiple choice


class SamplingFields(OpenAIModel):
    model: StrictStr
    temperature: Temperature = None
    top_p: TopP = None
    top_k: StrictInt | None = Field(default=None, ge=-1)  # vLLM: 0 or -1 = off
    min_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | None = Field(default=None, gt=0.0, le=2.0)
    logit_bias: dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")], Annotated[StrictFloat, Field(ge=-100, le=100)]] | None = Field(
        default=None, json_schema_extra={"propertyNames": {"pattern": r"^[0-9]{1,9}$"}})
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP)] | None = None
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    response_format: ResponseFormat | None = None
    user: StrictStr | None = None  # an end-user id, as OpenAI takes it; not used for the answer
    metadata: dict[StrictStr, StrictStr] | None = None
    options: Options = None
    calm: CalmOptions | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def shaping_parameters(self) -> list[str]:
        """Parameters that shape token sampling, set to something other than "off" (multiple choice refuses them)."""
        off = dict(top_p=(None, 1.0), top_k=(None, 0, -1), min_p=(None, 0.0), presence_penalty=(None, 0.0),
                   frequency_penalty=(None, 0.0), repetition_penalty=(None, 1.0), logit_bias=(None, {}))
        named = [name for name, values in off.items() if getattr(self, name) not in values]
        if self.response_format is not None and self.response_format.type != "text":
            named.append("response_format")
        return named


OFF = lambda *values: {"anyOf": [{"type": "null"}, *({"const": v} for v in values)]}  # noqa: E731
# The request-level rules the schema can state: stream_options needs stream; options (multiple choice) take no
# token-sampling parameter but their "off" values (temperature and seed apply: the option is drawn).
REQUEST_RULES = [
    # Several free-form answers are sampled: n > 1 needs a temperature (omitted, the gateway answers greedily).
    {"if": {"required": ["n"], "properties": {"n": {"type": "integer", "minimum": 2}},
            "not": {"required": ["options"], "properties": {"options": {"type": "array"}}}},
     "then": {"required": ["temperature"], "properties": {"temperature": {"type": "number", "exclusiveMinimum": 0}}}},
    {"if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
     "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}},
    {"if": {"required": ["options"], "properties": {"options": {"type": "array"}}},
     "then": {"properties": {
         "top_p": OFF(1.0), "top_k": OFF(0, -1), "min_p": OFF(0.0), "presence_penalty": OFF(0.0),
         "frequency_penalty": OFF(0.0), "repetition_penalty": OFF(1.0),
         "logit_bias": {"anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}]},
         "response_format": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}}}},
]

USER_TEXT = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"const": "user"},
    "content": {"anyOf": [{"type": "string", "pattern": NONBLANK},
                          {"type": "array", "contains": {"type": "object", "required": ["type", "text"],
                                                         "properties": {"text": {"type": "string", "pattern": NONBLANK}}}}]}}}


class ChatCompletionRequest(SamplingFields):
    # Cross-field rules, also in the schema: top_logprobs > 0 needs logprobs; stream_options needs stream.
    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        *REQUEST_RULES,
    ]})

    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra={"contains": USER_TEXT})
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("messages")
    @classmethod
    def _has_user_text(cls, messages):
        if not any(m.role == "user" and not blank(m.text()) for m in messages):
            raise ValueError("must contain at least one non-empty user message")
        return messages

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def question_text(self) -> str:
        """The question asked: the last user message (what traffic capture keeps)."""
        return next(m.text() for m in reversed(self.messages) if m.role == "user" and not blank(m.text()))


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": REQUEST_RULES})

    prompt: NonBlankStr | Annotated[list[NonBlankStr], Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: StrictInt = Field(default=16, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _nonblank_prompts(cls, prompt):
        if any(blank(p) for p in ([prompt] if isinstance(prompt, str) else prompt)):
            raise ValueError("prompt must not be empty")
        return prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt

    def prompts(self) -> list[str]:
        """Each prompt of the request (a list asks for each one's answers in one response, as vLLM's server does)."""
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def question_text(self) -> str:
        return self.prompts()[0]


class OptionProbability(BaseModel):
    label: str
    probability: float


class ClusterOut(BaseModel):
    answer: str  # the sample the others in the cluster were compared with (its first)
    size: int


class Escalation(BaseModel):
    """Where an unsure answer went under an escalate policy, and what came back."""

    target_model: str
    confidence: float | None = None  # the served answer's confidence, when the target is a CALM gateway
    target_abstained: bool | None = None  # a CALM target withheld its answer under its own policy
    latency_ms: float
    fallback: str | None = None  # the target failed: why, and the first answer stands (annotate) or is withheld


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
    policy_state: str | None = None  # guaranteed-risk policies: "guaranteed (n labels)" or the fallback in force
    method: Literal["token", "semantic"] | None = None  # free form: which confidence estimator
    clusters: list[ClusterOut] | None = None  # semantic: the samples grouped by agreement, largest first
    # Escalate policies: the answer is the target's; `confidence` and `artifact_version` stay the first model's.
    escalated: bool = False
    escalation: Escalation | None = None
    review_id: str | None = None  # review policies: the queued review of the withheld answer


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    """OpenAI's chat shape: one entry per generated token (multiple choice: one, the option letter)."""

    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape."""

    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
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
    logprobs: CompletionLogprobs | None = None
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
