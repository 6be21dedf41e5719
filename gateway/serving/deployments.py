"""Which artifact version serves which domain, and switching versions without a restart.

The registry (calm_core/registry.py) says which version is active per domain (`*`: the global default). This module
keeps one served deployment (engine + CalibratedService) per version in use, re-reads the registry every few seconds
(a promotion made by the worker, the CLI or another replica reaches this one within that time) and swaps:

- the new version's engine is started first, off the event loop, while the old one keeps serving;
- then the route switches: requests that already hold the old deployment finish on it, new ones get the new one;
- a version no domain uses any more is closed once its last request is done (or after `drain_s`).

A domain's drift window restarts with the new version's reference histogram for that domain, so the drift gauge
compares live traffic with what the serving version expects. The engine is built by an injected loader (the gateway
imports no engine); without one only the configured version serves. Upstream, a version is loaded on every engine of the
fleet and checked before its route switches, and unloaded from them once retired.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from calm_core.artifact import LoadedArtifact, ReferenceHistogram
from calm_core.registry import GLOBAL, Registry

log = logging.getLogger("calm.gateway")

# (version, its folder) -> a started engine and the loaded artifact
VersionLoader = Callable[[str, Path], Awaitable[tuple[object, LoadedArtifact]]]


@dataclass
class Deployment:
    version: str
    service: object  # CalibratedService
    artifact: LoadedArtifact
    in_flight: int = 0


def reference_for(artifact: LoadedArtifact, domain: str) -> ReferenceHistogram | None:
    refs = artifact.manifest.reference_histograms
    return refs.get(domain) or refs.get("all") or (next(iter(refs.values())) if refs else None)


class Deployments:
    def __init__(self, default: Deployment, registry: Registry | None, make_service: Callable, monitor,
                 loader: VersionLoader | None = None, drain_s: float = 30.0, poll_s: float = 2.0):
        self.registry, self.make_service, self.monitor = registry, make_service, monitor
        self.loader, self.drain_s, self.poll_s = loader, drain_s, poll_s
        self.loaded: dict[str, Deployment] = {default.version: default}
        self.routes: dict[str, str] = {GLOBAL: default.version}
        self.problems: dict[str, str] = {}  # version -> why it could not be served
        self._lock = asyncio.Lock()
        self._retiring: set[asyncio.Task] = set()
        self._published: set[str] | None = None  # the serving list this replica last wrote to the registry folder
        self._export_versions()

    # -- routing ----------------------------------------------------------------------------------------------------
    def version_for(self, domain: str) -> str:
        return self.routes.get(domain) or self.routes[GLOBAL]

    def for_domain(self, domain: str) -> Deployment:
        return self.loaded[self.version_for(domain)]

    @property
    def default(self) -> Deployment:
        return self.loaded[self.routes[GLOBAL]]

    def describe(self) -> dict:
        return {"routes": dict(self.routes), "loaded": sorted(self.loaded), "problems": dict(self.problems)}

    # -- swapping ---------------------------------------------------------------------------------------------------
    async def sync(self) -> list[tuple[str, str, str]]:
        """Serve what the registry says; returns the (domain, old version, new version) switches made."""
        if self.registry is None:
            return []
        active = await asyncio.to_thread(self.registry.active)
        async with self._lock:
            for version in sorted(set(active.values()) - set(self.loaded)):
                await self._load(version)
            routes = {d: v for d, v in active.items() if v in self.loaded}
            routes.setdefault(GLOBAL, self.routes[GLOBAL])  # a default that could not load keeps the old one serving
            domains = set(self.monitor.known) | set(routes) - {GLOBAL}
            before = {d: self.version_for(d) for d in domains}
            self.routes = routes
            switched = [(d, before[d], self.version_for(d)) for d in sorted(domains) if before[d] != self.version_for(d)]
            for domain, _, new in switched:
                if domain in self.monitor.known:
                    self.monitor.set_reference(domain, reference_for(self.loaded[new].artifact, domain))
            for old in set(self.loaded) - set(self.routes.values()):
                self._retire(self.loaded.pop(old))
            await self._publish()
            if switched:
                self._export_versions()
                for domain, old, new in switched:
                    log.info("domain %s now served by %s (was %s)", domain, new, old)
            return switched

    async def _publish(self) -> None:
        """Keep the registry folder's serving list (an engine that restarts loads it before taking traffic) when what
        this replica serves changed; a failed write is logged, the routes stand."""
        serving = set(self.routes.values())
        if serving == self._published:
            return
        try:
            await asyncio.to_thread(self.registry.publish_served, serving)
            self._published = serving
        except OSError as e:
            log.error("could not write the serving list to the registry folder: %s", e)

    async def _load(self, version: str) -> None:
        if self.loader is None:
            self.problems[version] = "this gateway's engine serves one artifact (upstream engine): not loaded"
            return
        try:
            path = await asyncio.to_thread(self.registry.path_of, version)
            started = time.perf_counter()
            engine, artifact = await self.loader(version, path)
            self.loaded[version] = Deployment(version, self.make_service(engine, artifact), artifact)
            self.problems.pop(version, None)
            log.info("loaded artifact %s in %.1f s", version, time.perf_counter() - started)
        except Exception as e:  # a version that cannot load is reported; the current one keeps serving
            self.problems[version] = f"{type(e).__name__}: {e}"
            log.error("artifact %s could not be loaded: %s", version, e)

    def _retire(self, deployment: Deployment) -> None:
        async def drain_then_close():
            deadline = time.monotonic() + self.drain_s
            while deployment.in_flight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            retire = getattr(deployment.service.engine, "retire", None)
            if retire is not None:  # engines shared with other replicas: unload what no route here needs any more
                await retire()
            await deployment.service.engine.close()
            log.info("closed artifact %s", deployment.version)

        task = asyncio.get_running_loop().create_task(drain_then_close())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _export_versions(self) -> None:
        gauge = self.monitor.metrics.serving_version
        gauge.clear()
        for domain in sorted(set(self.monitor.known) | set(self.routes)):
            gauge.labels(domain, self.version_for(domain)).set(1)

    async def run(self) -> None:
        """Poll the registry until cancelled."""
        while True:
            try:
                await self.sync()
                self.monitor.metrics.registry_syncs.labels("ok").inc()
            except Exception as e:  # a database fault must not end the loop: the current routes keep serving
                self.monitor.metrics.registry_syncs.labels("error").inc()
                log.error("registry sync failed: %s", e)
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        for task in list(self._retiring):
            await task
        for deployment in list(self.loaded.values()):
            await deployment.service.engine.close()
        self.loaded.clear()
