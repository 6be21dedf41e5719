"""How `calm serve` listens: uvicorn's settings, and a deadline for reading a request's headers.

uvicorn (0.55) has no header-read timeout. Its one timer, `timeout_keep_alive`, runs between two requests of a
connection and stops at the first byte of the next one, and a new connection has none until its first answer: a client
that connects and sends nothing, or sends its headers a byte at a time (slowloris), holds a connection for ever, and
enough of them hold every file descriptor. HeaderDeadline closes a connection whose request headers are not complete
within `header_timeout_s` of its opening or of the request's first byte. HAProxy in front of a fleet does the same
(deploy/haproxy/haproxy.cfg, `timeout http-request`); this covers a gateway reached directly (docker-compose's
`gateway`, a bare `calm serve`). The body has its own deadline from the end of the headers (`body_timeout_s`): a
body sent a byte at a time would otherwise hold the connection, since the fast lane and the size limit read it before
the request deadline starts.
"""

from __future__ import annotations

import asyncio
from functools import partial

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0


class HeaderDeadline(HttpToolsProtocol):
    def __init__(self, *args, header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s, self.body_timeout_s = header_timeout_s, body_timeout_s
        self._deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._body_received()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # the first request of a connection keeps the deadline its opening set

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        self._body_received()
        self._body_deadline = self.loop.call_later(self.body_timeout_s, self._body_expired)

    def on_message_complete(self) -> None:
        self._body_received()  # a request without a body completes right after its headers
        super().on_message_complete()

    def _body_received(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_expired(self) -> None:
        """The request's body did not arrive in time: the connection closes, and the app reading it sees the client
        gone (its handler ends without an answer, as for any client that leaves)."""
        self._body_deadline = None
        if not self.transport.is_closing():
            self.transport.close()

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
    protocol = partial(HeaderDeadline, header_timeout_s=settings.header_timeout_s,
                       body_timeout_s=settings.body_timeout_s)
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info", access_log=False,
                          loop="uvloop", http=protocol,
                          proxy_headers=False, timeout_graceful_shutdown=int(settings.drain_s) or None,
                          timeout_keep_alive=settings.keep_alive_s)
