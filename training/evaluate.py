"""`calm eval`: score a model (optionally through an α head) on multiple-choice sets and write a report.

Outputs in the report folder: report.json (every metric per dataset, with bootstrap intervals), report.md (the table),
reliability.png (one panel per dataset) and scores_<dataset>.npz (raw letter logits, to re-evaluate heads offline).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from calm_core.alpha_head import AlphaHead
from calm_core.artifact import load_artifact
from calm_core.errors import ConfigError
from calm_core.data import MCQuestion, default_split, load_mc
from calm_core.hashing import vocab_sha256
from calm_core.metrics import calibration_report, top_label
from calm_core.models import model_weights_sha256, resolve_model
from calm_core.plots import reliability_diagram
from training.artifacts import output_vocab_size
from training.scoring import load_causal_lm, load_tokenizer, score_letters


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    split: str

    @classmethod
    def parse(cls, text: str) -> "DatasetSpec":
        """'arc_easy' or 'arc_easy:dev'."""
        name, _, split = text.partition(":")
        return cls(name, split or default_split(name))

    @property
    def label(self) -> str:
        return f"{self.name}:{self.split}"


@dataclass(frozen=True)
class EvalConfig:
    datasets: tuple[DatasetSpec, ...]
    model: str | None = None  # None = embedded default
    artifact: str | None = None
    limit: int | None = 300
    seed: int = 0
    batch_size: int = 16
    dtype: str = "float32"
    out_dir: str = "reports/eval"
    n_boot: int = 200


def sample_questions(questions: list[MCQuestion], limit: int | None, seed: int) -> list[MCQuestion]:
    """A seeded random subset of `limit` questions (all if limit is None or larger than the set)."""
    if limit is None or limit >= len(questions):
        return list(questions)
    rng = random.Random(seed)
    return rng.sample(list(questions), limit)


def run_eval(cfg: EvalConfig, show_progress: bool = True) -> dict:
    # Load every dataset first: a typo in the last name should fail before minutes of model loading and scoring.
    question_sets = {spec.label: sample_questions(load_mc(spec.name, spec.split), cfg.limit, cfg.seed) for spec in cfg.datasets}
    resolved = resolve_model(cfg.model, cfg.dtype)
    tokenizer = load_tokenizer(resolved.path)
    head: AlphaHead | None = None
    artifact_version = None
    if cfg.artifact:  # verified before the weights load: a mismatch should fail in a second, not a minute
        loaded = load_artifact(
            cfg.artifact,
            expect_vocab_size=output_vocab_size(resolved.path),
            expect_tokenizer_sha256=vocab_sha256(tokenizer.get_vocab()),
        )
        if loaded.manifest.answer_format != "letter" or loaded.manifest.has_adapter:
            # This scorer applies a bare head to answer-letter logits of the base model; anything else would be
            # numbers for a model nobody serves.
            raise ConfigError(f"`calm eval` scores the letter format on the base weights; artifact "
                              f"{loaded.manifest.artifact_version} is fitted on {loaded.manifest.answer_format} scoring"
                              f"{' with a LoRA adapter' if loaded.manifest.has_adapter else ''}: its numbers are in its "
                              "manifest (`calm artifact show`) and in `calm report`")
        head, artifact_version = loaded.head, loaded.manifest.artifact_version
    model = load_causal_lm(resolved.path, cfg.dtype)

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results, panels = {}, {}
    for label, questions in question_sets.items():
        scores = score_letters(model, tokenizer, questions, cfg.batch_size, description=label, show_progress=show_progress)
        scores.save(out / f"scores_{label.replace(':', '_')}.npz")
        probs = scores.probs(head)
        report = calibration_report(probs, scores.labels, n_boot=cfg.n_boot, seed=cfg.seed)
        results[label] = report.as_dict()
        panels[label] = top_label(probs, scores.labels)
    reliability_diagram(panels, out / "reliability.png", title=f"{resolved.id}" + (f" + {artifact_version}" if head else ""))
    summary = {
        "model": resolved.id,
        "model_weights_sha256": model_weights_sha256(resolved),
        "artifact": artifact_version,
        "config": {**asdict(cfg), "datasets": [s.label for s in cfg.datasets]},
        "created_at": datetime.now(timezone.utc).isoformat(),
        "results": results,
    }
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text(markdown_table(summary))
    return summary


def markdown_table(summary: dict) -> str:
    cfg = summary["config"]
    head = f" + α head `{summary['artifact']}`" if summary["artifact"] else " (no α head)"
    lines = [
        f"# Evaluation: {summary['model']}{head}",
        "",
        f"Letter format, chat template, {cfg['limit']} questions per set (seed {cfg['seed']}), {cfg['dtype']}. "
        "Brackets: 95% bootstrap interval.",
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
