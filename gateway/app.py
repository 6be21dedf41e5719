"""The FastAPI application, built by a factory: nothing is created at import time, so tests inject what they need.

`create_app` builds the gateway's state (gateway/state.py), the default version's service, the lifespan that starts
and always stops the engines, and wires the routers (gateway/routers/); the request path itself is
gateway/serving/service.py.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from calm_core.artifact import LoadedArtifact
from calm_core.capture import Capture
from calm_core.engine import EngineClient, EngineRejected, EngineUnavailable
from calm_core.jobs import JobQueue
from calm_core.registry import Registry
from gateway.serving.deployments import Deployment, Deployments, VersionLoader
from gateway.errors import install_error_handlers
from gateway.fast_lane import FastLane
from gateway.edge.keys import KeyRing
from gateway.edge.limits import BodySizeLimit, InFlight
from gateway.observe.monitoring import DomainMonitor, Metrics
from gateway.edge.openapi import contract
from gateway.serving.service import CalibratedService, SharedParts
from gateway.serving.prepare import ServedArtifact
from gateway.serving.retraining import CaptureBook
from gateway.routers import admin, feedback, health, loop, openai
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.records.store import Store
from gateway.edge.usage import EngineWork

log = logging.getLogger("calm.gateway")


def build_state(settings: GatewaySettings, engine: EngineClient, tokenizer, artifact: LoadedArtifact, store: Store,
                prometheus: CollectorRegistry, load_version: VersionLoader | None) -> GatewayState:
    metrics = Metrics(prometheus)
    monitor = DomainMonitor(metrics, artifact.manifest.reference_histograms, settings.domains, settings.drift_window)
    artifacts = Registry(store, settings.registry_root, settings.registry_url)
    if "path" in artifact.__dict__:  # an artifact on disk (unit tests build bare ones) is the registry's default
        artifacts.ensure_default(artifact.path)
    capture = Capture(store)
    capture_book = CaptureBook(capture)
    in_flight = InFlight(settings.max_in_flight)
    shared = SharedParts.build(settings, tokenizer, store, monitor, capture_book, alone=lambda: in_flight.count <= 1)

    def make_service(version_engine: EngineClient, loaded: LoadedArtifact) -> CalibratedService:
        return CalibratedService(version_engine, ServedArtifact.of(loaded), shared)

    default = Deployment(artifact.manifest.artifact_version, make_service(engine, artifact), artifact)
    deployments = Deployments(default, artifacts, make_service, monitor, load_version, settings.drain_s,
                              settings.registry_poll_s)
    metrics.in_flight.set_function(lambda: in_flight.count)  # read at scrape time: nothing per request
    keyring = KeyRing(store, settings.api_keys_required)
    keyring.refresh()  # at start-up, not by the first request on the event loop
    return GatewayState(settings, store, prometheus, metrics, monitor, shared, deployments, artifacts, JobQueue(store),
                        capture, capture_book, keyring, in_flight, EngineWork(store, settings.usage_sync_s))


async def prepared(engine) -> None:
    """Engines of a fleet load and check the default version before this replica takes traffic: engines that refuse it
    (not in their registry: CALM_REGISTRY_DIR differs) stop the start with the reason; engines not up yet load it on
    their first request."""
    prepare = getattr(engine, "prepare", None)
    if prepare is None:
        return
    try:
        await prepare()
    except EngineUnavailable as e:
        log.warning("no engine answers yet (%s); each loads the version on its first request", e)
    except EngineRejected as e:
        raise RuntimeError(f"{e} (do the engines' CALM_REGISTRY_DIR and this gateway's registry folder agree?)") from None


class GatewayAPI(FastAPI):
    """The gateway's FastAPI app, with the answer routes' fast lane in front of its middleware stack."""

    def build_middleware_stack(self):
        state: GatewayState = self.state.gateway
        return FastLane(super().build_middleware_stack(), state, state.settings.max_body_bytes)


def create_app(
    settings: GatewaySettings,
    engine: EngineClient,
    tokenizer,
    artifact: LoadedArtifact,
    store: Store | None = None,
    registry: CollectorRegistry | None = None,
    load_version: VersionLoader | None = None,
) -> FastAPI:
    """`engine` serves `artifact`, the global default; `load_version` starts an engine for another registry version
    (per-domain versions and hot swap; upstream: the same fleet naming another version), None to serve `artifact` alone."""
    state = build_state(settings, engine, tokenizer, artifact, store or Store(settings.database),
                        registry or CollectorRegistry(), load_version)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        await prepared(engine)
        poller = None
        try:
            await state.deployments.sync()  # per-domain versions serve from the first request on
            poller = asyncio.get_running_loop().create_task(state.deployments.run())
            yield
        finally:  # engines and the database always shut down, however the server stops
            if poller is not None:
                poller.cancel()
            await state.capture_book.flush()
            await state.shared.handoff.close()
            await state.deployments.close()  # every version's engines, the default's included
            state.store.close()

    app = GatewayAPI(title="CALM Gateway", version="0.1.0", lifespan=lifespan)
    app.openapi = lambda: contract(app, settings)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.state.gateway = state
    for group in (openai, health, feedback, admin, loop):
        app.include_router(group.router)
    return app
