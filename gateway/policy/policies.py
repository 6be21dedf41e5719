"""Abstention policies: per domain (and a default), a confidence threshold or a target risk, and an action.

A target risk r is turned into a threshold on the artifact's reference confidences: the smallest t whose selective
risk estimate 1 − E[conf | conf ≥ t] is at most r. That estimate needs no labels because the confidences are
calibrated (expected accuracy equals mean confidence); it is only as good as the calibration.

Below the threshold the action applies: `annotate` (the answer is served, marked below), `abstain` (the policy's
message instead), `escalate` (the original request goes to a stronger OpenAI-compatible model, gateway/serving/escalation.py)
or `review` (the answer goes to a review queue, the caller gets the message and a review id, gateway/records/handoff_store.py).

A target risk with a `delta` is a guarantee (`guaranteed_risk`): the threshold comes from the domain's labelled
answers by Learn-then-Test (calm_core/risk_control.py), so that with probability ≥ 1 − δ the answers let through are
wrong at most a share r of the time. Until `min_labels` verdicts exist the declared fallback applies.
"""

from __future__ import annotations

from enum import Enum
from functools import lru_cache
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictStr, ValidationInfo, model_validator
from pydantic.json_schema import SkipJsonSchema

from gateway.protocol.common import StrictInt
from gateway.policy.targets import TARGET_NAME, Targets

from calm_core.risk_control import RiskFit, label_free_threshold

DEFAULT_DOMAIN = "default"


class Action(str, Enum):
    ABSTAIN = "abstain"
    ANNOTATE = "annotate"
    ESCALATE = "escalate"
    REVIEW = "review"

    @property
    def withholds(self) -> bool:
        """The first model's answer is not shown below the threshold, so none may stream before the decision."""
        return self is not Action.ANNOTATE


# Fields a policy stored before targets were the operator's may hold (63); a policy written now may not.
_OPERATOR_FIELDS = frozenset({"url", "api_key_env", "api_key_file", "protocol"})
_STORED = "stored"  # validation context: a policy read back from the database, not one an admin sends


def stored_policy(body: dict) -> "Policy":
    """A policy as the database holds it: one written before targets were named keeps its URL as `legacy_url` (only a
    URL the operator also lists in CALM_TARGETS is ever called), so nothing stored is lost or refused."""
    return Policy.model_validate(body, context={_STORED: True})


# The URL a policy stored before 63 named (a target or a webhook): kept, shown, never accepted from an admin.
_LegacyUrl = Annotated[SkipJsonSchema[StrictStr | None], Field(exclude_if=lambda v: v is None)]


def _stored(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get(_STORED))


class EscalationTarget(BaseModel):
    """Where an unsure answer's request goes: one of the operator's targets by name (gateway/policy/targets.py: its URL, key
    and protocol are the operator's), the model asked there, and what to do when it fails."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"required": ["target", "model"]})

    target: StrictStr | None = Field(default=None, pattern=TARGET_NAME)
    model: StrictStr = Field(min_length=1, max_length=256)
    timeout_s: StrictFloat = Field(default=30.0, gt=0.0, le=600.0)  # the whole call; then `on_failure` applies
    on_failure: Literal["annotate", "abstain"] = "annotate"
    legacy_url: _LegacyUrl = None

    @model_validator(mode="before")
    @classmethod
    def _operator_fields(cls, data, info: ValidationInfo):
        if not isinstance(data, dict) or not (_OPERATOR_FIELDS | {"legacy_url"}) & data.keys():
            return data
        if not _stored(info):
            raise ValueError("escalation targets are the operator's: name one with `target` (CALM_TARGETS); `url`, "
                             "`api_key_env`, `api_key_file` and `protocol` are set there, not in a policy")
        rest = {k: v for k, v in data.items() if k not in _OPERATOR_FIELDS}
        return {**rest, "legacy_url": data.get("url", data.get("legacy_url"))}

    @model_validator(mode="after")
    def _named(self):
        if self.target is None and self.legacy_url is None:
            raise ValueError("name the escalation target with `target` (one of the operator's, CALM_TARGETS)")
        return self


class ReviewTarget(BaseModel):
    """Besides the database queue (GET /admin/reviews), each new review can be posted to a webhook: one of the
    operator's targets by name."""

    model_config = ConfigDict(extra="forbid")

    webhook: StrictStr | None = Field(default=None, pattern=TARGET_NAME)
    timeout_s: StrictFloat = Field(default=5.0, gt=0.0, le=60.0)
    legacy_url: _LegacyUrl = None

    @model_validator(mode="before")
    @classmethod
    def _operator_url(cls, data, info: ValidationInfo):
        hook = data.get("webhook") if isinstance(data, dict) else None
        url_hook = isinstance(hook, str) and "://" in hook
        if not url_hook and not (isinstance(data, dict) and "legacy_url" in data):
            return data
        if not _stored(info):
            raise ValueError("review webhooks are the operator's: name one of the targets set in CALM_TARGETS")
        if not url_hook:
            return data  # as the gateway stored it: a name, or the legacy URL it kept
        rest = {k: v for k, v in data.items() if k != "webhook"}
        return {**rest, "legacy_url": data.get("legacy_url") or hook}


