"""The retraining loop's API models: Alertmanager's webhook, jobs, promotions, traffic capture (pydantic only)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictStr, StringConstraints

from calm_core.domains import DOMAIN_NAME, DOMAIN_OR_GLOBAL
from gateway.protocol.common import StrictInt


class AlertmanagerAlert(BaseModel):
    """One alert of Alertmanager's webhook payload (version 4); fields the gateway does not use are ignored."""

    model_config = ConfigDict(extra="ignore")

    status: Literal["firing", "resolved"]
    labels: dict[StrictStr, StrictStr]
    annotations: dict[StrictStr, StrictStr] = {}
    startsAt: StrictStr | None = None
    endsAt: StrictStr | None = None
    fingerprint: StrictStr | None = None


class AlertmanagerPayload(BaseModel):
    model_config = ConfigDict(extra="ignore")

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    receiver: StrictStr
    alerts: list[AlertmanagerAlert] = Field(max_length=1000)


class AlertsAccepted(BaseModel):
    jobs: list[dict]  # {id, domain, status, created}: created false when the domain's open job was reused
    ignored: list[dict] = []  # {domain, version, reason}: alerts about a version the domain is no longer routed to


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    domain: Annotated[str, StringConstraints(strict=True, pattern=DOMAIN_NAME)]
    # auto: the labelled map where the domain has enough uploaded labels, else label-free CALM (the loop config's rule)
    method: Literal["auto", "label_free", "labelled"] | None = None


class Promotion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    domain: Annotated[str, StringConstraints(strict=True, pattern=DOMAIN_OR_GLOBAL)] = "*"


class CaptureSettingsIn(BaseModel):
    """Traffic capture of one domain: off unless enabled; bounded by count and age; answers only if asked for."""

    model_config = ConfigDict(extra="forbid")

    enabled: StrictBool
    max_items: StrictInt = Field(default=5000, ge=1, le=1_000_000)
    max_age_s: StrictFloat = Field(default=7 * 24 * 3600.0, gt=0, le=366 * 24 * 3600.0)
    include_answers: StrictBool = False
