"""OpenAI-compatible routes: chat completions, completions (one prompt or several), responses, models.

Each answer runs on the version serving its domain now (a swap during the request lets it finish on that one), under
the in-flight limit (a slot per prompt) and the request deadline; errors are counted per endpoint and domain, and a
stream's failure becomes an SSE error event. A Responses API request runs as the chat completion it describes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import Response

from calm_core.engine import EngineBudget, engine_budget
from gateway.protocol.routes import CHAT, COMPLETIONS, RESPONSES
from gateway.serving import endpoints
from gateway.serving.context import Caller
from gateway.serving.endpoints import ENDPOINTS, Endpoint
from gateway.serving.deployments import Deployment
from gateway.errors import APIError, ErrorClass, classify, log, sse_error
from gateway.edge.peer import HOP_HEADER, is_peer_hop
from gateway.settings import peer_secret
from gateway.records.client_keys import ClientKey
from gateway.edge.limits import WriteTimeoutStreamingResponse, deadline, within_deadline
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, SamplingFields
from gateway.protocol.responses import ResponsesRequest
from gateway.routers.deps import client, documented, state
from gateway.state import GatewayState
from gateway.serving.wire import calibration_headers

router = APIRouter()
# A 200 is JSON, or with `stream: true` server-sent events: both in the contract (schemathesis checks content types).
ANSWER_RESPONSES = {200: {"description": "the answer; with `stream: true`, server-sent events ending with [DONE]",
                       "content": {"text/event-stream": {"schema": {  # each event: a JSON chunk, or [DONE]
                           "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}}},
                 **documented(400, 401, 403, 404, 413, 429, 500, 503, 504)}


# The answer routes read the state from the request itself: one dependency fewer to solve on the hot path.
@router.post(CHAT.path, responses=ANSWER_RESPONSES)
async def chat_completions(req: ChatCompletionRequest, raw_request: Request,
                           x_calm_domain: str | None = Header(default=None), key: ClientKey | None = Depends(client)):
    return await answer(raw_request.app.state.gateway, ENDPOINTS[CHAT.path], req, x_calm_domain, key,
                        await escalated_here(raw_request))


@router.post(COMPLETIONS.path, responses=ANSWER_RESPONSES)
async def completions(req: CompletionRequest, raw_request: Request, x_calm_domain: str | None = Header(default=None),
                      key: ClientKey | None = Depends(client)):
    return await answer(raw_request.app.state.gateway, ENDPOINTS[COMPLETIONS.path], req, x_calm_domain, key,
                        await escalated_here(raw_request))


@router.post(RESPONSES.path, responses=ANSWER_RESPONSES)
async def responses_api(req: ResponsesRequest, raw_request: Request, x_calm_domain: str | None = Header(default=None),
                        key: ClientKey | None = Depends(client)):
    return await answer(raw_request.app.state.gateway, ENDPOINTS[RESPONSES.path], req, x_calm_domain, key,
                        await escalated_here(raw_request))


@router.get("/v1/responses/{response_id}", responses=documented(401, 404))
async def stored_response(response_id: str, _: ClientKey | None = Depends(client)):
    raise APIError(404, f"no stored response {response_id!r}: this gateway keeps no response for retrieval (each is "
                   "answered with store false); keep what you need from the answer", "not_found_error", "response_id",
                   code="response_not_found")


@router.get("/v1/models", responses=documented(401))
async def models(_: ClientKey | None = Depends(client), gateway: GatewayState = Depends(state)) -> ModelList:
    return ModelList(data=[ModelCard(id=gateway.deployments.default.service.engine.model_name)])


@router.get("/v1/models/{model}", responses=documented(401, 404))
async def model(model: str, _: ClientKey | None = Depends(client), gateway: GatewayState = Depends(state)) -> ModelCard:
    service = gateway.deployments.default.service
    service.check_model(model)
    return ModelCard(id=model)


async def escalated_here(raw_request: Request) -> bool:
    """A peer gateway escalated this request here, proven by its signed hop (gateway/edge/peer.py): answer it, never hand
    it off again. A hop anyone could write is not one: the request is answered as any caller's."""
    value = raw_request.headers.get(HOP_HEADER)
    if value is None:
        return False
    return is_peer_hop(peer_secret(raw_request.app.state.gateway.settings), value, await raw_request.body())


