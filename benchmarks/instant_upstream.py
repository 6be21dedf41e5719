"""An instant stand-in for a vLLM OpenAI server, to measure the gateway's own ceiling (no model time at all).

It answers /v1/completions with a canned one-token stream in vLLM's format (tokens as "token_id:N") and /health.
Only for benchmarks: the gateway's tests run against the real engine.
"""

from __future__ import annotations

import json
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


async def completions(request: Request):
    body = await request.json()
    ids = body.get("logprob_token_ids") or [49]
    top = {f"token_id:{t}": -1.0 - i * 0.5 for i, t in enumerate(ids)}
    chunk = {"choices": [{"index": 0, "text": "A", "finish_reason": "length", "logprobs": {
        "tokens": [f"token_id:{ids[0]}"], "token_logprobs": [-1.0], "top_logprobs": [top]}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 60, "completion_tokens": 1}}

    async def stream():
        yield f"data: {json.dumps(chunk)}\n\n"
        yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream")


async def health(request: Request):
    return JSONResponse({})


app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
