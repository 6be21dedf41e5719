"""A retraining job's labelled path. CALM's upper level maximises entropy, so label-free retraining can only lower
confidence; where a domain has enough labels, a job instead fits the post-hoc maps of `calm artifacts recalibrate`
(in seconds, no training), which move confidence either way: a temperature on the option scores for multiple choice,
on the answer's token log-probs for free form. A mode's labels are the questions operators uploaded for it and the
serving version's answers in it that feedback judged. Each mode with enough labels gets its map; each map's held-out
check (ECE must fall, AUROC must not) is its gate; the answers, hence the accuracy, cannot change."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from calm_core.data import MCQuestion, OpenQuestion
from calm_core.engine import EngineFactory
from calm_core.errors import CalmError
from calm_core.served_answers import JudgedChoice, JudgedConfidence
from training.evaluate import DatasetSpec
from training.recalibrate import RecalibrateConfig, run_recalibrate, run_recalibrate_free_form
from training.retrain.data import FREE_FORM, MULTIPLE_CHOICE, write_questions

JobMethod = Literal["auto", "label_free", "labelled"]
METHODS: tuple[str, ...] = get_args(JobMethod)


def job_method(requested: str, n_labels: int, min_labels: int, domain: str) -> str:
    """`label_free` or `labelled`: what the job asks for, or by the labels the domain has (`auto`)."""
    if requested not in METHODS:
        raise CalmError(f"a job's method is one of {METHODS}, not {requested!r}")
    if requested == "auto":
        return "labelled" if n_labels >= min_labels else "label_free"
    if requested == "labelled" and n_labels < min_labels:
        raise CalmError(f"{n_labels} labelled questions in domain {domain!r}; a labelled recalibration needs "
                        f"{min_labels} (upload them: POST /admin/labels/{domain})")
    return requested


@dataclass(frozen=True)
class DomainLabels:
    """A domain's labels per mode: questions uploaded with their answers, and the serving version's answers judged by
    feedback (their scores as served)."""

    multiple_choice: Sequence[MCQuestion] = ()
    judged_choices: Sequence[JudgedChoice] = ()
    free_form: Sequence[OpenQuestion] = ()
    judged_free_form: Sequence[JudgedConfidence] = ()

    def counts(self) -> dict[str, int]:
        return {MULTIPLE_CHOICE: len(self.multiple_choice) + len(self.judged_choices),
                FREE_FORM: len(self.free_form) + len(self.judged_free_form)}

    def modes(self, min_labels: int) -> list[str]:
        """The modes with enough labels for their map."""
        return [mode for mode, n in self.counts().items() if n >= min_labels]


def recalibrate_modes(parent_dir: Path, parent: str, labels: DomainLabels, domain: str, job_dir: Path,
                      min_labels: int, engines: EngineFactory | None) -> tuple[dict, bool]:
    """Each mode with enough labels gets its map, fitted on the parent as it serves and checked on a held-out third;
    the candidate (`job_dir/candidate`) carries every map, and is written only if every check passed. Returns the
    result (the free-form one under FREE_FORM when both modes were fitted, as a label-free job's) and whether the
    candidate was written."""
    out, results = job_dir / "candidate", {}
    modes = labels.modes(min_labels)
    if MULTIPLE_CHOICE in modes:
        file = write_questions(job_dir / "labels.jsonl", list(labels.multiple_choice))
        summary = run_recalibrate(RecalibrateConfig(str(parent_dir), DatasetSpec(str(file), "file"), domain, str(out)),
                                  raise_on_failure=False, judged=labels.judged_choices)
        results[MULTIPLE_CHOICE] = labelled_result(summary, parent, len(labels.multiple_choice),
                                                   len(labels.judged_choices))
    if FREE_FORM in modes and all("version" in r for r in results.values()):
        file = write_questions(job_dir / "labels-free-form.jsonl", list(labels.free_form))
        summary = run_recalibrate_free_form(
            RecalibrateConfig(str(parent_dir), DatasetSpec(str(file), "file"), domain, str(out)), engines,
            raise_on_failure=False, judged=labels.judged_free_form, onto_candidate=bool(results))
        results[FREE_FORM] = labelled_result(summary, parent, len(labels.free_form), len(labels.judged_free_form))
    written = all("version" in r for r in results.values())
    first = next(iter(results.values()))
    result = {**first, FREE_FORM: results[FREE_FORM]} if len(results) == 2 else first
    return {**result, "modes": list(results)}, written


def labelled_result(summary: dict, parent: str | None, uploaded: int, judged: int) -> dict:
    """One mode's map in the shape the gate and `calm jobs show` read: the held-out numbers before (the parent as it
    serves) and after (the candidate), the labels counting as the domain's feedback labels; `version` when written."""
    check = summary["check"]
    before = {"n": check["n"], "accuracy": check["accuracy"], "mean_confidence": check["mean_confidence_before"],
              "ece_10": check["ece_before"], "auroc": check["auroc_before"]}
    after = {**before, "mean_confidence": check["mean_confidence_after"], "ece_10": check["ece_after"],
             "auroc": check["auroc_after"]}
    inputs = {"candidate_accuracy": check["accuracy"], "active_accuracy": check["accuracy"],
              "feedback_labels": uploaded + judged, "candidate_feedback_ece": check["ece_after"],
              "active_feedback_ece": check["ece_before"]}
    temperature = {k: summary[k] for k in ("option_temperature", "token_temperature") if k in summary}
    return {"method": "labelled", "parent": parent, "labels": uploaded, "judged_answers": judged, "check": check,
            **temperature, "reason": summary["reason"], "in_domain": {"candidate": after, "active": before},
            "inputs": inputs, **({"version": summary["version"]} if "version" in summary else {})}
