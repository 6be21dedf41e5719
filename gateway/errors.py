"""One error shape for every failure: {"error": {"message", "type", "param", "code"}} with the right status.

Validation and HTTP errors raised by the framework are turned into the same shape. Unknown exceptions stay 500s
(they are our bugs, not the user's fault) but still answer in this shape, without a traceback.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters.engine import EngineRejected, EngineUnavailable
from gateway.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("calm.gateway")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code or status)).model_dump()


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param, code), status_code=status, headers=headers)


def sse_error(status: int, message: str, type_: str) -> str:
    """A streaming error: one SSE event in the error shape, then [DONE]."""
    return f"data: {json.dumps(error_body(status, message, type_))}\n\ndata: [DONE]\n\n"


# OpenAI and vLLM parameters the gateway refuses by design, with the reason a client is told.
REFUSED_PARAMETERS = {
    "tools": "tool calling needs an engine started with a tool-call parser; this gateway's engine has none",
    "tool_choice": "tool calling needs an engine started with a tool-call parser; this gateway's engine has none",
    "parallel_tool_calls": "tool calling needs an engine started with a tool-call parser; this gateway's engine has none",
    "functions": "tool calling needs an engine started with a tool-call parser; this gateway's engine has none",
    "function_call": "tool calling needs an engine started with a tool-call parser; this gateway's engine has none",
    "suffix": "the served model has no fill-in-the-middle template (vLLM refuses it too)",
    "best_of": "best-of sampling picks among completions by their raw likelihood, which bypasses the calibrated "
               "confidence",
    "use_beam_search": "beam search picks among completions by their raw likelihood, which bypasses the "
                       "calibrated confidence",
    "prompt_logprobs": "prompt log-probs are taken before the α head, so they are not calibrated",
    "allowed_token_ids": "the gateway restricts tokens itself in multiple-choice mode; use `options`",
    "logprob_token_ids": "the gateway chooses the scored tokens itself in multiple-choice mode; use `options`",
    "vllm_xargs": "engine-level arguments are reserved for the gateway (they switch the α head)",
}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        reason = REFUSED_PARAMETERS.get(loc[-1] if loc else "", "this gateway does not support it")
        return f"unsupported parameter {param!r}: {reason}", param
    return (f"{param}: {first.get('msg')}" if param else str(first.get("msg"))), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else "error"
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail or phrase), kind)

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, exc: EngineUnavailable):
        return error_response(503, f"model engine unavailable: {exc}", "service_unavailable_error",
                              headers={"Retry-After": "5"})

    @app.exception_handler(EngineRejected)
    async def _rejected(request: Request, exc: EngineRejected):
        return error_response(400, str(exc), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal error; it has been logged", "internal_server_error")
