"""The answer endpoints as the request path runs them: the one table the router and the fast lane share.

Each endpoint says how many in-flight slots a request holds, how its contexts are built (one per prompt), and how the
chat or completion answer is written in its own shape, whole or streamed. The router runs every endpoint the same way
from this table; nothing branches on an endpoint's name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from gateway.protocol.routes import CHAT, COMPLETIONS, RESPONSES, AnswerRoute
from gateway.serving import batch, responses
from gateway.serving.context import Caller, RequestContext
from gateway.serving.service import CalibratedService


@dataclass(frozen=True)
class Endpoint:
    route: AnswerRoute
    slots: Callable[[Any], int]  # in-flight slots the request holds: one per prompt
    contexts: Callable[[CalibratedService, Any, str, Caller], list[RequestContext]]
    body: Callable[[BaseModel, Any], BaseModel] = lambda body, req: body  # the whole answer in this endpoint's shape
    events: Callable[[AsyncIterator[str], Any, str], AsyncIterator[str]] = lambda chunks, req, rid: chunks  # streamed

    @property
    def name(self) -> str:
        return self.route.name


def _chat(service: CalibratedService, req, domain: str, caller: Caller) -> list[RequestContext]:
    return [service.prepare_chat(req, domain, caller)]


ENDPOINTS = {endpoint.route.path: endpoint for endpoint in (
    Endpoint(CHAT, lambda req: 1, _chat),
    Endpoint(COMPLETIONS, lambda req: len(req.prompts()), batch.contexts),
    Endpoint(RESPONSES, lambda req: 1, responses.contexts, responses.from_chat, responses.events),
)}


async def complete(service: CalibratedService, ctxs: list[RequestContext]) -> BaseModel:
    """The answer: a single prompt straight from its service, several through the batch."""
    return await service.complete(ctxs[0]) if len(ctxs) == 1 else await batch.complete(service, ctxs)


def stream(service: CalibratedService, ctxs: list[RequestContext]) -> AsyncIterator[str]:
    return service.stream(ctxs[0]) if len(ctxs) == 1 else batch.stream(service, ctxs)
