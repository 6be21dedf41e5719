"""An instant stand-in for a vLLM OpenAI server, to measure what a proxy in front of it costs (no model time at all).

/v1/completions answers with a canned one-token completion in vLLM's format (tokens as "token_id:N", what the gateway
asks for), /v1/chat/completions with a canned one-token chat completion (what LiteLLM and a plain pass-through
forward), each as JSON or as a stream as asked; /health and /v1/models. A raw ASGI app with every body prepared once, so that the
stand-in itself costs as little as possible of the core it runs on. Only for benchmarks: the gateway's tests run
against the real engine.
"""

from __future__ import annotations

import json
import sys

import uvicorn

MODEL = "calm"


def _sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


_USAGE = {"prompt_tokens": 30, "completion_tokens": 1, "total_tokens": 31}
_COMPLETION_CHOICES = [{"index": 0, "text": "Paris", "finish_reason": "length", "logprobs": {
    "tokens": ["token_id:49"], "token_logprobs": [-0.5], "top_logprobs": [{"token_id:49": -0.5, "token_id:50": -1.5}]}}]
_COMPLETION = json.dumps({"id": "cmpl-0", "object": "text_completion", "model": MODEL, "choices": _COMPLETION_CHOICES,
                          "usage": _USAGE}).encode()
_COMPLETION_STREAM = _sse(
    {"id": "cmpl-0", "object": "text_completion", "model": MODEL, "choices": _COMPLETION_CHOICES},
    {"id": "cmpl-0", "object": "text_completion", "model": MODEL, "choices": [], "usage": _USAGE})
_CHAT = json.dumps({"id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": MODEL, "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "Paris"}, "finish_reason": "length", "logprobs": None}],
    "usage": _USAGE}).encode()
_CHAT_STREAM = _sse(
    {"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": MODEL, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": "Paris"}, "finish_reason": "length"}]},
    {"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": MODEL, "choices": [], "usage": _USAGE})
_MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}).encode()


async def read_body(receive) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    path = scope["path"]
    body = await read_body(receive) if scope["method"] == "POST" else b""
    streaming = b'"stream":true' in body.replace(b" ", b"")
    if path == "/v1/completions":
        payload, kind = (_COMPLETION_STREAM, b"text/event-stream") if streaming else (_COMPLETION, b"application/json")
    elif path == "/v1/chat/completions":
        payload, kind = (_CHAT_STREAM, b"text/event-stream") if streaming else (_CHAT, b"application/json")
    elif path == "/v1/models":
        payload, kind = _MODELS, b"application/json"
    else:  # /health
        payload, kind = b"{}", b"application/json"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", kind), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", loop="uvloop", http="httptools")
