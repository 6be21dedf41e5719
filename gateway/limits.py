"""Backpressure and bounds: what keeps an overloaded gateway answering instead of growing memory.

- in flight: at most `max_in_flight` generation requests (streams included, until their last chunk) per replica;
  one more is answered 429 with Retry-After at once, not queued without bound in front of the engine;
- deadline: a non-streaming request still running after `request_deadline_s` is abandoned (its engine request
  aborted) and answered 504;
- body size: a request body over `max_body_bytes` is refused with 413 before it is read.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.errors import APIError, error_response


class InFlight:
    """A non-blocking admission counter (the event loop is single-threaded: no lock needed)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0

    def acquire(self) -> None:
        if self.count >= self.limit:
            raise APIError(429, f"the gateway is at its limit of {self.limit} requests in flight; retry shortly",
                           "rate_limit_error", code="server_busy", retry_after_s=1)
        self.count += 1

    def release(self) -> None:
        self.count -= 1

    async def hold_stream(self, stream: AsyncIterator[str]) -> AsyncIterator[str]:
        """Keep the slot until the stream has sent its last chunk (or the client went away)."""
        try:
            async for piece in stream:
                yield piece
        finally:
            self.release()


@asynccontextmanager
async def deadline(seconds: float):
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise APIError(504, f"the request did not finish within {seconds:g} s (CALM_REQUEST_DEADLINE_S)",
                       "timeout_error", code="deadline_exceeded") from None


def body_size_limit(app, max_bytes: int) -> None:
    """Refuse bodies larger than `max_bytes` (declared length, or counted while chunked bodies arrive): 413."""

    @app.middleware("http")
    async def _limit(request, call_next):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            return error_response(413, f"request body of {declared} bytes exceeds the limit of {max_bytes}",
                                  "invalid_request_error", code="body_too_large")
        return await call_next(request)
