"""The gateway's side of the retraining loop: traffic capture on the request path, and Alertmanager's webhook turned
into retraining jobs. The jobs themselves run in `calm worker`, another process, so serving latency never pays for
training.
"""

from __future__ import annotations

import asyncio
import time

from calm_core.capture import Capture, CaptureSettings
from calm_core.jobs import Job, JobQueue
from gateway.cached import CachedRead
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


def jobs_from_alerts(payload: AlertmanagerPayload, queue: JobQueue, known_domains: set[str]) -> list[tuple[Job, bool]]:
    """One retraining job per domain with a firing drift alert (an open job of that domain is reused), and one per
    alert episode (fingerprint and start): Alertmanager repeats an alert until Prometheus sees it resolve, which is
    after the job's candidate serves and the domain's window refills; a repeat then does not start another job."""
    queued = []
    for alert in payload.alerts:
        domain = alert.labels.get("domain")
        if alert.status != "firing" or alert.labels.get("alertname") not in DRIFT_ALERTS or domain not in known_domains:
            continue
        latest = next(iter(queue.list(domain, limit=1)), None)
        if (latest is not None and latest.trigger == "alert" and latest.detail.get("fingerprint") == alert.fingerprint
                and latest.detail.get("starts_at") == alert.startsAt):
            queued.append((latest, False))
            continue
        detail = {"alertname": alert.labels["alertname"], "starts_at": alert.startsAt,
                  "fingerprint": alert.fingerprint, "receiver": payload.receiver}
        queued.append(queue.enqueue(domain, "alert", detail))
    return queued
