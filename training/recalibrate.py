"""`calm artifacts recalibrate`: a new version whose multiple-choice confidence is fitted to a domain's labels, in
seconds, without training (calm_core/recalibration.py says why a temperature on the option scores). On open-ended
labels (questions with `answers` aliases) the same for the free-form mode: a temperature on the answer's token
log-probs (its token confidence c served as c ** (1 / T)), the greedy answers generated as the gateway serves them.

The labelled questions are scored as the version serves them (offline engine, the gateway's scorers); a seeded part
fits the temperature, the rest checks it (ECE must fall, AUROC must not); only a temperature that passes becomes a
version: the parent's head, adapter and free-form mode, the new temperature, the lineage (parent, labels, held-out
numbers) and the domain's reference histogram under the new confidence, so the drift monitor compares like with like.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from calm_core.artifact import FREE_FORM_DIR, Recalibration, derive_version, load_artifact, update_manifest
from calm_core.engine import EngineFactory
from calm_core.errors import CalmError
from calm_core.models import resolve_model
from calm_core.served_answers import JudgedChoice, JudgedConfidence
from calm_core.recalibration import (check_held_out, check_held_out_confidence, fit_confidence_temperature,
                                     fit_temperature, powered, split_fit_held_out, tempered)
from training.artifact_scoring import load_served_model, load_verified_artifact, option_probabilities
from training.artifacts import reference_histogram
from training.evaluate import DatasetSpec, sample_questions
from training.free_form_eval import evaluate_served
from training.scoring import load_tokenizer


@dataclass(frozen=True)
class RecalibrateConfig:
    artifact: str  # the parent version's folder
    labels: DatasetSpec  # labelled multiple-choice questions of the domain (name[:split][@range] or a .jsonl file)
    domain: str
    out: str  # the new version's folder
    limit: int | None = None
    held_out: float = 1 / 3
    seed: int = 0


def served_log_probs(cfg: RecalibrateConfig) -> tuple[list[np.ndarray], np.ndarray, object]:
    """Each labelled question's option log-probs as the parent serves them, the labels, and the parent."""
    resolved = resolve_model(None)
    tokenizer = load_tokenizer(resolved.path)
    parent = load_verified_artifact(cfg.artifact, resolved.path, tokenizer)
    questions = sample_questions(cfg.labels.load(), cfg.limit, cfg.seed)
    if not questions:  # judged answers only: their scores came with them
        return [], np.array([], dtype=int), parent
    model = load_served_model(str(resolved.path), parent.adapter_dir)
    probs = option_probabilities(model, tokenizer, questions, parent.manifest.answer_format, parent.head,
                                 option_temperature=parent.manifest.option_temperature)
    log_probs = [np.log(np.maximum(p[: len(q.choices)], 1e-300)) for p, q in zip(probs, questions)]
    return log_probs, np.array([q.answer for q in questions]), parent


def checked_summary(cfg: RecalibrateConfig, parent: str, n_fit: int, check, raise_on_failure: bool) -> dict:
    """The fit's summary; a failed held-out check writes no version (an error, unless the caller reports it)."""
    if not check.passed and raise_on_failure:
        raise CalmError(f"no version written: {check.reason}")
    return {"parent": parent, "labels": cfg.labels.label, "domain": cfg.domain, "n_fit": n_fit,
            "check": {**asdict(check), "passed": check.passed}, "reason": check.reason}


def _part(indices: np.ndarray, log_probs: list[np.ndarray], labels: np.ndarray, judged: Sequence[JudgedChoice]):
    """The questions and judged answers at `indices` of their concatenation: (log-probs, labels, judged)."""
    n = len(labels)
    questions = [int(i) for i in indices if i < n]
    return [log_probs[i] for i in questions], labels[questions], [judged[int(i) - n] for i in indices if i >= n]


