"""`calm eval`: score a model, or an artifact as the gateway serves it, on multiple-choice sets and write a report.

Outputs in the report folder: report.json (every metric per dataset, with bootstrap intervals), report.md (the table),
reliability.png (one panel per dataset) and probs_<dataset>.npz (each question's option probabilities and label).
The same report comes from a live gateway (training/gateway_eval.py).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from calm_core.data import MCQuestion
from calm_core.errors import ConfigError
from calm_core.metrics import calibration_report, top_label
from calm_core.models import model_weights_sha256, resolve_model
from calm_core.plots import reliability_diagram
from calm_core.prompts import AnswerFormat
from training.artifact_scoring import load_served_model, load_verified_artifact, option_probabilities
from training.dataset_spec import DatasetSpec
from training.scoring import load_tokenizer


@dataclass(frozen=True)
class EvalConfig:
    datasets: tuple[DatasetSpec, ...]
    model: str | None = None  # None = embedded default
    artifact: str | None = None
    answer_format: AnswerFormat | None = None  # None: the artifact's, or letter without one
    limit: int | None = 300
    seed: int = 0
    batch_size: int = 8
    dtype: str = "float32"
    out_dir: str = "reports/eval"
    n_boot: int = 200


def sample_questions(questions: list[MCQuestion], limit: int | None, seed: int) -> list[MCQuestion]:
    """A seeded random subset of `limit` questions (all if limit is None or larger than the set)."""
    if limit is None or limit >= len(questions):
        return list(questions)
    rng = random.Random(seed)
    return rng.sample(list(questions), limit)


def question_sets(datasets: tuple[DatasetSpec, ...], limit: int | None, seed: int) -> dict[str, list[MCQuestion]]:
    # Every dataset is loaded first: a typo in the last name should fail before minutes of loading and scoring.
    return {spec.label: sample_questions(spec.load(), limit, seed) for spec in datasets}


def run_eval(cfg: EvalConfig, show_progress: bool = True) -> dict:
    """Offline: the model (with the artifact's adapter and head, scored in its answer format) under HF transformers."""
    sets = question_sets(cfg.datasets, cfg.limit, cfg.seed)
    resolved = resolve_model(cfg.model, cfg.dtype)
    tokenizer = load_tokenizer(resolved.path)
    head, artifact_version, adapter, fmt, temperature = None, None, None, cfg.answer_format or "letter", 1.0
    if cfg.artifact:
        loaded = load_verified_artifact(cfg.artifact, resolved.path, tokenizer)
        if cfg.answer_format and cfg.answer_format != loaded.manifest.answer_format:
            raise ConfigError(f"artifact {loaded.manifest.artifact_version} is fitted on {loaded.manifest.answer_format} "
                              f"scoring; scoring it as {cfg.answer_format} would report a model nobody serves")
        head, artifact_version = loaded.head, loaded.manifest.artifact_version
        adapter, fmt, temperature = loaded.adapter_dir, loaded.manifest.answer_format, loaded.manifest.option_temperature
    model = load_served_model(str(resolved.path), adapter, cfg.dtype)
    probs = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=not show_progress, transient=True) as bar:
        for label, questions in sets.items():
            task = bar.add_task(label, total=len(questions))
            probs[label] = option_probabilities(model, tokenizer, questions, fmt, head, cfg.batch_size,
                                                lambda n: bar.advance(task, n), temperature)
    source = {"model": resolved.id, "model_weights_sha256": model_weights_sha256(resolved), "artifact": artifact_version,
              "answer_format": fmt, "scored_by": "offline (HF transformers)"}
    return write_report(Path(cfg.out_dir), source, {**asdict(cfg), "datasets": [s.label for s in cfg.datasets]},
                        sets, probs, cfg.n_boot, cfg.seed)


def write_report(out: Path, source: dict, config: dict, sets: dict[str, list[MCQuestion]],
                 probs: dict[str, np.ndarray], n_boot: int, seed: int) -> dict:
    """report.json, report.md, reliability.png and probs_<set>.npz: one report whoever scored the questions."""
    out.mkdir(parents=True, exist_ok=True)
    results, panels = {}, {}
    for label, questions in sets.items():
        labels = np.asarray([q.answer for q in questions])
        np.savez_compressed(out / f"probs_{label.replace(':', '_')}.npz", probs=probs[label], labels=labels,
                            question_ids=np.asarray([q.id for q in questions]))
        results[label] = calibration_report(probs[label], labels, n_boot=n_boot, seed=seed).as_dict()
        panels[label] = top_label(probs[label], labels)
    title = source["model"] + (f" + {source['artifact']}" if source.get("artifact") else "")
    reliability_diagram(panels, out / "reliability.png", title=title)
    summary = {**source, "config": config, "created_at": datetime.now(timezone.utc).isoformat(), "results": results}
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text(markdown_table(summary))
    return summary


def markdown_table(summary: dict) -> str:
    cfg = summary["config"]
    head = f" + artifact `{summary['artifact']}`" if summary["artifact"] else " (no α head)"
    lines = [
        f"# Evaluation: {summary['model']}{head}",
        "",
        f"Scored {summary['scored_by']} ({summary['answer_format']} format), {cfg['limit']} questions per set "
        f"(seed {cfg['seed']}). Brackets: 95% bootstrap interval.",
        "",
        "| dataset | n | accuracy | mean conf. | ECE-10 | ECE-15 | adaptive ECE | class-wise ECE | Brier | NLL | AUROC | AURC |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in summary["results"].items():
        lines.append(
            f"| {name} | {m['n']} | {m['accuracy']:.3f} | {m['mean_confidence']:.3f} | "
            f"{m['ece_10']:.3f} [{m['ece_10_ci'][0]:.3f}, {m['ece_10_ci'][1]:.3f}] | {m['ece_15']:.3f} | "
            f"{m['adaptive_ece']:.3f} | {m['classwise_ece']:.3f} | {m['brier']:.3f} | {m['nll']:.3f} | "
            f"{m['auroc']:.3f} [{m['auroc_ci'][0]:.3f}, {m['auroc_ci'][1]:.3f}] | {m['aurc']:.3f} |"
        )
    return "\n".join(lines) + "\n"
