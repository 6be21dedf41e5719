"""`calm artifacts fit-semantic`: fit a free-form mode's semantic-confidence map and write it into its manifest.

The questions are answered as the gateway serves them (greedy answer, token confidence, and the share of `samples`
answers sampled without the head that agree with it; training/free_form_eval.py). The map is a Platt map on the logit of
the smoothed share (calm_core/semantic.py), fitted to one of two targets:
- label-free (default): the mode's own calibrated token confidence of the same answers. CALM's head is fitted without
  labels; the map carries its level of confidence over to the agreement share, whose ranking of answers is its own.
- labels (`--labels`): whether each answer is right (alias match), for a domain that has labelled questions.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from calm_core.artifact import load_artifact, update_manifest
from calm_core.engine import EngineFactory
from calm_core.errors import ConfigError
from calm_core.models import resolve_model
from calm_core.semantic import SemanticCalibration, fit_platt, smoothed_share
from training.evaluate import DatasetSpec, sample_questions
from training.free_form_eval import FreeFormRecord, evaluate_served


@dataclass(frozen=True)
class SemanticFitConfig:
    artifact: str  # a multiple-choice artifact with a free-form mode, or a free-form artifact
    dataset: DatasetSpec  # prompts of the domain (open-ended; its answers are read only with `use_labels`)
    limit: int | None = 200
    samples: int = 8
    seed: int = 0
    use_labels: bool = False
    out_dir: str = "reports/semantic-fit"
    answers: str | None = None  # answers.jsonl of an earlier fit on the same questions: refit without an engine


def run_semantic_fit(engines: EngineFactory, cfg: SemanticFitConfig) -> dict:
    mode = load_artifact(cfg.artifact).free_form
    if mode is None:
        raise ConfigError(f"artifact {cfg.artifact} has no free-form mode to fit semantic confidence for")
    if not cfg.dataset.open_ended:
        raise ConfigError("semantic confidence is fitted on open-ended questions (e.g. triviaqa:sample@0.5-0.7)")
    questions = sample_questions(cfg.dataset.load(), cfg.limit, cfg.seed)
    records = (_recorded(Path(cfg.answers), questions, cfg.samples) if cfg.answers
               else evaluate_served(engines, resolve_model(None).path, mode.path, questions, cfg.samples))
    shares = np.array([smoothed_share(r.semantic_agreeing, cfg.samples) for r in records])
    targets = np.array([float(r.correct) if cfg.use_labels else r.token_confidence for r in records])
    slope, intercept = fit_platt(shares, targets)
    what = "labels (alias match)" if cfg.use_labels else "the mode's calibrated token confidence (label-free)"
    calibration = (mode.manifest.semantic or SemanticCalibration()).model_copy(update={
        "slope": slope, "intercept": intercept,
        "fitted_on": f"{what}, {len(records)} questions of {cfg.dataset.label}, {cfg.samples} samples each"})
    update_manifest(mode.path, semantic=calibration.model_dump())
    fitted = np.array([calibration.confidence(r.semantic_agreeing, cfg.samples) for r in records])
    summary = {"artifact": mode.manifest.artifact_version, "dataset": cfg.dataset.label, "n": len(records),
               "samples": cfg.samples, "calibration": calibration.model_dump(),
               "mean_share": float(np.mean([r.semantic_agreeing / cfg.samples for r in records])),
               "mean_target": float(targets.mean()), "mean_semantic_confidence": float(fitted.mean()),
               "accuracy": float(np.mean([r.correct for r in records]))}
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fit.json").write_text(json.dumps(summary, indent=2))
    (out / "answers.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
    return summary


def _recorded(path: Path, questions: list, samples: int) -> list[FreeFormRecord]:
    records = [FreeFormRecord(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    if [r.id for r in records] != [q.id for q in questions] or any(
            r.semantic_agreeing is None or sum(r.cluster_sizes or []) != samples for r in records):
        raise ConfigError(f"{path} holds other questions or sample counts than this fit asks for")
    return records
