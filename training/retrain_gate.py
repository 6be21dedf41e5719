"""The retraining loop's config (configs/loop.toml) and its gate: a pure function of a candidate's and the serving
version's numbers deciding promote, operator or reject."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from calm_core.splits import SourceSpec
from calm_core.toml_config import load_toml_model
from training.retrain_free_form import FreeFormSettings
from training.retrain_labelled import JobMethod


class LoopConfig(BaseModel):
    """configs/loop.toml: what a retraining job trains and how its candidate is judged."""

    model_config = ConfigDict(extra="forbid")

    train_config: str = "configs/train/loop.toml"  # method and schedule; its split's train role is the labelled set
    # Free-form traffic: generative CALM's config (its split's train role: gold short answers; the LoRA shape of the
    # serving version's free-form mode).
    free_form_train_config: str = "configs/train/loop-open.toml"
    runs_dir: str = "runs/jobs"
    min_prompts: int = Field(30, ge=1)  # fewer captured prompts of either kind: the job waits, then fails saying so
    # How long after it was queued a label-free job waits for its domain's captured prompts to reach `min_prompts`:
    # a drift alert fires on the first shifted answers, while the traffic it is about is still arriving.
    capture_wait_s: float = Field(600.0, ge=0)
    max_prompts: int = Field(2000, ge=1)  # the newest ones are used
    accuracy_tolerance: float = 0.02  # candidate accuracy >= active's - this, on the domain's labelled test questions
    ece_tolerance: float = 0.0  # candidate ECE <= active's + this, on the domain's uploaded labels (when enough)
    min_feedback_labels: int = Field(50, ge=1)
    auto_promote_label_free: bool = False  # without enough labels: promote anyway (else the operator decides)
    # auto: the labelled map (training/retrain_labelled.py) where the domain has `min_recalibration_labels` uploaded
    # labelled questions, else label-free CALM; a job may ask for either (POST /admin/jobs {"method": ...}).
    method: JobMethod = "auto"
    min_recalibration_labels: int = Field(100, ge=10)
    # Continue from the version serving the domain (its adapter and head) rather than from the base model: a retrain
    # adjusts what serves to the domain's traffic in a few steps instead of relearning it. Needs the training config's
    # LoRA shape to be the parent's.
    warm_start: bool = True
    # Per domain: labelled in-domain test questions (multiple choice for the multiple-choice mode, open-ended for the
    # free-form mode). A domain without them for a mode uses that mode's training split's in-domain tests.
    test_sets: dict[str, list[SourceSpec]] = {}

    @model_validator(mode="after")
    def _prompt_bounds(self) -> "LoopConfig":
        if self.max_prompts < self.min_prompts:  # no job could ever have enough
            raise ValueError(f"max_prompts ({self.max_prompts}) is below min_prompts ({self.min_prompts})")
        return self

    def free_form(self, domain: str) -> FreeFormSettings:
        return FreeFormSettings(self.free_form_train_config, self.min_prompts, self.max_prompts,
                                self.min_feedback_labels, self.warm_start,
                                [s for s in self.test_sets.get(domain, []) if s.is_open])


def load_loop_config(path: str | Path, **overrides) -> LoopConfig:
    return load_toml_model(path, LoopConfig, "loop config", **overrides)


# -- the gate (pure) -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateInputs:
    candidate_accuracy: float
    active_accuracy: float
    feedback_labels: int = 0
    candidate_feedback_ece: float | None = None
    active_feedback_ece: float | None = None


@dataclass(frozen=True)
class GateDecision:
    outcome: str  # promote | operator | reject
    reasons: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"outcome": self.outcome, "reasons": list(self.reasons)}


def gate(cfg: LoopConfig, m: GateInputs) -> GateDecision:
    reasons = []
    floor = m.active_accuracy - cfg.accuracy_tolerance
    if m.candidate_accuracy < floor:
        return GateDecision("reject", (f"accuracy {m.candidate_accuracy:.3f} below the active version's "
                                       f"{m.active_accuracy:.3f} - {cfg.accuracy_tolerance:g}",))
    reasons.append(f"accuracy {m.candidate_accuracy:.3f} >= {floor:.3f} (active {m.active_accuracy:.3f})")
    if m.feedback_labels >= cfg.min_feedback_labels:
        limit = m.active_feedback_ece + cfg.ece_tolerance
        if m.candidate_feedback_ece > limit:
            return GateDecision("reject", (*reasons, f"ECE {m.candidate_feedback_ece:.3f} on {m.feedback_labels} labels "
                                           f"above the active version's {m.active_feedback_ece:.3f}"))
        reasons.append(f"ECE {m.candidate_feedback_ece:.3f} <= {limit:.3f} on {m.feedback_labels} labels")
        return GateDecision("promote", tuple(reasons))
    reasons.append(f"{m.feedback_labels} labels of the domain (< {cfg.min_feedback_labels}): label-free")
    if cfg.auto_promote_label_free:
        return GateDecision("promote", (*reasons, "auto_promote_label_free is set"))
    return GateDecision("operator", (*reasons, "promotion is the operator's call (calm artifacts promote)"))


def both(multiple_choice: GateDecision, free_form: GateDecision) -> GateDecision:
    """A candidate with both modes retrained: the stricter outcome, with each mode's reasons."""
    order = ("promote", "operator", "reject")
    outcome = max(multiple_choice.outcome, free_form.outcome, key=order.index)
    return GateDecision(outcome, (*(f"multiple choice: {r}" for r in multiple_choice.reasons),
                                  *(f"free form: {r}" for r in free_form.reasons)))
