"""OpenAI's Responses API (`POST /v1/responses`): the request and the response object (pydantic only).

A request is one answer to a conversation (`input`, with `instructions` as its system message); the gateway answers it
as the chat completion `as_chat()` describes, so every chat rule applies (modes, policies, limits), and writes the
answer as a response object with `calibration` beside `output`. Nothing is stored for retrieval (vLLM's server keeps
nothing either unless told): `previous_response_id` is refused, the conversation travels in `input`.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from gateway.protocol.common import NonBlankStr, StrictInt
from gateway.protocol.openai import (
    MAX_TOP_LOGPROBS, OFF, USER_TEXT, Calibration, CalmOptions, ChatCompletionRequest, OpenAIModel, Options, Temperature,
    TopP,
)


class TextIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text"]  # an earlier assistant turn comes back as output_text
    text: StrictStr


class InputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextIn]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class TextFormat(OpenAIModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["schema"], "properties": {"schema": {"type": "object"}}}})

    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = Field(default=None, min_length=1, max_length=64)
    description: StrictStr | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a text format of type 'json_schema' needs its schema")
        return self

    def response_format(self) -> dict:
        """The chat request's `response_format` for this format."""
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {"name": self.name or "schema", "schema": self.schema_,
                                                       "description": self.description, "strict": self.strict}}


class TextConfig(OpenAIModel):
    format: TextFormat | None = None


# The chat rules the schema can state, here too: multiple choice (`options`) takes no token-shaping parameter.
RESPONSES_RULES = [
    {"if": {"required": ["options"], "properties": {"options": {"type": "array"}}},
     "then": {"properties": {
         "top_p": OFF(1.0),
         "text": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"format": {"anyOf": [
             {"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}}}]}}}},
]


class ResponsesRequest(OpenAIModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": RESPONSES_RULES})

    model: StrictStr
    input: NonBlankStr | Annotated[list[InputMessage], Field(min_length=1, json_schema_extra={"contains": USER_TEXT})]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Temperature = None
    top_p: TopP = None
    text: TextConfig | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None  # the answer's token log-probs
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: StrictBool = False
    store: StrictBool | None = None  # accepted; nothing is kept for retrieval
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    # What clients send by default with nothing asked: accepted only as that (tools need a parser the engine lacks).
    tools: list[dict] = Field(default=[], max_length=0)
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: StrictBool | None = None
    truncation: Literal["disabled"] | None = None
    options: Options = None
    calm: CalmOptions | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion this request asks for (validated: a rule of chat is a rule here)."""
        turns = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else [
            {"role": m.role, "content": m.text()} for m in self.input]
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        chat = dict(model=self.model, messages=system + turns, max_tokens=self.max_output_tokens,
                    temperature=self.temperature, top_p=self.top_p, stream=self.stream, metadata=self.metadata,
                    user=self.user, options=self.options, calm=self.calm,
                    response_format=self.text.format.response_format() if self.text and self.text.format else None)
        if self.include:
            chat.update(logprobs=True, top_logprobs=self.top_logprobs)
        if self.stream:
            chat["stream_options"] = {"include_usage": True}  # the completed event carries the usage
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []
    logprobs: list = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputMessage]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    temperature: float | None = None
    top_p: float | None = None
    text: dict = {"format": {"type": "text"}}
    tools: list = []
    tool_choice: str = "auto"
    parallel_tool_calls: bool = False
    truncation: str = "disabled"
    store: bool = False  # nothing was kept for retrieval
    previous_response_id: None = None
    reasoning: None = None
    error: None = None
    user: str | None = None
    calibration: Calibration | None = None  # the answer's (on the completed event of a stream)
