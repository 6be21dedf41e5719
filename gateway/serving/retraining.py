"""The gateway's side of the retraining loop: traffic capture on the request path, and Alertmanager's webhook turned
into retraining jobs. The jobs themselves run in `calm worker`, another process, so serving latency never pays for
training.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from calm_core.capture import Capture, CaptureSettings
from calm_core.jobs import Job, JobQueue
from gateway.records.cached import CachedRead
from gateway.protocol.loop import AlertmanagerPayload

DRIFT_ALERTS = frozenset({"CalmConfidenceDrift"})  # the alerts that mean "recalibrate this domain"


class CaptureBook(CachedRead[dict]):
    """Capture settings cached from the store (the request path reads them), re-read every `max_age_s` so a change
    made through another replica applies here too; writes go to a thread and are awaited on shutdown."""

    def __init__(self, capture: Capture, max_age_s: float = 5.0, clock=time.monotonic):
        super().__init__(capture.settings, max_age_s, clock)
        self.capture = capture
        self._pending: set[asyncio.Future] = set()
        self.refresh()

    def settings_for(self, domain: str) -> CaptureSettings:
        return self.get().get(domain, CaptureSettings())

    def add(self, domain: str, kind: str, question: str, options: list[str] | None, answer: str | None) -> None:
        settings = self.settings_for(domain)
        if not settings.enabled:
            return
        write = asyncio.get_running_loop().run_in_executor(
            None, self.capture.add, domain, settings, [(kind, question, options, answer)])
        self._pending.add(write)
        write.add_done_callback(self._pending.discard)

    async def flush(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)


def jobs_from_alerts(payload: AlertmanagerPayload, queue: JobQueue, known_domains: set[str],
                     serving: Callable[[str], str | None]) -> tuple[list[tuple[Job, bool]], list[dict]]:
    """One retraining job per domain with a firing drift alert (an open job of that domain is reused), and one per
    alert episode (fingerprint and start): Alertmanager repeats an alert until Prometheus sees it resolve, which is
    after the job's candidate serves and the domain's window refills; a repeat then does not start another job.

    `serving`: the version the registry routes a domain to (`Registry.serving`). The shipped rule labels each alert with
    the version whose window it measured (`calm_serving_version_info`); an alert about a version the domain is no longer
    routed to is ignored. Without that, an alert that resolved for a moment (a failed scrape drops its series) fires
    again as a new episode while a just-promoted candidate is still starting, and the parent's window would retrain the
    candidate (seen once in the suite). The new version's own window starts empty, so its alert, if any, is a fresh one.
    Returns the jobs and the ignored alerts (domain, version, reason)."""
    queued, ignored = [], []
    for alert in payload.alerts:
        domain = alert.labels.get("domain")
        if alert.status != "firing" or alert.labels.get("alertname") not in DRIFT_ALERTS or domain not in known_domains:
            continue
        measured = alert.labels.get("version")
        if measured is not None and measured != (current := serving(domain)):
            ignored.append({"domain": domain, "version": measured,
                            "reason": f"the alert measured version {measured}; domain {domain!r} is now routed to "
                                      f"{current}, whose drift window starts afresh when it serves"})
            continue
        latest = next(iter(queue.list(domain, limit=1)), None)
        if (latest is not None and latest.trigger == "alert" and latest.detail.get("fingerprint") == alert.fingerprint
                and latest.detail.get("starts_at") == alert.startsAt):
            queued.append((latest, False))
            continue
        detail = {"alertname": alert.labels["alertname"], "starts_at": alert.startsAt,
                  "fingerprint": alert.fingerprint, "receiver": payload.receiver}
        queued.append(queue.enqueue(domain, "alert", detail))
    return queued, ignored
