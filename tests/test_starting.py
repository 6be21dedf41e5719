"""The gateway answers from its first second (gateway/edge/starting.py): 503 "starting" with Retry-After on every path but
/health/live until the built app's lifespan has started, then the app answers; a failed start stops the server with
its reason. Logic only (a stand-in app); the real engine's start is observed in tests/test_gateway_default.py."""

from __future__ import annotations

import asyncio
import gc
import threading
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from calm_core.collector import YOUNG_GENERATION_THRESHOLD
from calm_core.errors import CalmError
from gateway.edge.starting import RETRY_AFTER_S, StartingApp


def inner_app(events: list[str]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        events.append("started")
        yield
        events.append("stopped")

    app = FastAPI(lifespan=lifespan)

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    return app


class Lifespan:
    """Drives an ASGI app's lifespan as a server does."""

    def __init__(self, app):
        self.received, self.sent = asyncio.Queue(), asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(
            app({"type": "lifespan", "asgi": {"version": "3.0"}}, self.received.get, self.sent.put))

    async def event(self, name: str) -> str:
        await self.received.put({"type": f"lifespan.{name}"})
        return (await self.sent.get())["type"]


def test_starting_answers_503_until_the_engines_started_then_the_app_answers():
    async def scenario():
        events: list[str] = []
        release = threading.Event()
        ready = asyncio.Event()
        gate = StartingApp(lambda: (release.wait(30), inner_app(events))[1], doing=lambda: "engine 'folded'")
        gate.on_ready = ready.set
        lifespan = Lifespan(gate)
        assert await lifespan.event("startup") == "lifespan.startup.complete"  # at once: the server listens
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://gw") as client:
            for path in ("/v1/models", "/health/ready", "/health", "/metrics"):
                r = await client.get(path)
                assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S), path
                assert r.json()["error"]["type"] == "starting" and "engine 'folded'" in r.json()["error"]["message"]
            live = await client.get("/health/live")
            assert live.status_code == 200 and live.json() == {"status": "live", "ready": False}
            assert events == []
            default = gc.get_threshold()
            gc.set_threshold(700, *default[1:])  # CPython's, whatever an earlier test in this process left
            frozen = gc.get_freeze_count()  # (tests/conftest.py freezes what each file starts with)
            made_since = [[] for _ in range(3)]  # tracked by the collector, alive: the start's freeze takes them
            try:
                release.set()
                await asyncio.wait_for(ready.wait(), 30)
                # Started: the start frozen, the young generation collected less often (a request's objects die young).
                assert gc.get_threshold() == (YOUNG_GENERATION_THRESHOLD, *default[1:])
                assert gc.get_freeze_count() >= frozen + 3, (frozen, gc.get_freeze_count(), len(made_since))
            finally:
                gc.set_threshold(*default)
            assert events == ["started"]
            r = await client.get("/v1/models")
            assert r.status_code == 200 and r.json() == {"data": []}
        assert await lifespan.event("shutdown") == "lifespan.shutdown.complete"
        assert events == ["started", "stopped"]

    asyncio.run(scenario())


def test_a_failed_start_stops_the_server_with_its_reason():
    async def scenario():
        stopped = asyncio.Event()

        def build():
            raise CalmError("artifact not found: /nowhere")

        gate = StartingApp(build)
        gate.on_failure = stopped.set
        lifespan = Lifespan(gate)
        assert await lifespan.event("startup") == "lifespan.startup.complete"
        await asyncio.wait_for(stopped.wait(), 30)
        assert isinstance(gate.failed, CalmError) and gate.app is None
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://gw") as client:
            assert (await client.get("/v1/models")).status_code == 503
        assert await lifespan.event("shutdown") == "lifespan.shutdown.complete"

    asyncio.run(scenario())


def test_stopped_while_starting_shuts_down_without_waiting_for_the_build():
    async def scenario():
        release = threading.Event()
        gate = StartingApp(lambda: (release.wait(30), inner_app([]))[1])
        lifespan = Lifespan(gate)
        assert await lifespan.event("startup") == "lifespan.startup.complete"
        assert await asyncio.wait_for(lifespan.event("shutdown"), 10) == "lifespan.shutdown.complete"
        release.set()
        assert gate.app is None

    asyncio.run(scenario())


def test_the_steps_before_the_build_prepare_in_a_thread_then_run_on_the_event_loops_thread():
    """Where `calm serve` forks its engines' server (adapters/hosting/engine_server_fork.py): `prepare` off the loop (the
    server answers meanwhile), `on_loop` on the loop's thread between two of its steps, and only then the build."""
    async def scenario():
        events: list[tuple[str, bool]] = []
        ready = asyncio.Event()
        record = lambda step: events.append((step, threading.current_thread() is threading.main_thread()))  # noqa: E731

        class Before:
            def prepare(self):
                record("prepare")

            def on_loop(self):
                record("on_loop")

        def build():
            record("build")
            return inner_app([])

        gate = StartingApp(build, before=Before())
        gate.on_ready = ready.set
        lifespan = Lifespan(gate)
        assert await lifespan.event("startup") == "lifespan.startup.complete"
        await asyncio.wait_for(ready.wait(), 30)
        assert events == [("prepare", False), ("on_loop", True), ("build", False)]
        assert await lifespan.event("shutdown") == "lifespan.shutdown.complete"

    assert threading.current_thread() is threading.main_thread()
    asyncio.run(scenario())
