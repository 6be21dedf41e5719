"""One error shape for every failure: {"error": {"message", "type", "param", "code"}} with the right status.

`classify` is the one table from exception to status and error type: the HTTP handlers, the metrics and streams
(an SSE error event, then [DONE]) all use it. Validation and HTTP errors raised by the framework are turned into the
same shape. Unknown exceptions are 500s (they are our bugs, not the user's fault) and still answer in this shape,
without a traceback.
"""

from __future__ import annotations

import difflib
import json
import logging
import types
import typing
from dataclasses import dataclass
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from calm_core.engine import EngineRejected, EngineUnavailable, EngineWorkExceeded
from gateway.protocol.common import NONBLANK, ErrorInfo, ErrorResponse
from gateway.protocol.routes import ANSWER_ROUTES

log = logging.getLogger("calm.gateway")
# The answer routes' paths and their endpoint label in calm_requests_total / calm_errors_total.
UNRESOLVED_DOMAIN = "unresolved"  # the domain label of a request refused before its domain was read


def count_refusal(gateway, path: str, status: int, kind: str) -> None:
    """A POST to an answer route refused before it was answered (its body invalid, its key missing or wrong): counted
    like the errors the route counts itself, under the domain label `unresolved`."""
    route = ANSWER_ROUTES.get(path)
    if route is not None and gateway is not None:
        gateway.metrics.errors.labels(route.name, UNRESOLVED_DOMAIN, kind).inc()
        gateway.metrics.requests_of(route.name, UNRESOLVED_DOMAIN, str(status)).inc()


def _count_refused(request: Request, status: int, kind: str) -> None:
    if request.method == "POST":
        count_refusal(getattr(request.app.state, "gateway", None), request.url.path, status, kind)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ErrorClass:
    status: int
    type: str
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None
    unexpected: bool = False  # not a classified failure: our bug, logged with its traceback

    @property
    def headers(self) -> dict | None:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None


def classify(exc: BaseException) -> ErrorClass:
    """The status and error type of an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return ErrorClass(exc.status, exc.type, exc.message, exc.param, exc.code, exc.retry_after_s)
    if isinstance(exc, EngineRejected):
        return ErrorClass(400, "invalid_request_error", str(exc))
    if isinstance(exc, EngineWorkExceeded):
        return ErrorClass(400, "invalid_request_error", f"{exc} (CALM_MAX_ENGINE_SEQUENCES)", code="engine_work_exceeded")
    if isinstance(exc, EngineUnavailable):
        return ErrorClass(503, "service_unavailable_error", f"model engine unavailable: {exc}", retry_after_s=5)
    if isinstance(exc, (OperationalError, InterfaceError)):
        # The database is down, locked past its timeout, or out of disk: nothing was stored by this request (its
        # transaction rolled back), and the caller may retry.
        return ErrorClass(503, "service_unavailable_error", "storage unavailable; nothing was stored, retry shortly",
                          code="storage_unavailable", retry_after_s=5)
    return ErrorClass(500, "internal_server_error", "internal error; it has been logged", unexpected=True)


def status_code_name(status: int) -> str:
    """The `code` of an error with no more specific one: its HTTP status spelled as OpenAI spells codes, a string like
    every other code ("not_found", "method_not_allowed"), so a client compares one type."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else f"status {status}"
    return phrase.lower().replace("-", "_").replace(" ", "_")


def error_body(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param,
                                         code=code or status_code_name(status))).model_dump()


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param, code), status_code=status, headers=headers)


def sse_error(error: "ErrorClass") -> str:
    """A streaming error: one SSE event in the error shape, then [DONE]."""
    body = error_body(error.status, error.message, error.type, error.param, error.code)
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"


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
    "previous_response_id": "responses are not stored here: send the conversation in `input`",
    "background": "answers are given while the request waits; nothing runs in the background",
    "reasoning": "the served model does not reason apart from its answer",
    "reasoning_effort": "the served model does not reason apart from its answer",
    "min_tokens": "forcing a minimum length bends the answer away from the model's own distribution, which the "
                  "calibrated confidence describes",
    "store": "responses are not stored here for retrieval: each is answered with store false; keep what you need",
    "web_search_options": "the gateway answers from the served model alone; it has no search tool",
    "truncate_prompt_tokens": "a prompt cut by the engine would be answered as another question than the one asked; "
                              "shorten it yourself",
    "length_penalty": "it applies to beam search, which this gateway refuses (it bypasses the calibrated confidence)",
}


