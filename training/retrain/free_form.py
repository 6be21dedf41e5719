"""A retraining job's free-form stage: generative CALM on the domain's captured free-form prompts.

The upper level needs nothing but prompts (the entropy is taken at the model's own greedy answers), so captured
chat traffic without options is a calibration set as it stands. The stage scores the mode serving the domain as the
gateway serves it (vLLM, the engine factory the caller passes) on the captured prompts and the domain's labelled
free-form questions: the loop config's open-ended test sets (or the training split's) for accuracy, and the questions
uploaded through /admin/labels (alias answers) for ECE, when the domain has enough of them. Its greedy answers to the
captured prompts are the answers training takes the entropy at: the new mode is warm-started from that one (its
adapter and head), so they are the starting weights' own, and the trainer does not generate them again. Then it
trains with the loop's free-form training config and scores the candidate the same way. The candidate's token
confidences on the domain's captured prompts (read again when it is judged) become the domain's reference histogram.

The parent's semantic-confidence map is kept: it maps the agreement of answers sampled *without* the head, and the
stage moves the weights by a tiny θ step at most (the training config's lr_theta), so the samples it was fitted on are
the new mode's too. A labelled token temperature is not kept: it was fitted to the old head.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from calm_core.atomic import atomic_write_text
from calm_core.artifact import FREE_FORM_DIR, load_artifact, update_manifest
from calm_core.capture import CapturedPrompt
from calm_core.data import OpenQuestion, load_open_file
from calm_core.engine import EngineFactory
from calm_core.errors import CalmError
from calm_core.label_free import ChoiceMovement, confidence_correlation
from calm_core.models import resolve_model
from calm_core.splits import SourceSpec, load_split, materialize
from training.config import TrainConfig, load_config
from training.generative import calibration_targets
from training.free_form_eval import FreeFormRecord, evaluate_sets, free_form_metrics
from training.retrain.data import captured_open_questions, job_split, labelled_open_questions, write_questions


@dataclass(frozen=True)
class FreeFormSettings:
    """What the stage reads from the loop config (training/retrain/worker.py's LoopConfig)."""

    train_config: str
    min_prompts: int
    max_prompts: int
    min_feedback_labels: int
    warm_start: bool
    tests: list[SourceSpec]  # the domain's open-ended test sets (may be empty)


@dataclass(frozen=True)
class FreeFormCandidate:
    artifact: Path  # the trained free-form mode (applies_to free_form)
    result: dict  # in_domain / labels / inputs, in the shape the gate reads
    captured_confidences: np.ndarray  # its token confidences on the captured prompts


def metrics_of(records: list[FreeFormRecord]) -> dict:
    """The gate's metrics of one set (AUROC is None where undefined, so the result stays valid JSON)."""
    m = free_form_metrics(records)
    return {k: (float(m[k]) if np.isfinite(m[k]) else None) for k in ("n", "accuracy", "mean_confidence", "ece_10",
                                                                      "auroc", "brier")}


def answer_movement(active: list[FreeFormRecord], candidate: list[FreeFormRecord]) -> ChoiceMovement:
    """Label-free, on the captured prompts both were judged on (paired by question): the share whose greedy answer
    stays the active mode's, and the rank correlation of the two modes' token confidences."""
    theirs = {r.id: r for r in candidate}
    pairs = [(a, theirs[a.id]) for a in active if a.id in theirs]
    same = float(np.mean([a.text.strip() == c.text.strip() for a, c in pairs])) if pairs else 1.0
    return ChoiceMovement(same, confidence_correlation([a.token_confidence for a, _ in pairs],
                                                       [c.token_confidence for _, c in pairs]))


def active_records(engines: EngineFactory, model_path: str, mode: Path, sets: dict[str, list[OpenQuestion]],
                   path: Path) -> dict[str, list[FreeFormRecord]]:
    """The active mode's records of each set, kept in the job's folder: a resumed job judges it again only where the
    mode or a set changed since (labels uploaded meanwhile, another version serving the domain)."""
    judged = {"mode": str(mode), "sets": {name: [[q.id, q.question, list(q.answers)] for q in qs]
                                          for name, qs in sets.items()}}
    if path.is_file():
        kept = json.loads(path.read_text())
        if kept.get("judged") == judged:
            return {name: [FreeFormRecord(**r) for r in recs] for name, recs in kept["records"].items()}
    records = evaluate_sets(engines, model_path, mode, sets, 0)
    atomic_write_text(path, json.dumps({"judged": judged,
                                        "records": {name: [asdict(r) for r in recs] for name, recs in records.items()}}))
    return records


def write_answers(path: Path, records: list[FreeFormRecord]) -> Path:
    """Question id -> the greedy answer's token ids as served (TrainConfig's `calibration_answers`)."""
    atomic_write_text(path, json.dumps({r.id: r.token_ids for r in records if r.token_ids is not None}))
    return path


def calibration_file(settings: FreeFormSettings, prompts: list[CapturedPrompt], domain: str, work: Path) -> Path:
    """The newest captured free-form prompts, written once (a resumed job keeps the prompts it started with)."""
    path = work / "calibration.jsonl"
    if path.is_file():
        return path
    questions = captured_open_questions(prompts, domain)[-settings.max_prompts:]
    if len(questions) < settings.min_prompts:
        raise CalmError(f"{len(questions)} captured free-form prompts in domain {domain!r}; the job needs "
                        f"{settings.min_prompts} (enable capture: PUT /admin/capture/{domain})")
    return write_questions(path, questions)


def retrain_free_form(settings: FreeFormSettings, job_dir: Path, domain: str, parent_mode: Path | None,
                      prompts: list[CapturedPrompt], model: str | None, engines: EngineFactory,
                      train: Callable[[TrainConfig], Path], note: Callable[[str, str | None], None],
                      latest: Callable[[], list[CapturedPrompt]] | None = None) -> FreeFormCandidate:
    """`parent_mode`: the serving version's free-form mode (None: the base model); `prompts`: the domain's capture
    when the job started (its calibration set); `latest` reads it again when the
    candidate is judged, for the reference histogram: a drift alert fires on a half-full window, so traffic is still
    arriving while the job trains, and a reference of the first few dozen prompts is mostly sampling noise."""
    work = job_dir / FREE_FORM_DIR
    work.mkdir(parents=True, exist_ok=True)
    calib = calibration_file(settings, prompts, domain, work)
    train_cfg = load_config(settings.train_config, out_dir=str(work / "run"), model=model)
    split_path = job_split(train_cfg.split, domain, calib, work / "split.toml", settings.tests or None, open_ended=True)
    start = str(parent_mode) if parent_mode is not None and settings.warm_start else None
    train_cfg = train_cfg.model_copy(update={"split": str(split_path), "init_from": start})
    captured = load_open_file(calib)
    model_path = str(resolve_model(train_cfg.model).path)
    tests = materialize(load_split(split_path)).role("test_in_domain")
    labels = labelled_open_questions(prompts, domain)
    judged = labels if len(labels) >= settings.min_feedback_labels and parent_mode is not None else []
    judged_sets = {"tests": tests, "labels": judged, "captured": captured}
    # The active mode is judged first: its greedy answers to the calibration prompts are the upper level's answers
    # when training starts from its weights, so the trainer does not generate them again.
    active = None
    if parent_mode is not None:
        note(f"free form: scoring the serving mode {parent_mode.parent.name} before training", None)  # preparing
        active = active_records(engines, model_path, parent_mode, judged_sets, work / "active-records.json")
    if active is not None and start is not None:
        answers = write_answers(work / "calibration-answers.json", active["captured"])
        train_cfg = train_cfg.model_copy(update={"calibration_answers": str(answers)})
    note(f"free form: {len(captured)} captured prompts as the calibration set, from "
         f"{parent_mode.parent.name if parent_mode else 'the base model'}", "training")
    exported = train(train_cfg)
    if parent_mode is not None:
        update_manifest(exported, semantic=load_artifact(parent_mode).manifest.semantic)
    note("free form: trained; judging the candidate mode", "judging")
    reference = captured_open_questions(latest() if latest else prompts, domain)[-settings.max_prompts:]
    cand = evaluate_sets(engines, model_path, exported, {**judged_sets, "reference": reference}, 0)
    in_domain = {"candidate": metrics_of(cand["tests"]), "active": metrics_of(active["tests"]) if active else None}
    inputs = {"candidate_accuracy": in_domain["candidate"]["accuracy"],
              "active_accuracy": in_domain["active"]["accuracy"] if active else 0.0, "feedback_labels": len(labels),
              "candidate_auroc": in_domain["candidate"]["auroc"],
              "active_auroc": in_domain["active"]["auroc"] if active else None}
    movement = asdict(answer_movement(active["captured"], cand["captured"])) if active else {}
    inputs.update(movement)
    on_labels = {}
    if judged:
        on_labels = {"candidate": metrics_of(cand["labels"]), "active": metrics_of(active["labels"])}
        inputs.update(candidate_feedback_ece=on_labels["candidate"]["ece_10"],
                      active_feedback_ece=on_labels["active"]["ece_10"],
                      candidate_feedback_auroc=on_labels["candidate"]["auroc"],
                      active_feedback_auroc=on_labels["active"]["auroc"])
    # calibration_targets: how many of the upper level's answers training took as served (from the active mode's
    # judging) and how many it generated.
    result = {"parent_mode": parent_mode.parent.name if parent_mode else None, "captured_prompts": len(captured),
              "reference_prompts": len(reference), "calibration_targets": calibration_targets(train_cfg),
              "in_domain": in_domain, "labels": on_labels, "captured": movement, "inputs": inputs}
    confidences = np.array([r.token_confidence for r in cand["reference"]])
    return FreeFormCandidate(exported, result, confidences)
