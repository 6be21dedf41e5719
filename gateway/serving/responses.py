"""The Responses API on the chat path: a request is answered as the chat completion it describes (one answer, so one
calibration), and the answer is written as a response object, or streamed as the Responses API's events: created,
in progress, the message and its text part added, text deltas, text done, part and message done, then completed
(or incomplete, when `max_output_tokens` cut the answer) with the usage and the calibration."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

from msgspec.json import decode, encode
from pydantic import ValidationError

from gateway.errors import APIError
from gateway.serving.context import Caller, RequestContext
from gateway.serving.service import CalibratedService
from gateway.protocol.openai import Calibration, ChatCompletionResponse, UsageInfo
from gateway.protocol.responses import (
    IncompleteDetails, OutputMessage, OutputText, ResponseObject, ResponsesRequest, ResponseUsage,
)


# A chat request's fields as this request names them, for the errors the chat path raises.
NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def contexts(service: CalibratedService, req: ResponsesRequest, domain: str, caller: Caller) -> list[RequestContext]:
    """The chat completion the request describes, its errors named as this request names the fields."""
    try:
        chat = req.as_chat()
    except ValidationError as e:  # a chat rule the request breaks
        error = e.errors()[0]
        where = [str(p) for p in error["loc"]]
        param = ".".join([NAMES.get(where[0], where[0]), *where[1:]]) if where else None
        message = error["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param) from None
    try:
        return [service.prepare_chat(chat, domain, caller, id_prefix="resp_")]  # the id feedback names
    except APIError as e:  # a limit of the chat path (max_tokens, the context length)
        if e.param not in NAMES:
            raise
        raise APIError(e.status, e.message.replace(e.param, NAMES[e.param], 1), e.type, NAMES[e.param], e.code,
                       e.retry_after_s) from None


def response(req: ResponsesRequest, response_id: str, text: str | None, finish_reason: str | None,
             usage: UsageInfo | None, calibration: Calibration | None, logprobs: list[dict] = ()) -> ResponseObject:
    """The response object; without text, the one a stream starts with (in progress, no output yet)."""
    cut = finish_reason == "length"
    status = "in_progress" if text is None else ("incomplete" if cut else "completed")
    output = [] if text is None else [OutputMessage(id=message_id(response_id), status=status,
                                                    content=[OutputText(text=text, logprobs=list(logprobs))])]
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    return ResponseObject(
        id=response_id, status=status, model=req.model, output=output,
        usage=ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                            total_tokens=usage.total_tokens) if usage is not None else None,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
        temperature=req.temperature, top_p=req.top_p, text={"format": fmt or {"type": "text"}}, user=req.user,
        calibration=calibration)


def message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


def from_chat(body: ChatCompletionResponse, req: ResponsesRequest) -> ResponseObject:
    choice = body.choices[0]
    logprobs = [t.model_dump() for t in choice.logprobs.content or []] if choice.logprobs is not None else []
    return response(req, body.id, choice.message.content, choice.finish_reason, body.usage, choice.calibration,
                    logprobs)


async def events(chunks: AsyncIterator[str], req: ResponsesRequest, response_id: str) -> AsyncIterator[str]:
    """The chat stream's chunks as the Responses API's events (errors propagate, as the chat stream's do)."""
    numbers, item = itertools.count(), message_id(response_id)

    def event(kind: str, **fields) -> str:
        body = encode({"type": kind, "sequence_number": next(numbers), **fields}).decode()
        return f"event: {kind}\ndata: {body}\n\n"

    # The events that carry nothing of the answer leave together: one write each at the start and at the end.
    where = dict(item_id=item, output_index=0, content_index=0)
    started = response(req, response_id, None, None, None, None).model_dump()
    yield (event("response.created", response=started) + event("response.in_progress", response=started)
           + event("response.output_item.added", output_index=0,
                   item=OutputMessage(id=item, status="in_progress", content=[]).model_dump())
           + event("response.content_part.added", **where, part=OutputText(text="").model_dump()))
    text, finish, usage, calibration, logprobs = "", None, None, None, []
    async for piece in chunks:
        if not piece.startswith("data: {"):
            continue  # [DONE]
        chunk = decode(piece[6:])
        usage = UsageInfo(**chunk["usage"]) if chunk.get("usage") else usage
        for choice in chunk["choices"]:
            delta = (choice.get("delta") or {}).get("content") or ""
            tokens = (choice.get("logprobs") or {}).get("content") or []  # a token may decode to no text yet
            if delta or tokens:
                text, logprobs = text + delta, logprobs + tokens
                yield event("response.output_text.delta", **where, delta=delta, logprobs=tokens)
            if choice.get("calibration"):
                finish, calibration = choice["finish_reason"], Calibration(**choice["calibration"])
    done = response(req, response_id, text, finish, usage, calibration, logprobs).model_dump()
    message = done["output"][0]
    yield (event("response.output_text.done", **where, text=text, logprobs=logprobs)
           + event("response.content_part.done", **where, part=message["content"][0])
           + event("response.output_item.done", output_index=0, item=message)
           + event(f"response.{done['status']}", response=done))