class Fallback(str, Enum):
    LABEL_FREE = "label_free"  # the label-free threshold of the target risk
    ABSTAIN_ALL = "abstain_all"  # withhold every answer


class Policy(BaseModel):
    # The cross-field rules of `_one_rule`, also in the JSON schema (so a schema-valid policy is never refused).
    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["threshold"], "properties": {"threshold": {"type": "number"}, "target_risk": {"type": "null"},
                                                   "delta": {"type": "null"}}},
        {"required": ["target_risk"], "properties": {"target_risk": {"type": "number"}, "threshold": {"type": "null"}}},
    ], "allOf": [
        {"if": {"required": ["action"], "properties": {"action": {"const": "escalate"}}},
         "then": {"required": ["escalate"], "properties": {"escalate": {"type": "object"}}}},
        {"if": {"required": ["escalate"], "properties": {"escalate": {"type": "object"}}},
         "then": {"required": ["action"], "properties": {"action": {"const": "escalate"}}}},
        {"if": {"required": ["review"], "properties": {"review": {"type": "object"}}},
         "then": {"required": ["action"], "properties": {"action": {"const": "review"}}}},
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
    escalate: EscalationTarget | None = None  # action escalate: where unsure answers go
    review: ReviewTarget | None = None  # action review: an optional webhook beside the database queue

    @model_validator(mode="after")
    def _one_rule(self):
        if (self.threshold is None) == (self.target_risk is None):
            raise ValueError("give exactly one of `threshold` or `target_risk`")
        if self.delta is not None and self.target_risk is None:
            raise ValueError("`delta` goes with `target_risk` (a guaranteed risk)")
        if (self.action is Action.ESCALATE) != (self.escalate is not None):
            raise ValueError("action `escalate` needs an `escalate` target, and an `escalate` target needs that action")
        if self.review is not None and self.action is not Action.REVIEW:
            raise ValueError("a `review` target goes with action `review`")
        return self

    @property
    def kind(self) -> str:
        if self.threshold is not None:
            return "threshold"
        return "guaranteed_risk" if self.delta is not None else "target_risk"


def unknown_target(policy: Policy, targets: Targets) -> tuple[str, str] | None:
    """(param, why) when a policy names a target the operator does not list (an admin's write is refused then)."""
    for param, name, kind in (("escalate.target", policy.escalate and policy.escalate.target, "escalate"),
                              ("review.webhook", policy.review and policy.review.webhook, "webhook")):
        why = targets.unknown(name, kind) if name else None
        if why is not None:
            return param, why
    return None


threshold_for_risk = label_free_threshold


class ResolvedPolicy(BaseModel):
    name: str  # e.g. "medicine:v3" or "builtin"
    threshold: float
    action: Action
    message: str
    state: str | None = None  # guaranteed_risk: "guaranteed", or which fallback applies and why
    abstain_all: bool = False  # every answer is below the bar (no threshold keeps the promise yet)
    escalate: EscalationTarget | None = None
    review: ReviewTarget | None = None

    def below(self, confidence: float) -> bool:
        return self.abstain_all or confidence < self.threshold


@lru_cache(maxsize=256)
def _label_free(edges: tuple, counts: tuple, target_risk: float) -> float:
    """The label-free threshold of a reference histogram, once per histogram and target (it is read per request)."""
    return label_free_threshold(edges, counts, target_risk)


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
        label_free = (_label_free(tuple(reference[0]), tuple(reference[1]), policy.target_risk)
                      if reference and policy.target_risk else 1.0)
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
                          abstain_all=abstain_all, escalate=policy.escalate if policy else None,
                          review=policy.review if policy else None)
