"""Admin API of the retraining loop: the artifact registry (list, show, promote, rollback), retraining jobs, traffic
capture, and the Alertmanager webhook that queues jobs. Every route needs the admin key."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Query
from fastapi import Path as FastAPIPath

from calm_core.capture import Capture, CaptureSettings
from calm_core.jobs import FINISHED, OPEN, JobQueue
from calm_core.registry import GLOBAL, STATUSES, Registry, RegistryError
from gateway.deployments import Deployments
from gateway.errors import APIError
from gateway.monitoring import OTHER
from gateway.protocol import AlertmanagerPayload, AlertsAccepted, CaptureSettingsIn, JobCreate, Promotion
from gateway.retraining import CaptureBook, jobs_from_alerts

VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$"
DOMAIN_PATTERN = r"^[a-z0-9][a-z0-9_\-]{0,63}$"
Version = Annotated[str, FastAPIPath(pattern=VERSION_PATTERN)]
Domain = Annotated[str, FastAPIPath(pattern=DOMAIN_PATTERN, description="lower-case letters, digits, '_' or '-'")]
JOB_STATUSES = "^(" + "|".join(OPEN + FINISHED) + ")$"


def loop_router(admin, documented, deployments: Deployments, artifacts: Registry, jobs: JobQueue, capture: Capture,
                capture_book: CaptureBook, known_domains) -> APIRouter:
    router = APIRouter(dependencies=[Depends(admin)])

    def serving_domain(domain: str) -> str:
        if domain not in known_domains() or domain == OTHER:
            raise APIError(404, f"{domain!r} is not a serving domain of this gateway (CALM_DOMAINS and the artifact's "
                           "reference domains are)", "not_found_error", "domain")
        return domain

    def registry_call(fn, *args):
        try:
            return fn(*args)
        except RegistryError as e:
            raise APIError(e.status, str(e), "not_found_error" if e.status == 404 else "conflict_error") from None

    def switch_soon() -> None:  # this replica re-reads the registry now; others within their poll interval
        asyncio.get_running_loop().create_task(deployments.sync())

    # -- artifact registry -------------------------------------------------------------------------------------------
    @router.get("/admin/artifacts", responses=documented(400, 401, 403))
    async def list_artifacts(domain: Annotated[str | None, Query(pattern=DOMAIN_PATTERN)] = None,
                             status: Annotated[str | None, Query(pattern="^(" + "|".join(STATUSES) + ")$")] = None):
        records = await asyncio.to_thread(artifacts.list, domain, status)
        return {"data": [r.as_dict() for r in records], "serving": deployments.describe()}

    @router.get("/admin/artifacts/{version}", responses=documented(400, 401, 403, 404))
    async def show_artifact(version: Version):
        record = await asyncio.to_thread(artifacts.get, version)
        if record is None:
            raise APIError(404, f"no artifact version {version!r} in the registry", "not_found_error", "version")
        return record.as_dict()

    @router.post("/admin/artifacts/{version}/promote", responses=documented(400, 401, 403, 404, 409))
    async def promote(version: Version, body: Promotion):
        domain = body.domain if body.domain == GLOBAL else serving_domain(body.domain)
        previous = await asyncio.to_thread(registry_call, artifacts.promote, version, domain, "admin")
        switch_soon()
        return {"version": version, "domain": domain, "previous": previous}

    @router.post("/admin/domains/{domain}/rollback", responses=documented(400, 401, 403, 404, 409))
    async def rollback(domain: Annotated[str, FastAPIPath(pattern=r"^(\*|[a-z0-9][a-z0-9_\-]{0,63})$")]):
        previous = deployments.version_for(domain)
        version = await asyncio.to_thread(registry_call, artifacts.rollback, domain, "admin")
        switch_soon()
        return {"domain": domain, "version": version, "previous": previous}

    # -- retraining jobs ------------------------------------------------------------------------------------------
    @router.get("/admin/jobs", responses=documented(400, 401, 403))
    async def list_jobs(domain: Annotated[str | None, Query(pattern=DOMAIN_PATTERN)] = None,
                        status: Annotated[str | None, Query(pattern=JOB_STATUSES)] = None,
                        limit: Annotated[int, Query(ge=1, le=1000)] = 100):
        return {"data": [j.as_dict() for j in await asyncio.to_thread(jobs.list, domain, status, limit)]}

    @router.get("/admin/jobs/{job_id}", responses=documented(400, 401, 403, 404))
    async def show_job(job_id: Annotated[str, FastAPIPath(pattern=r"^[0-9a-f]{1,32}$")]):
        job = await asyncio.to_thread(jobs.get, job_id)
        if job is None:
            raise APIError(404, f"no job {job_id!r}", "not_found_error", "job_id")
        return job.as_dict()

    @router.post("/admin/jobs", responses=documented(400, 401, 403, 404), status_code=201)
    async def create_job(body: JobCreate):
        job, created = await asyncio.to_thread(jobs.enqueue, serving_domain(body.domain), "operator", {"by": "admin"})
        return {**job.as_dict(), "created": created}

    # -- Alertmanager webhook ---------------------------------------------------------------------------------------
    @router.post("/admin/alerts", responses=documented(400, 401, 403), status_code=202)
    async def alerts(payload: AlertmanagerPayload) -> AlertsAccepted:
        queued = await asyncio.to_thread(jobs_from_alerts, payload, jobs, set(known_domains()) - {OTHER})
        return AlertsAccepted(jobs=[{"id": j.id, "domain": j.domain, "status": j.status, "created": created}
                                    for j, created in queued])

    # -- traffic capture --------------------------------------------------------------------------------------------
    @router.get("/admin/capture", responses=documented(401, 403))
    async def capture_status():
        settings, counts = await asyncio.to_thread(lambda: (capture.settings(), capture.counts()))
        return {"data": [{"domain": d, **s.as_dict(), "captured": counts.get(d, 0)} for d, s in sorted(settings.items())]}

    @router.put("/admin/capture/{domain}", responses=documented(400, 401, 403, 404))
    async def configure_capture(domain: Domain, body: CaptureSettingsIn):
        settings = CaptureSettings(body.enabled, body.max_items, float(body.max_age_s), body.include_answers)
        await asyncio.to_thread(capture.configure, serving_domain(domain), settings)
        capture_book.refresh()
        return {"domain": domain, **settings.as_dict()}

    @router.delete("/admin/capture/{domain}/prompts", responses=documented(400, 401, 403, 404))
    async def delete_captured(domain: Domain):
        deleted = await asyncio.to_thread(capture.delete, domain)  # also a domain no longer served
        return {"domain": domain, "deleted": deleted}

    return router
