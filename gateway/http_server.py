"""How `calm serve` listens: uvicorn's settings, and a deadline for reading a request's headers.

uvicorn (0.55) has no header-read timeout. Its one timer, `timeout_keep_alive`, runs between two requests of a
connection and stops at the first byte of the next one, and a new connection has none until its first answer: a client
that connects and sends nothing, or sends its headers a byte at a time (slowloris), holds a connection for ever, and
enough of them hold every file descriptor. HeaderDeadline closes a connection whose request headers are not complete
within `header_timeout_s` of its opening or of the request's first byte. HAProxy in front of a fleet does the same
(deploy/haproxy/haproxy.cfg, `timeout http-request`); this covers a gateway reached directly (docker-compose's
`gateway`, a bare `calm serve`). A body sent slowly is not bounded yet: the fast lane and the size limit read it before
the request deadline starts (docs/security.md, still open).
"""

from __future__ import annotations

import asyncio
from functools import partial

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0


class HeaderDeadline(HttpToolsProtocol):
    def __init__(self, *args, header_timeout_s: float = HEADER_TIMEOUT_S, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # the first request of a connection keeps the deadline its opening set

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a pipelined request is being answered: the connection ends after it
        elif not self.transport.is_closing():
            self.transport.close()


def server_config(app, settings) -> uvicorn.Config:
    # No proxy-headers layer: the gateway never reads the client's address, and the layer wraps every request.
    headers_within = settings.header_timeout_s
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", access_log=False,
                          loop="uvloop", http=partial(HeaderDeadline, header_timeout_s=headers_within),
                          proxy_headers=False, timeout_graceful_shutdown=int(settings.drain_s) or None,
                          timeout_keep_alive=settings.keep_alive_s)
