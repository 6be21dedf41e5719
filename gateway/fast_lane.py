"""The answer routes' fast lane: a valid POST to /v1/chat/completions, /v1/completions or /v1/responses is served
straight from ASGI.

FastAPI stays the contract: the routes, their OpenAPI schema and every other path are its, and so is every request
the lane does not take. The lane only skips the framework's per-request machinery on the hot path (routing, the
dependency solver, reading the body through a Request, validating a dict built by the stdlib JSON parser), which was
the largest share of the gateway's CPU at its ceiling (benchmarks/gateway/bench_lean.py --profile). It takes a request only
when the framework would hand the same body to the same handler: a JSON (or untyped) body that validates, parsed by
pydantic-core in one step from the bytes. Anything else (invalid JSON, a validation error, another content type) is
replayed to FastAPI untouched, so each refusal keeps the framework's exact answer.

It runs before the framework's middleware stack (whose layers cost more than the lane's own work per request), so it
keeps the size limit itself: a body over the limit goes to the stack, whose BodySizeLimit refuses it.
The handler and the error responses are the routers' own (`gateway.routers.openai.answer`, `classified_response`).

A client that disconnects while its answer is worked out cancels it, engine request included, as vLLM's own server
does (`with_cancellation`): neither uvicorn nor Starlette cancels a handler whose client has gone, so a request given up
on would otherwise hold its engine slot until it finished or hit the deadline. Unlike vLLM's, the watcher starts only
once a request has run for WATCH_AFTER_S: a watcher task per request costs 17 µs, the timer 5
(benchmarks/gateway/bench_disconnect_watch.py), and a disconnect is never missed, only noticed up to WATCH_AFTER_S late
(uvicorn's `receive` reports it at once to a watcher that starts after it). A streamed answer needs
no watcher of ours: Starlette's StreamingResponse listens for the disconnect itself and closes the stream.
"""

from __future__ import annotations

import asyncio

from pydantic import ValidationError

from gateway.errors import APIError, classified_response, count_refusal, json_content_type
from gateway.edge.peer import HOP_HEADER, is_peer_hop
from gateway.edge.limits import read_up_to, replay
from gateway.routers.openai import answer
from gateway.serving.endpoints import ENDPOINTS
from gateway.settings import peer_secret
from gateway.state import GatewayState

_HOP = HOP_HEADER.lower().encode()
_WANTED = (b"authorization", b"content-length", b"content-type", b"x-calm-domain", _HOP)


def _headers(raw: list[tuple[bytes, bytes]]) -> dict[bytes, str]:
    """The headers the answer routes read, first occurrence of each (as Starlette's `Headers.get`)."""
    found: dict[bytes, str] = {}
    for name, value in raw:
        if name in _WANTED and name not in found:
            found[name] = value.decode("latin-1")
    return found


class FastLane:
    """ASGI app in front of the FastAPI app's whole middleware stack (`app`); `state` is the app's GatewayState. A body
    over `max_bytes` is left to the stack's size limit (BodySizeLimit answers 413)."""

    def __init__(self, app, state: GatewayState, max_bytes: int):
        self.app, self.state, self.max_bytes = app, state, max_bytes

    async def __call__(self, scope, receive, send):
        endpoint = ENDPOINTS.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        headers = _headers(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self.app(scope, receive, send)
        chunks, connected, within = await read_up_to(receive, self.max_bytes)
        if not connected:
            return None
        body = b"".join(chunks) if within else b""
        request = None
        if body and json_content_type(headers.get(b"content-type")):
            try:
                request = endpoint.route.request.model_validate_json(body)
            except ValidationError:
                request = None
        if request is None:  # the framework answers it, exactly as without the lane
            return await self.app(scope, replay(chunks, within, receive), send)
        watch = DisconnectWatch(receive, asyncio.current_task(), WATCH_AFTER_S)
        try:
            try:
                key = self.state.keyring.authenticate(headers.get(b"authorization"))
                hop = is_peer_hop(peer_secret(self.state.settings), headers.get(_HOP), body)
                response = await answer(self.state, endpoint, request, headers.get(b"x-calm-domain"), key, hop)
            except Exception as e:  # noqa: BLE001 - classified as the framework's handlers do (errors.py)
                if isinstance(e, APIError) and e.status == 401:  # refused before the route: counted as the app does
                    count_refusal(self.state, scope["path"], 401, e.type)
                response = classified_response(e, scope["path"])
            finally:
                watch.stop()  # the response may read `receive` itself
            await response(scope, receive, send)
        except asyncio.CancelledError:
            if not watch.fired:
                raise
            watch.task.uncancel()  # the client left: nobody to answer
        return None


WATCH_AFTER_S = 0.5  # a request running longer is watched for its client's disconnect


class DisconnectWatch:
    """Cancels `task` when its client disconnects, watching from `after_s` on (the request's body read: the next
    message `receive` gives is the disconnect)."""

    __slots__ = ("receive", "task", "timer", "watcher")

    def __init__(self, receive, task: asyncio.Task, after_s: float):
        self.receive, self.task, self.watcher = receive, task, None
        self.timer = task.get_loop().call_later(after_s, self._start)

    def _start(self) -> None:
        self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> bool:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.task.cancel()
        return True

    def stop(self) -> None:
        self.timer.cancel()
        if self.watcher is not None:
            self.watcher.cancel()

    @property
    def fired(self) -> bool:
        """The client disconnected and the task was cancelled for it."""
        w = self.watcher
        return w is not None and w.done() and not w.cancelled() and w.exception() is None
