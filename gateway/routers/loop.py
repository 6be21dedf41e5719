"""Admin API of the retraining loop: the artifact registry (list, show, promote, rollback), retraining jobs, traffic
capture, and the Alertmanager webhook that queues jobs. Every route needs the admin key."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from fastapi import Path as FastAPIPath

from calm_core.artifact import VERSION_NAME
from calm_core.capture import CaptureSettings
from calm_core.jobs import FINISHED, OPEN
from calm_core.registry import GLOBAL, STATUSES, RegistryError
from calm_core.domains import DOMAIN_OR_GLOBAL, OTHER
from gateway.errors import APIError
from gateway.protocol.loop import AlertmanagerPayload, AlertsAccepted, CaptureSettingsIn, JobCreate, Promotion
from gateway.serving.retraining import jobs_from_alerts
from gateway.routers.deps import DOMAIN_PATTERN, admin, documented, served_domain, state
from gateway.state import GatewayState

Version = Annotated[str, FastAPIPath(pattern=VERSION_NAME)]  # a version is a folder's name: one path component
Domain = Annotated[str, FastAPIPath(pattern=DOMAIN_PATTERN, description="lower-case letters, digits, '_' or '-'")]
JOB_STATUSES = "^(" + "|".join(OPEN + FINISHED) + ")$"
router = APIRouter(dependencies=[Depends(admin)])


def serving_domain(gateway: GatewayState, domain: str) -> str:
    return served_domain(gateway, domain, other=False)


def registry_call(fn, *args):
    try:
        return fn(*args)
    except RegistryError as e:
        raise APIError(e.status, str(e), "not_found_error" if e.status == 404 else "conflict_error") from None


def switch_soon(gateway: GatewayState) -> None:  # this replica re-reads the registry now; others within their poll interval
    asyncio.get_running_loop().create_task(gateway.deployments.sync())


# -- artifact registry -------------------------------------------------------------------------------------------
@router.get("/admin/artifacts", responses=documented(400, 401, 403))
async def list_artifacts(domain: Annotated[str | None, Query(pattern=DOMAIN_PATTERN)] = None,
                         status: Annotated[str | None, Query(pattern="^(" + "|".join(STATUSES) + ")$")] = None,
                         gateway: GatewayState = Depends(state)):
    records = await asyncio.to_thread(gateway.artifacts.list, domain, status)
    return {"data": [r.as_dict() for r in records], "serving": gateway.deployments.describe()}


@router.get("/admin/artifacts/{version}", responses=documented(400, 401, 403, 404))
async def show_artifact(version: Version, gateway: GatewayState = Depends(state)):
    record = await asyncio.to_thread(gateway.artifacts.get, version)
    if record is None:
        raise APIError(404, f"no artifact version {version!r} in the registry", "not_found_error", "version")
    return record.as_dict()


@router.post("/admin/artifacts/{version}/promote", responses=documented(400, 401, 403, 404, 409))
async def promote(version: Version, body: Promotion, gateway: GatewayState = Depends(state)):
    domain = body.domain if body.domain == GLOBAL else serving_domain(gateway, body.domain)
    previous = await asyncio.to_thread(registry_call, gateway.artifacts.promote, version, domain, "admin")
    switch_soon(gateway)
    return {"version": version, "domain": domain, "previous": previous}


@router.post("/admin/domains/{domain}/rollback", responses=documented(400, 401, 403, 404, 409))
async def rollback(domain: Annotated[str, FastAPIPath(pattern=DOMAIN_OR_GLOBAL)],
                   gateway: GatewayState = Depends(state)):
    previous = gateway.deployments.version_for(domain)
    version = await asyncio.to_thread(registry_call, gateway.artifacts.rollback, domain, "admin")
    switch_soon(gateway)
    return {"domain": domain, "version": version, "previous": previous}


# -- retraining jobs ------------------------------------------------------------------------------------------
@router.get("/admin/jobs", responses=documented(400, 401, 403))
async def list_jobs(domain: Annotated[str | None, Query(pattern=DOMAIN_PATTERN)] = None,
                    status: Annotated[str | None, Query(pattern=JOB_STATUSES)] = None,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 100, gateway: GatewayState = Depends(state)):
    return {"data": [j.as_dict() for j in await asyncio.to_thread(gateway.jobs.list, domain, status, limit)]}


@router.get("/admin/jobs/{job_id}", responses=documented(400, 401, 403, 404))
async def show_job(job_id: Annotated[str, FastAPIPath(pattern=r"^[0-9a-f]{1,32}$")],
                   gateway: GatewayState = Depends(state)):
    job = await asyncio.to_thread(gateway.jobs.get, job_id)
    if job is None:
        raise APIError(404, f"no job {job_id!r}", "not_found_error", "job_id")
    return job.as_dict()


@router.post("/admin/jobs", responses=documented(400, 401, 403, 404), status_code=201)
async def create_job(body: JobCreate, gateway: GatewayState = Depends(state)):
    domain = serving_domain(gateway, body.domain)
    detail = {"by": "admin", **({"method": body.method} if body.method else {})}
    await gateway.capture_book.flush()  # the job's calibration set: every prompt this replica captured before it
    job, created = await asyncio.to_thread(gateway.jobs.enqueue, domain, "operator", detail)
    return {**job.as_dict(), "created": created}


# -- Alertmanager webhook ---------------------------------------------------------------------------------------
@router.post("/admin/alerts", responses=documented(400, 401, 403), status_code=202)
async def alerts(payload: AlertmanagerPayload, gateway: GatewayState = Depends(state)) -> AlertsAccepted:
    # Captured prompts are written after their answers, off the request path; a job queued now must find those of the
    # traffic that raised the alert (a fresh-clone run on a loaded machine once started a job with 18 of 120 written).
    await gateway.capture_book.flush()
    # The registry's route, not this replica's: a promotion reaches the registry before any replica serves it.
    registry = gateway.deployments.registry
    serving = registry.serving if registry is not None else gateway.deployments.version_for
    queued, ignored = await asyncio.to_thread(jobs_from_alerts, payload, gateway.jobs,
                                              set(gateway.monitor.known) - {OTHER}, serving)
    return AlertsAccepted(jobs=[{"id": j.id, "domain": j.domain, "status": j.status, "created": created}
                                for j, created in queued], ignored=ignored)


# -- traffic capture --------------------------------------------------------------------------------------------
@router.get("/admin/capture", responses=documented(401, 403))
async def capture_status(gateway: GatewayState = Depends(state)):
    settings, counts = await asyncio.to_thread(lambda: (gateway.capture.settings(), gateway.capture.counts()))
    return {"data": [{"domain": d, **s.as_dict(), "captured": counts.get(d, 0)} for d, s in sorted(settings.items())]}


@router.put("/admin/capture/{domain}", responses=documented(400, 401, 403, 404))
async def configure_capture(domain: Domain, body: CaptureSettingsIn, gateway: GatewayState = Depends(state)):
    settings = CaptureSettings(body.enabled, body.max_items, float(body.max_age_s), body.include_answers)
    await asyncio.to_thread(gateway.capture.configure, serving_domain(gateway, domain), settings)
    await asyncio.to_thread(gateway.capture_book.refresh)
    return {"domain": domain, **settings.as_dict()}


@router.delete("/admin/capture/{domain}/prompts", responses=documented(400, 401, 403, 404))
async def delete_captured(domain: Domain, gateway: GatewayState = Depends(state)):
    deleted = await asyncio.to_thread(gateway.capture.delete, domain)  # also a domain no longer served
    return {"domain": domain, "deleted": deleted}
