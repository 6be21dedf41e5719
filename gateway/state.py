"""Everything the routers reach for, built once per app by `create_app` (nothing at import time)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from calm_core.capture import Capture
from calm_core.jobs import JobQueue
from calm_core.registry import Registry
from gateway.serving.deployments import Deployments
from gateway.edge.keys import KeyRing
from gateway.edge.limits import InFlight
from gateway.observe.monitoring import DomainMonitor, Metrics
from gateway.serving.service import SharedParts
from gateway.serving.retraining import CaptureBook
from gateway.settings import GatewaySettings
from gateway.records.store import Store
from gateway.edge.usage import EngineWork


@dataclass
class GatewayState:
    settings: GatewaySettings
    store: Store
    prometheus: CollectorRegistry
    metrics: Metrics
    monitor: DomainMonitor
    shared: SharedParts  # policies, guarantees, capture and the response writer, shared by every version
    deployments: Deployments
    artifacts: Registry
    jobs: JobQueue
    capture: Capture
    capture_book: CaptureBook
    keyring: KeyRing
    in_flight: InFlight
    usage: EngineWork  # engine sequences per key and minute, shared by the replicas on one database
