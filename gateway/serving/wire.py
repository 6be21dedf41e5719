"""How served answers look on the wire: OpenAI chat and completion responses, and their SSE chunks."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from calm_core.served_answers import ServedAnswer
from gateway.serving.logprobs import Position, chat_logprobs, completion_logprobs
from gateway.protocol.openai import (
    Calibration, ChatChoice, ChatCompletionResponse, ChatMessageOut, CompletionChoice, CompletionResponse, UsageInfo,
)


def response_key(response_id: str, choice_index: int) -> str:
    """The stored id of one choice (feedback names a response and, for n > 1, a choice)."""
    return response_id if choice_index == 0 else f"{response_id}#{choice_index}"


def no_positions() -> list:
    """The positions of a withheld answer: none (no log-probs of the text it replaces)."""
    return []


@dataclass
class Answer:
    """One choice of a response, whatever its wire format."""

    text: str
    finish_reason: str | None
    calibration: Calibration
    completion_tokens: int
    # The answer's log-prob positions, built only when a client asks for log-probs (decoding every alternative of
    # every token would otherwise cost each response).
    positions: Callable[[], list[Position]]
    served: ServedAnswer | None = None  # what the confidence was made of, stored for recalibration


@dataclass
class Served:
    """A whole response: its id, one answer per choice, and the prompt's token count."""

    response_id: str
    answers: list[Answer]
    prompt_tokens: int
    first_index: int = 0  # the first answer's choice index (a response to several prompts numbers them on)

    def key(self, i: int) -> str:
        """The stored id of answer i."""
        return response_key(self.response_id, self.first_index + i)

    def usage(self) -> UsageInfo:
        completion = sum(a.completion_tokens for a in self.answers)
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                         total_tokens=self.prompt_tokens + completion)


@dataclass
class WireView:
    """How answers look on the wire for one request: chat or completions, log-probs asked (top-k count, or None for
    none), and the echoed prompt (completions)."""

    chat: bool
    model: str
    logprobs: int | None
    echo: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    _offsets: dict[int, int] = field(default_factory=dict)  # streamed completions: text offset per choice so far

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def response(self, served: Served) -> ChatCompletionResponse | CompletionResponse:
        if self.chat:
            return ChatCompletionResponse(
                id=served.response_id, model=self.model, usage=served.usage(),
                choices=[ChatChoice(index=served.first_index + i, message=ChatMessageOut(content=a.text), finish_reason=a.finish_reason,
                                    logprobs=self.chat_logprobs(a.positions), calibration=a.calibration)
                         for i, a in enumerate(served.answers)])
        return CompletionResponse(
            id=served.response_id, model=self.model, usage=served.usage(),
            choices=[CompletionChoice(index=served.first_index + i, text=self.echo + a.text, finish_reason=a.finish_reason,
                                      logprobs=self.completion_logprobs(a.positions), calibration=a.calibration)
                     for i, a in enumerate(served.answers)])

    def chunk(self, response_id: str, choices: list[dict], usage: UsageInfo | None = None) -> str:
        body = {"id": response_id, "object": self.chunk_object, "created": self.created, "model": self.model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage.model_dump()
        return f"data: {json.dumps(body)}\n\n"

    def chat_logprobs(self, positions: Callable[[], list[Position]]):
        return chat_logprobs(positions(), self.logprobs) if self.logprobs is not None else None

    def completion_logprobs(self, positions: Callable[[], list[Position]], text_offset: int = 0):
        return completion_logprobs(positions(), self.logprobs, text_offset) if self.logprobs is not None else None

    def role_delta(self, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, index: int, text: str, positions: Callable[[], list[Position]], first: bool) -> dict:
        if self.chat:
            lp = self.chat_logprobs(positions)
            return {"index": index, "delta": {"content": text} if text else {},
                    "logprobs": lp.model_dump() if lp is not None else None, "finish_reason": None}
        lp = None
        if self.logprobs is not None:
            built = positions()
            lp = completion_logprobs(built, self.logprobs, self._offsets.get(index, 0))
            self._offsets[index] = self._offsets.get(index, 0) + sum(len(p.token) for p in built)
        return {"index": index, "text": (self.echo if first else "") + text,
                "logprobs": lp.model_dump() if lp is not None else None, "finish_reason": None}

    def finish(self, index: int, answer: Answer) -> dict:
        body = {"index": index, "finish_reason": answer.finish_reason, "logprobs": None,
                "calibration": answer.calibration.model_dump()}
        if self.chat:
            body["delta"] = {}
        else:
            body["text"] = ""
        return body


def calibration_headers(calibration: Calibration | None, domain: str, artifact_version: str) -> dict[str, str]:
    """The calibration as response headers, for clients that cannot read extra body fields or sit behind a proxy that
    rebuilds the body: the first choice's (n > 1: read the body for the others). A stream's headers leave before its
    answer exists, so they carry the domain and version only."""
    headers = {"X-Calm-Domain": domain, "X-Calm-Artifact-Version": artifact_version}
    if calibration is not None:
        headers["X-Calm-Confidence"] = repr(calibration.confidence)
        headers["X-Calm-Abstained"] = "true" if calibration.abstained else "false"
    return headers
