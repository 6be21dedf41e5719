"""Abstention policies: per domain (and a default), a confidence threshold or a target risk, and an action.

A target risk r is turned into a threshold on the artifact's reference confidences: the smallest t whose selective
risk estimate 1 − E[conf | conf ≥ t] is at most r. That estimate needs no labels because the confidences are
calibrated (expected accuracy equals mean confidence); it is only as good as the calibration.

A target risk with a `delta` is a guarantee (`guaranteed_risk`): the threshold comes from the domain's labelled
answers by Learn-then-Test (calm_core/risk_control.py), so that with probability ≥ 1 − δ the answers let through are
wrong at most a share r of the time. Until `min_labels` verdicts exist the declared fallback applies.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictStr, model_validator

from gateway.protocol.common import StrictInt

from calm_core.risk_control import RiskFit, label_free_threshold

DEFAULT_DOMAIN = "default"


class Action(str, Enum):
    ABSTAIN = "abstain"
    ANNOTATE = "annotate"


class Fallback(str, Enum):
    LABEL_FREE = "label_free"  # the label-free threshold of the target risk
    ABSTAIN_ALL = "abstain_all"  # withhold every answer


class Policy(BaseModel):
    # The cross-field rules of `_one_rule`, also in the JSON schema (so a schema-valid policy is never refused).
    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["threshold"], "properties": {"threshold": {"type": "number"}, "target_risk": {"type": "null"},
                                                   "delta": {"type": "null"}}},
        {"required": ["target_risk"], "properties": {"target_risk": {"type": "number"}, "threshold": {"type": "null"}}},
    ]})

    threshold: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    target_risk: StrictFloat | None = Field(default=None, gt=0.0, lt=1.0)
    delta: StrictFloat | None = Field(default=None, gt=0.0, lt=1.0)  # with target_risk: a guarantee from labels
    min_labels: StrictInt = Field(default=300, ge=10, le=1_000_000)
    fallback: Fallback = Fallback.LABEL_FREE
    action: Action = Action.ANNOTATE
    message: StrictStr = Field(default="I'm not confident enough to answer this.", max_length=2000)
    confidence: Literal["token", "semantic"] = "token"  # free-form estimator for the domain (a request overrides)
    samples: StrictInt = Field(default=8, ge=2, le=32)  # semantic: answers sampled per request

    @model_validator(mode="after")
    def _one_rule(self):
        if (self.threshold is None) == (self.target_risk is None):
            raise ValueError("give exactly one of `threshold` or `target_risk`")
        if self.delta is not None and self.target_risk is None:
            raise ValueError("`delta` goes with `target_risk` (a guaranteed risk)")
        return self

    @property
    def kind(self) -> str:
        if self.threshold is not None:
            return "threshold"
        return "guaranteed_risk" if self.delta is not None else "target_risk"


threshold_for_risk = label_free_threshold


class ResolvedPolicy(BaseModel):
    name: str  # e.g. "medicine:v3" or "builtin"
    threshold: float
    action: Action
    message: str
    state: str | None = None  # guaranteed_risk: "guaranteed", or which fallback applies and why
    abstain_all: bool = False  # every answer is below the bar (no threshold keeps the promise yet)

    def below(self, confidence: float) -> bool:
        return self.abstain_all or confidence < self.threshold


def resolve(
    policy: Policy | None,
    name: str,
    reference: tuple[list[float], list[int]] | None,
    requested_threshold: float | None,
    fit: RiskFit | None = None,
) -> ResolvedPolicy:
    """The effective rule for one request. A request may tighten the threshold, never loosen it. `fit` is the domain's
    latest guaranteed fit (guaranteed_risk policies)."""
    state, abstain_all = None, False
    if policy is None:
        base, action, message = 0.0, Action.ANNOTATE, Policy.model_fields["message"].default
        name = "builtin"
    else:
        label_free = label_free_threshold(*reference, policy.target_risk) if reference and policy.target_risk else 1.0
        if policy.threshold is not None:
            base = policy.threshold
        elif policy.delta is None:
            base = label_free  # without reference data, refuse to answer rather than guess
        elif fit is not None and fit.n_labels >= policy.min_labels:
            base, abstain_all = (fit.threshold, False) if fit.threshold is not None else (1.0, True)
            state = f"guaranteed ({fit.n_labels} labels)" + ("" if fit.threshold is not None else
                                                             ": no threshold keeps the promise, abstaining on every answer")
        else:
            have = fit.n_labels if fit is not None else 0
            abstain_all = policy.fallback is Fallback.ABSTAIN_ALL
            base = 1.0 if abstain_all else label_free
            state = f"fallback {policy.fallback.value} ({have} of {policy.min_labels} labels)"
        action, message = policy.action, policy.message
    threshold = max(base, requested_threshold) if requested_threshold is not None else base
    return ResolvedPolicy(name=name, threshold=threshold, action=action, message=message, state=state,
                          abstain_all=abstain_all)
