"""The gateway answers from its first second. While its app is built and the engines start (tens of seconds; minutes
on a first run that converts the model), `/health/live` says the process runs and every other path is answered 503
`{"error": {"type": "starting", ...}}` with Retry-After, naming what is being done. Once the app's lifespan has
started every engine, each request goes to that app, whose `/health/ready` checks every engine and the database.

Kubernetes-style: a liveness probe on /health/live never restarts a gateway for starting slowly, a readiness probe
on /health/ready sends traffic only once an answer can be served.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Protocol

from calm_core.collector import collect_young_less_often
from gateway.errors import error_body

log = logging.getLogger("calm.gateway")
RETRY_AFTER_S = 5


class BeforeBuild(Protocol):
    """Steps before the app is built (adapters/hosting/engine_server_fork.py forks the engines' server there)."""

    def prepare(self) -> None:
        """Slow: run in a thread, as the build is."""

    def on_loop(self) -> object:
        """Run on the event loop's thread between two of its steps, while the thread that ran `prepare` waits."""


class StartingApp:
    """ASGI app around `build` (which makes the real FastAPI app: slow, run in a thread) and that app's lifespan."""

    def __init__(self, build: Callable[[], object], doing: Callable[[], str] = lambda: "starting",
                 before: BeforeBuild | None = None):
        self._build = build
        self._doing = doing
        self._before = before
        self.app = None  # the built app, once its lifespan has started: from then on it answers everything
        self.failed: BaseException | None = None
        self.on_ready: Callable[[], None] = lambda: None
        self.on_failure: Callable[[], None] = lambda: None
        self._task: asyncio.Task | None = None
        self._lifespan = AsyncExitStack()

    async def _start(self) -> None:
        try:
            if self._before is not None:
                await asyncio.to_thread(self._before.prepare)
                self._before.on_loop()
            app = await asyncio.to_thread(self._build)
            await self._lifespan.enter_async_context(app.router.lifespan_context(app))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - whatever stops the start stops the server, with its reason
            self.failed = e
            log.error("the gateway did not start: %s: %s", type(e).__name__, e)
            self.on_failure()
            return
        self.app = app
        # Everything built so far (the tokenizer, torch and vLLM's modules: millions of objects) lives as long as the
        # process: out of the collector's way, a full collection no longer walks it while requests are served
        # (vLLM's server does the same after its start; benchmarks/gateway/bench_lean.py measured the ceiling with and without).
        gc.collect()
        gc.freeze()
        collect_young_less_often()  # as `calm` set it already; a server started otherwise gets it here
        self.on_ready()

    async def _lifespan_events(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._task = asyncio.get_running_loop().create_task(self._start())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._task is not None and not self._task.done():
                    self._task.cancel()  # stopped while starting: what started is closed below
                    await asyncio.gather(self._task, return_exceptions=True)
                await self._lifespan.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "lifespan":
            return await self._lifespan_events(receive, send)
        if scope["type"] != "http":
            return None
        if scope["path"] == "/health/live":
            await _json(send, 200, {"status": "live", "ready": False})
            return None
        body = error_body(503, f"the gateway is starting: {self._doing()}; retry in a few seconds", "starting",
                          code="starting")
        await _json(send, 503, body, [(b"retry-after", str(RETRY_AFTER_S).encode())])
        return None


async def _json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})
