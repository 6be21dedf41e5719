"""The retraining loop's config (configs/loop.toml) and its gate: a pure function of a candidate's and the serving
version's numbers deciding promote, operator or reject."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from calm_core.splits import SourceSpec
from calm_core.toml_config import load_toml_model
from training.retrain.free_form import FreeFormSettings
from training.retrain.labelled import JobMethod


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
    # candidate AUROC >= active's - this, on the same test questions and on the domain's uploaded labels (when enough):
    # a candidate may not buy a lower ECE with a worse ranking of right and wrong answers.
    auroc_tolerance: float = 0.02
    ece_tolerance: float = 0.0  # candidate ECE <= active's + this, on the domain's uploaded labels (when enough)
    # Without labels, on the domain's own captured traffic: the share of prompts whose chosen option stays the active
    # version's, and the Spearman correlation of the two versions' confidences on them (how far the candidate moved
    # what it answers and how it ranks its answers; docs/retraining-loop.md, "Reading a job's gate").
    min_choice_agreement: float = Field(0.95, ge=0, le=1)
    min_confidence_correlation: float = Field(0.9, ge=-1, le=1)
    min_feedback_labels: int = Field(50, ge=1)
    auto_promote_label_free: bool = False  # without enough labels: promote anyway (else the operator decides)
    # auto: the labelled map (training/retrain/labelled.py) where the domain has `min_recalibration_labels` uploaded
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
    """Every number the gate reads. Optional ones are absent from jobs recorded before they existed, or where they do
    not apply (no parent, no labels); the gate says which checks it skipped."""

    candidate_accuracy: float
    active_accuracy: float
    feedback_labels: int = 0
    candidate_feedback_ece: float | None = None
    active_feedback_ece: float | None = None
    candidate_auroc: float | None = None  # on the labelled test questions
    active_auroc: float | None = None
    choice_agreement: float | None = None  # on the captured traffic, label-free
    confidence_correlation: float | None = None
    candidate_feedback_auroc: float | None = None  # on the uploaded labels
    active_feedback_auroc: float | None = None


@dataclass(frozen=True)
class GateDecision:
    outcome: str  # promote | operator | reject
    reasons: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"outcome": self.outcome, "reasons": list(self.reasons)}


def _auroc_check(candidate: float | None, active: float | None, tolerance: float, on: str) -> tuple[bool, str] | None:
    """(passed, reason) of AUROC on one labelled set; None where either is undefined (every answer right or wrong)."""
    if candidate is None or active is None:
        return None
    passed = candidate >= active - tolerance
    return passed, (f"AUROC {candidate:.3f} {'>=' if passed else 'below'} the active version's {active:.3f} - "
                    f"{tolerance:g} on {on}")


def _movement(cfg: LoopConfig, m: GateInputs) -> tuple[list[str], list[str]]:
    """(failed, passed) reasons of the label-free checks on the captured traffic."""
    failed, passed = [], []
    if m.choice_agreement is not None:
        ok = m.choice_agreement >= cfg.min_choice_agreement
        (passed if ok else failed).append(
            f"chosen option kept on {m.choice_agreement:.1%} of the captured prompts "
            f"({'>=' if ok else 'below'} {cfg.min_choice_agreement:.0%})")
    if m.confidence_correlation is not None:
        ok = m.confidence_correlation >= cfg.min_confidence_correlation
        (passed if ok else failed).append(
            f"confidence ranking correlation {m.confidence_correlation:.3f} with the active version's on the captured "
            f"prompts ({'>=' if ok else 'below'} {cfg.min_confidence_correlation:g})")
    return failed, passed


def gate(cfg: LoopConfig, m: GateInputs) -> GateDecision:
    reasons = []
    floor = m.active_accuracy - cfg.accuracy_tolerance
    if m.candidate_accuracy < floor:
        return GateDecision("reject", (f"accuracy {m.candidate_accuracy:.3f} below the active version's "
                                       f"{m.active_accuracy:.3f} - {cfg.accuracy_tolerance:g}",))
    reasons.append(f"accuracy {m.candidate_accuracy:.3f} >= {floor:.3f} (active {m.active_accuracy:.3f})")
    tests = _auroc_check(m.candidate_auroc, m.active_auroc, cfg.auroc_tolerance, "the test questions")
    if tests is not None:
        if not tests[0]:
            return GateDecision("reject", (*reasons, tests[1]))
        reasons.append(tests[1])
    failed, passed = _movement(cfg, m)
    if failed:
        return GateDecision("reject", (*reasons, *passed, *failed))
    reasons += passed
    if m.feedback_labels >= cfg.min_feedback_labels:
        limit = m.active_feedback_ece + cfg.ece_tolerance
        if m.candidate_feedback_ece > limit:
            return GateDecision("reject", (*reasons, f"ECE {m.candidate_feedback_ece:.3f} on {m.feedback_labels} labels "
                                           f"above the active version's {m.active_feedback_ece:.3f}"))
        reasons.append(f"ECE {m.candidate_feedback_ece:.3f} <= {limit:.3f} on {m.feedback_labels} labels")
        labels = _auroc_check(m.candidate_feedback_auroc, m.active_feedback_auroc, cfg.auroc_tolerance,
                              f"{m.feedback_labels} labels")
        if labels is not None and not labels[0]:
            return GateDecision("reject", (*reasons, labels[1]))
        return GateDecision("promote", (*reasons, *([labels[1]] if labels else [])))
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
