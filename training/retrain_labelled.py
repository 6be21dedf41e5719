"""A retraining job's labelled path. CALM's upper level maximises entropy, so label-free retraining can only lower
confidence; where a domain has enough labelled questions, a job instead fits the post-hoc map of `calm artifact
recalibrate` (a temperature on the option scores, in seconds, no training), which moves confidence either way. Its
held-out check (ECE must fall, AUROC must not) is the gate; the accuracy cannot change."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

from calm_core.data import MCQuestion
from calm_core.errors import CalmError
from calm_core.served_answers import JudgedChoice
from training.evaluate import DatasetSpec
from training.recalibrate import RecalibrateConfig, run_recalibrate

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


def recalibrate_for_job(parent_dir: Path, labels_file: Path, domain: str, out: Path,
                        judged: Sequence[JudgedChoice] = ()) -> dict:
    """The map fitted on the domain's labels (uploaded questions and answers judged by feedback) and checked on a
    held-out third; `version` in the result only when the check passed and the candidate was written to `out`."""
    return run_recalibrate(RecalibrateConfig(str(parent_dir), DatasetSpec(str(labels_file), "file"), domain, str(out)),
                           raise_on_failure=False, judged=judged)


def labelled_result(summary: dict, parent: str | None, labelled: list[MCQuestion],
                    judged: Sequence[JudgedChoice] = ()) -> dict:
    """The job's result in the shape the gate and `calm jobs show` read: the held-out numbers before (the parent as it
    serves) and after (the candidate), the labels counting as the domain's feedback labels."""
    check = summary["check"]
    before = {"n": check["n"], "accuracy": check["accuracy"], "mean_confidence": check["mean_confidence_before"],
              "ece_10": check["ece_before"], "auroc": check["auroc_before"]}
    after = {**before, "mean_confidence": check["mean_confidence_after"], "ece_10": check["ece_after"],
             "auroc": check["auroc_after"]}
    inputs = {"candidate_accuracy": check["accuracy"], "active_accuracy": check["accuracy"],
              "feedback_labels": len(labelled) + len(judged), "candidate_feedback_ece": check["ece_after"],
              "active_feedback_ece": check["ece_before"]}
    return {"method": "labelled", "parent": parent, "labels": len(labelled), "judged_answers": len(judged), "check": check,
            "option_temperature": summary.get("option_temperature"), "reason": summary["reason"],
            "in_domain": {"candidate": after, "active": before}, "inputs": inputs}