def run_recalibrate(cfg: RecalibrateConfig, raise_on_failure: bool = True, judged: Sequence[JudgedChoice] = ()) -> dict:
    """Fit, check and (when the check passes) write the version; the summary has `version` only if one was written.
    `judged`: served answers of the parent that feedback judged (calm_core/served_answers.py), labels beside the
    uploaded questions: the same seeded split holds out a part of both."""
    log_probs, labels, parent = served_log_probs(cfg)
    n = len(labels)
    fit, held = split_fit_held_out(n + len(judged), cfg.held_out, cfg.seed)
    t = fit_temperature(*_part(fit, log_probs, labels, judged))
    held_lp, held_labels, held_judged = _part(held, log_probs, labels, judged)
    check = check_held_out(held_lp, held_labels, t, held_judged)
    summary = checked_summary(cfg, parent.manifest.artifact_version, len(fit), check, raise_on_failure)
    summary["judged_answers"] = len(judged)
    if not check.passed:
        return summary
    served = np.array([p.max() for p in tempered([*log_probs, *(j.log_probs for j in judged)], t)])
    numbers = {k: float(v) for k, v in asdict(check).items()}
    lineage = Recalibration(parent=parent.manifest.artifact_version, domain=cfg.domain,
                            temperature=parent.manifest.option_temperature * t,
                            fitted_on=f"{len(fit)} labels ({n} questions of {cfg.labels.label}, {len(judged)} answers "
                                      "judged by feedback, fit and held-out parts together)", held_out=numbers)
    manifest = derive_version(parent.path, cfg.out, "recalibrated", option_temperature=lineage.temperature,
                              recalibration=lineage.model_dump(), metrics={f"held_out/{cfg.labels.label}": numbers},
                              reference_histograms={**parent.manifest.reference_histograms,
                                                    cfg.domain: reference_histogram(served).model_dump()})
    summary["version"] = manifest.artifact_version
    summary["option_temperature"] = manifest.option_temperature
    Path(cfg.out, "recalibration.json").write_text(json.dumps(summary, indent=2))
    return summary


def run_recalibrate_free_form(cfg: RecalibrateConfig, engines: EngineFactory | None, raise_on_failure: bool = True,
                              judged: Sequence[JudgedConfidence] = (), onto_candidate: bool = False) -> dict:
    """The free-form mode's token confidence fitted to open-ended labels (alias answers): greedy answers and their
    token confidence as the version serves them (vLLM, `engines`; not needed when every label is a judged answer),
    T fitted on a seeded part, checked on the rest. `judged`: the parent's free-form answers that feedback judged,
    their token confidence as served. A version that passes keeps everything of its parent but the mode's token
    temperature and the domain's reference. `onto_candidate`: `cfg.out` already holds a candidate derived from the
    parent (its multiple-choice map recalibrated by the same job), which takes the free-form change instead of a new
    version."""
    resolved = resolve_model(None)
    parent = load_verified_artifact(cfg.artifact, resolved.path, load_tokenizer(resolved.path))
    mode = parent.free_form
    if mode is None:
        raise CalmError(f"{cfg.artifact} has no free-form mode to recalibrate")
    questions = sample_questions(cfg.labels.load(), cfg.limit, cfg.seed)
    if questions and engines is None:
        raise CalmError("scoring labelled free-form questions needs an engine (calm worker passes vLLM in process)")
    records = evaluate_served(engines, resolved.path, mode.path, questions, samples=0) if questions else []
    conf = np.array([r.token_confidence for r in records] + [j.confidence for j in judged], dtype=np.float64)
    correct = np.array([r.correct for r in records] + [j.correct for j in judged], dtype=bool)
    fit, held = split_fit_held_out(len(conf), cfg.held_out, cfg.seed)
    t = fit_confidence_temperature(conf[fit], correct[fit])
    check = check_held_out_confidence(conf[held], correct[held], t)
    summary = checked_summary(cfg, parent.manifest.artifact_version, len(fit), check, raise_on_failure)
    summary["judged_answers"] = len(judged)
    if not check.passed:
        return summary
    numbers = {k: float(v) for k, v in asdict(check).items()}
    temperature = mode.manifest.token_temperature * t
    lineage = Recalibration(parent=parent.manifest.artifact_version, domain=cfg.domain, temperature=temperature,
                            fitted_on=f"{len(fit)} labels ({len(records)} questions of {cfg.labels.label}, {len(judged)} "
                                      "answers judged by feedback; free-form token confidence)", held_out=numbers)
    if not onto_candidate:
        manifest = derive_version(parent.path, cfg.out, "recalibrated", recalibration=lineage.model_dump(),
                                  metrics={**parent.manifest.metrics, f"held_out/{cfg.labels.label}": numbers})
    else:
        manifest = load_artifact(cfg.out).manifest
    served = np.asarray(powered(conf, t))
    update_manifest(Path(cfg.out) / FREE_FORM_DIR, token_temperature=temperature,
                    recalibration=lineage.model_dump(), reference_histograms={
                        **mode.manifest.reference_histograms, cfg.domain: reference_histogram(served)})
    summary.update(version=manifest.artifact_version, token_temperature=temperature)
    Path(cfg.out, "recalibration-free-form.json" if onto_candidate else "recalibration.json").write_text(
        json.dumps(summary, indent=2))
    return summary