def validation_message(errors: list[dict], body: type[BaseModel] | None = None) -> tuple[str, str | None]:
    """The message and param of a request body's validation errors (pydantic's or FastAPI's). `body`: the body's
    model, for naming what an object takes when the caller misspelt a field."""
    first = _most_telling(errors)
    loc = _location(first)
    param = ".".join(loc) or None
    kind = first.get("type")
    if kind == "json_invalid":
        return "request body is not valid JSON", None
    if kind == "extra_forbidden" or (kind in ("too_long", "literal_error") and loc and loc[-1] in REFUSED_PARAMETERS):
        if loc and loc[-1] in REFUSED_PARAMETERS:
            return f"unsupported parameter {param!r}: {REFUSED_PARAMETERS[loc[-1]]}", param
        return f"unsupported parameter {param!r}: {_what_it_takes(body, loc)}", param
    if kind == "string_pattern_mismatch" and (first.get("ctx") or {}).get("pattern") == NONBLANK:
        return f"{param}: must not be empty or blank", param
    if loc == ["prompt"] and isinstance(given := first.get("input"), list):
        if not all(isinstance(p, str) for p in given):
            return "prompt: token-id prompts are not supported; send the prompt as text", param
        if kind == "too_long":
            return f"prompt: at most {first['ctx']['max_length']} prompts per request (this list has {len(given)})", param
    if kind == "literal_error" and loc[-3:-2] == ["content"] and loc[-1] == "type":
        return (f"{param}: content parts of type {first.get('input')!r} are not supported: the model reads text parts "
                "only"), param
    message = str(first.get("msg")).removeprefix("Value error, ")  # a validator's own words need no prefix
    return (f"{param}: {message}" if param else message), param


def _location(error: dict) -> list[str]:
    """Where the error is, as the caller wrote it: without 'body' and without pydantic's union branch tags ('str',
    'list[TextPart]', 'constrained-str'), which name no field."""
    return [str(p) for p in error.get("loc", ()) if p != "body" and not (
        isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p or p.startswith("constrained-")))]


def _what_it_takes(body: type[BaseModel] | None, loc: list[str]) -> str:
    """For a field the caller added: the name it probably meant and, in a small object such as `calm`, every name it
    takes (a misspelt option is refused, never ignored, so the refusal should say how to spell it)."""
    model = body
    for part in loc[:-1]:
        if part.isdigit():  # an item of a list: the list's model
            continue
        field = model.model_fields.get(part) if model else None
        model = _model_in(field.annotation) if field else None
    if model is None or not loc:
        return "this gateway does not support it"
    names = [f.alias or name for name, f in model.model_fields.items()]
    close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    said = [f"did you mean {close[0]!r}?"] if close else []
    if len(loc) > 1 and len(names) <= 12:
        said.append(f"`{'.'.join(loc[:-1])}` takes {', '.join(names)}")
    return " ".join(said) or "this gateway does not support it"


def _model_in(annotation) -> type[BaseModel] | None:
    """The pydantic model a field holds, through Optional, unions, lists and Annotated (the first one found)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, typing.Annotated):
        return next(filter(None, map(_model_in, typing.get_args(annotation))), None)
    return None


def _most_telling(errors: list[dict]) -> dict:
    """The error to report. Pydantic reports every branch of a union (`str | list[...]`), the branches whose type the
    input does not have only as 'Input should be a valid string': report what went wrong in the branch it has."""
    where = _location(errors[0])
    return next((e for e in errors if not str(e.get("type", "")).endswith("_type")
                 and _location(e)[:len(where)] == where), errors[0])


def _allowed_methods(request: Request) -> list[str]:
    path = request.url.path
    methods: set[str] = set()
    for route in request.app.routes:
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(path):
            methods |= set(route_methods)
    return sorted(methods)


def classified_response(exc: Exception, path: str) -> JSONResponse:
    """The error response of an exception raised while serving `path` (logged with its traceback when unexpected)."""
    error = classify(exc)
    if error.unexpected:
        log.error("unhandled error on %s", path, exc_info=exc)
    return error_response(error.status, error.message, error.type, error.param, error.code, error.headers)


NOT_JSON = ("the request body must be JSON sent with 'Content-Type: application/json' (curl -d sends "
            "application/x-www-form-urlencoded unless told otherwise)")


def json_content_type(content_type: str | None) -> bool:
    """FastAPI parses a body as JSON without a content type or with application/json or application/*+json."""
    if not content_type:  # absent or empty: FastAPI reads JSON
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _not_read_as_json(request: Request, errors: list[dict]) -> bool:
    """The body was refused as a whole because its declared type is not JSON (FastAPI then does not parse it)."""
    return (not json_content_type(request.headers.get("content-type"))
            and any(tuple(e.get("loc", ())) == ("body",) for e in errors))


def install_error_handlers(app: FastAPI) -> None:
    async def _classified(request: Request, exc: Exception):
        if isinstance(exc, APIError) and exc.status == 401:  # a key refused before the route ran (the route counts the rest)
            _count_refused(request, 401, exc.type)
        return classified_response(exc, request.url.path)

    for kind in (APIError, EngineRejected, EngineUnavailable, OperationalError, InterfaceError, Exception):
        app.add_exception_handler(kind, _classified)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        body_field = getattr(request.scope.get("route"), "body_field", None)  # FastAPI's APIRoute: the body model
        message, param = validation_message(exc.errors(), body_field and _model_in(body_field.field_info.annotation))
        if _not_read_as_json(request, exc.errors()):
            message, param = NOT_JSON, None
        _count_refused(request, 400, "invalid_request_error")
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        phrase = HTTPStatus(exc.status_code).phrase if exc.status_code in HTTPStatus._value2member_map_ else "error"
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # `Allow` names every method of the path (the framework lists one route's only)
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return error_response(exc.status_code, str(exc.detail or phrase), kind, headers=headers)
