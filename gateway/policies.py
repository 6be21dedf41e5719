"""Abstention policies: per domain (and a default), a confidence threshold or a target risk, and an action.

A target risk r is turned into a threshold on the artifact's reference confidences: the smallest t whose selective
risk estimate 1 − E[conf | conf ≥ t] is at most r. That estimate needs no labels because the confidences are
calibrated (expected accuracy equals mean confidence); it is only as good as the calibration.
"""

from __future__ import annotations

from enum import Enum

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_DOMAIN = "default"


class Action(str, Enum):
    ABSTAIN = "abstain"
    ANNOTATE = "annotate"


class Policy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    target_risk: float | None = Field(default=None, gt=0.0, lt=1.0)
    action: Action = Action.ANNOTATE
    message: str = Field(default="I'm not confident enough to answer this.", max_length=2000)

    @model_validator(mode="after")
    def _one_rule(self):
        if (self.threshold is None) == (self.target_risk is None):
            raise ValueError("give exactly one of `threshold` or `target_risk`")
        return self

    @property
    def kind(self) -> str:
        return "threshold" if self.threshold is not None else "target_risk"


def threshold_for_risk(edges, counts, target_risk: float) -> float:
    """Smallest bin edge t with estimated selective risk 1 − mean(conf | conf ≥ t) ≤ target_risk; 1.0 if none."""
    edges = np.asarray(edges, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    centers = (edges[:-1] + edges[1:]) / 2
    for b in range(counts.size):
        kept = counts[b:]
        if kept.sum() == 0:
            break
        risk = 1.0 - float((centers[b:] * kept).sum() / kept.sum())
        if risk <= target_risk:
            return float(edges[b])
    return 1.0


class ResolvedPolicy(BaseModel):
    name: str  # e.g. "medicine:v3" or "builtin"
    threshold: float
    action: Action
    message: str


def resolve(
    policy: Policy | None,
    name: str,
    reference: tuple[list[float], list[int]] | None,
    requested_threshold: float | None,
) -> ResolvedPolicy:
    """The effective rule for one request. A request may tighten the threshold, never loosen it."""
    if policy is None:
        base, action, message = 0.0, Action.ANNOTATE, Policy.model_fields["message"].default
        name = "builtin"
    else:
        if policy.threshold is not None:
            base = policy.threshold
        elif reference is not None:
            base = threshold_for_risk(*reference, policy.target_risk)
        else:
            base = 1.0  # no reference data to honour the target risk: refuse to answer rather than guess
        action, message = policy.action, policy.message
    threshold = max(base, requested_threshold) if requested_threshold is not None else base
    return ResolvedPolicy(name=name, threshold=threshold, action=action, message=message)