def serving(gateway: GatewayState, req: SamplingFields | ResponsesRequest, domain: str) -> Deployment:
    """The domain's deployment, or the version the request names: one this replica serves, else a 404 as for an
    unknown model (a path never gets here: the name's pattern refuses it with a 400)."""
    version = req.calm.version if req.calm is not None else None
    if version is None:
        return gateway.deployments.for_domain(domain)
    deployment = gateway.deployments.loaded.get(version)
    if deployment is None:
        raise APIError(404, f"artifact version {version!r} is not served here (served: "
                       f"{', '.join(sorted(gateway.deployments.loaded))})", "not_found_error", "calm.version",
                       code="version_not_found")
    return deployment


async def answer(gateway: GatewayState, endpoint: Endpoint, req: SamplingFields | ResponsesRequest,
                 domain_header: str | None, key: ClientKey | None, escalated: bool = False) -> Response:
    start, end = time.perf_counter(), asyncio.get_running_loop().time() + gateway.settings.request_deadline_s
    budget = EngineBudget(gateway.settings.engine_sequences_per_request)
    engine_budget.set(budget)  # this request's task and its children
    domain = gateway.deployments.default.service.domain_of(req, domain_header)
    slots, name = endpoint.slots(req), endpoint.name
    try:
        gateway.keyring.admit(key, domain)
        gateway.usage.admit(key)
        deployment = serving(gateway, req, domain)  # before the slots: a 404 here must not keep one
        gateway.in_flight.acquire(slots)
        deployment.in_flight += 1
        held = False
        try:
            async with deadline(gateway.settings.request_deadline_s):
                service = deployment.service
                caller = Caller(key.id if key is not None else None, handoff=not escalated,
                                drift=deployment is gateway.deployments.for_domain(domain))
                ctxs = endpoint.contexts(service, req, domain, caller)
                if req.stream:  # the slots are held until the stream's last chunk
                    chunks = endpoint.events(endpoints.stream(service, ctxs), req, ctxs[0].response_id)
                    chunks = within_deadline(chunks, end, gateway.settings.request_deadline_s)
                    stream = held_until_done(counted(gateway, name, domain, chunks), deployment,
                                             lambda: gateway.usage.add(key, budget.spent))
                    held = True
                else:
                    body = await endpoints.complete(service, ctxs)
        finally:
            if not held:
                gateway.in_flight.release(slots)
                deployment.in_flight -= 1
                gateway.usage.add(key, budget.spent)  # spent whether or not it was answered
    except Exception as e:
        count_error(gateway, name, domain, e)
        raise
    except asyncio.CancelledError:  # its client disconnected (gateway/fast_lane.py): nginx's "client closed request"
        gateway.metrics.requests_of(name, domain, "499").inc()
        raise
    gateway.metrics.requests_of(name, domain, "200").inc()
    if held:
        return WriteTimeoutStreamingResponse(
            gateway.in_flight.hold_stream(stream, slots), gateway.settings.stream_write_timeout_s,
            media_type="text/event-stream", headers=calibration_headers(None, domain, service.engine.artifact_version))
    gateway.metrics.latency_of(name, domain).observe(time.perf_counter() - start)
    first = body.choices[0].calibration
    body = endpoint.body(body, req)
    return Response(body.model_dump_json(), media_type="application/json",
                    headers=calibration_headers(first, first.domain, first.artifact_version))


def count_error(gateway: GatewayState, endpoint: str, domain: str, exc: BaseException) -> ErrorClass:
    error = classify(exc)
    gateway.metrics.errors.labels(endpoint, domain, error.type).inc()
    gateway.metrics.requests_of(endpoint, domain, str(error.status)).inc()
    return error


async def counted(gateway: GatewayState, endpoint: str, domain: str, stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream whose failure becomes an SSE error event and [DONE], classified and counted like any error."""
    try:
        async for piece in stream:
            yield piece
    except Exception as e:
        error = count_error(gateway, endpoint, domain, e)
        if error.unexpected:
            log.error("unhandled error in a %s stream", endpoint, exc_info=e)
        yield sse_error(error)


async def held_until_done(stream: AsyncIterator[str], deployment: Deployment,
                          on_end: Callable[[], None]) -> AsyncIterator[str]:
    """A response stream that keeps its deployment in use until the last chunk (or the client's disconnect)."""
    try:
        async for piece in stream:
            yield piece
    finally:
        deployment.in_flight -= 1
        on_end()
