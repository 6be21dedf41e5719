"""The answer routes: name (the `endpoint` label of the metrics), path and request model, spelled once for the router,
the fast lane, the error counters and the serving table (gateway/serving/endpoints.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
from gateway.protocol.responses import ResponsesRequest


@dataclass(frozen=True)
class AnswerRoute:
    name: str
    path: str
    request: type[BaseModel]


CHAT = AnswerRoute("chat", "/v1/chat/completions", ChatCompletionRequest)
COMPLETIONS = AnswerRoute("completions", "/v1/completions", CompletionRequest)
RESPONSES = AnswerRoute("responses", "/v1/responses", ResponsesRequest)
ANSWER_ROUTES = {route.path: route for route in (CHAT, COMPLETIONS, RESPONSES)}
