"""Health (every loaded version's engine answers), the liveness and readiness probes, and Prometheus metrics.

/health describes the deployment (engine URLs and settings, versions, routes, why a version did not load, which can
name its files) only to a caller holding the admin key: anyone else learns whether it is healthy, no more. Until the engines have started, gateway/edge/starting.py
answers these paths itself (live 200, ready 503)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from calm_core.engine import EngineUnavailable
from gateway.errors import APIError
from gateway.routers.deps import documented, holds_admin_key, state
from gateway.state import GatewayState

router = APIRouter()


async def check_engines(gateway: GatewayState, detail: bool = True) -> None:
    """Every loaded version's engine answers, else 503: EngineUnavailable, whose text names the upstream URLs, where
    `detail`; a bare 503 otherwise."""
    try:
        for deployment in list(gateway.deployments.loaded.values()):
            await deployment.service.engine.check_health()
    except EngineUnavailable:
        if detail:
            raise
        raise APIError(503, "model engine unavailable", "service_unavailable_error", retry_after_s=5) from None


@router.get("/health", responses=documented(503))
async def health(request: Request, authorization: str | None = Header(default=None),
                 gateway: GatewayState = Depends(state)):
    """The deployment's description to the admin; the status alone to anyone else."""
    admin = holds_admin_key(request, authorization)
    await check_engines(gateway, detail=admin)
    if not admin:
        return {"status": "ok"}
    deployments = gateway.deployments
    default = deployments.default.service
    return {"status": "ok", "model": default.engine.model_name, "artifact_version": default.engine.artifact_version,
            "scoring": default.scoring_paths(), "engine": default.engine.describe(), "versions": deployments.describe(),
            "domains": sorted(gateway.monitor.known)}


@router.get("/health/live", responses=documented(503))
async def live(gateway: GatewayState = Depends(state)):
    """The process serves, or will once its engines answer again; 503 once an engine died for good (an in-process
    vLLM engine core is never restarted), so that a liveness probe restarts the gateway, as vLLM's own server exits."""
    for version, deployment in gateway.deployments.loaded.items():
        dead = getattr(deployment.service.engine, "dead", None)
        reason = dead() if dead is not None else None
        if reason:
            raise APIError(503, f"version {version}: {reason}; the gateway must be restarted",
                           "service_unavailable_error", code="engine_dead")
    return {"status": "live", "ready": True}


@router.get("/health/ready", responses=documented(503))
async def ready(request: Request, authorization: str | None = Header(default=None),
                gateway: GatewayState = Depends(state)):
    """Every engine of every serving version answers and the database answers (else 503; why, to the admin only)."""
    await check_engines(gateway, detail=holds_admin_key(request, authorization))
    await asyncio.to_thread(gateway.store.ping)
    return {"status": "ready", "versions": sorted(gateway.deployments.loaded)}


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition"}})
async def prometheus_metrics(gateway: GatewayState = Depends(state)):
    return Response(generate_latest(gateway.prometheus), media_type=CONTENT_TYPE_LATEST)
