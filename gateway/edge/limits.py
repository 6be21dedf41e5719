"""Backpressure and bounds: what keeps an overloaded gateway answering instead of growing memory.

- in flight: at most `max_in_flight` generation requests (streams included, until their last chunk) per replica;
  one more is answered 429 with Retry-After at once, not queued without bound in front of the engine;
- deadline: a non-streaming request still running after `request_deadline_s` is abandoned (its engine request
  aborted) and answered 504;
- body size: a request body over `max_body_bytes` is refused with 413 before it is read;
- engine work: one request starts at most `max_engine_sequences` engine sequences (calm_core.engine.EngineBudget);
- streams: held to the same deadline from the request's start to the last chunk, and a client that stops reading
  is disconnected after `stream_write_timeout_s` (its slots and engine requests freed, nothing buffered for it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from gateway.errors import APIError, error_body

log = logging.getLogger("calm.gateway")


class InFlight:
    """A non-blocking admission counter (the event loop is single-threaded: no lock needed)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0

    def acquire(self, slots: int = 1) -> None:
        """One slot per answer asked for at once: a request, or each prompt of a completions request with several."""
        if slots > self.limit:
            raise APIError(400, f"{slots} prompts are more than this gateway serves at once ({self.limit}, "
                           "CALM_MAX_IN_FLIGHT); send fewer per request", param="prompt")
        if self.count + slots > self.limit:
            raise APIError(429, f"the gateway is at its limit of {self.limit} requests in flight; retry shortly",
                           "rate_limit_error", code="server_busy", retry_after_s=1)
        self.count += slots

    def release(self, slots: int = 1) -> None:
        self.count -= slots

    async def hold_stream(self, stream: AsyncIterator[str], slots: int = 1) -> AsyncIterator[str]:
        """Keep the slots until the stream has sent its last chunk (or the client went away)."""
        try:
            async for piece in stream:
                yield piece
        finally:
            self.release(slots)


class deadline:
    """`async with deadline(s)`: asyncio.timeout whose expiry is the API's 504 (a class: a generator-based context
    manager cost a measurable share of a request at the gateway's ceiling)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._timeout = asyncio.timeout(seconds)

    async def __aenter__(self):
        await self._timeout.__aenter__()
        return self

    async def __aexit__(self, kind, exc, tb):
        try:
            return await self._timeout.__aexit__(kind, exc, tb)
        except TimeoutError:
            raise _deadline_error(self.seconds) from None


def _deadline_error(seconds: float) -> APIError:
    return APIError(504, f"the request did not finish within {seconds:g} s (CALM_REQUEST_DEADLINE_S)", "timeout_error",
                    code="deadline_exceeded")


async def within_deadline(stream: AsyncIterator[str], end: float, seconds: float) -> AsyncIterator[str]:
    """A stream held to its request's deadline (`end`, on the loop's clock) until its last chunk: past it the stream
    is cancelled where it waits (its engine requests aborted) and 504 is raised, for the caller's error event. The
    timeout never spans a `yield`, so it cancels only this stream's own wait."""
    pieces = aiter(stream)
    try:
        while True:
            try:
                async with asyncio.timeout_at(end):
                    piece = await anext(pieces)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise _deadline_error(seconds) from None
            yield piece
    finally:
        await pieces.aclose()


class WriteTimeoutStreamingResponse(StreamingResponse):
    """A stream whose client has stopped reading is given up after `write_timeout_s` of a write that cannot proceed
    (uvicorn's send waits while the socket's buffer is full): the generator is closed, so its slots and engine requests
    are freed, instead of being held as long as the client likes. uvicorn then closes the connection (logging that the
    response was not completed); the socket lingers until the kernel gives up on its unread data."""

    def __init__(self, content, write_timeout_s: float, **kwargs):
        super().__init__(content, **kwargs)
        self.write_timeout_s = write_timeout_s

    async def stream_response(self, send) -> None:
        async def bounded_send(message) -> None:
            async with asyncio.timeout(self.write_timeout_s):
                await send(message)

        try:
            await super().stream_response(bounded_send)
        except TimeoutError:
            log.warning("closed a stream whose client read nothing for %g s", self.write_timeout_s)
        finally:
            await self.body_iterator.aclose()


class BodySizeLimit:
    """Pure ASGI middleware (no per-request task or body buffering, unlike a decorator middleware): a declared
    Content-Length over `max_bytes` is answered 413 before the body is read; a chunked body is read up to the limit
    and refused the same way past it."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, send, size: str) -> None:
        body = json.dumps(error_body(413, f"request body of {size} bytes exceeds the limit of {self.max_bytes}",
                                     "invalid_request_error", code="body_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, declared.decode())
        if declared is not None:
            return await self.app(scope, receive, send)
        # Chunked: read up to the limit here, then hand the body on (rare; at most max_bytes buffered).
        chunks, connected, within = await read_up_to(receive, self.max_bytes)
        if not connected:
            return None
        if not within:
            return await self._refuse(send, f"more than {self.max_bytes}")
        await self.app(scope, replay(chunks, True, receive), send)


async def read_up_to(receive, max_bytes: int) -> tuple[list[bytes], bool, bool]:
    """A request body's pieces, read until its end or until past `max_bytes`: (pieces, the client still there, the
    body within the limit)."""
    chunks, seen, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return chunks, False, True
        chunks.append(message.get("body", b""))
        seen += len(chunks[-1])
        more = message.get("more_body", False)
        if seen > max_bytes:
            return chunks, True, False
    return chunks, True, True


def replay(chunks: list[bytes], complete: bool, receive):
    """`receive` for the next app: the pieces already read, then (for a body read only part way) the rest."""
    pending = list(chunks)

    async def replayed():
        if pending:
            piece = pending.pop(0)
            return {"type": "http.request", "body": piece, "more_body": bool(pending) or not complete}
        return await receive()

    return replayed
