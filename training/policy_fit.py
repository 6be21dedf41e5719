"""`calm policy fit`: a guaranteed abstention threshold for an artifact from a labelled question set, offline.

The artifact scores the questions as the gateway serves it (training/artifact_scoring.py); its confidences and
verdicts give the Learn-then-Test threshold (calm_core/risk_control.py), next to the label-free threshold that trusts
the calibration. Writes fit.json, scores.npz (each question's confidence and verdict) and selective_risk.png.

With `action` escalate (or review) the same threshold is read as what it costs: the share of answers handed to the
stronger model (or to people) against the error rate of the answers kept.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from calm_core.models import resolve_model
from calm_core.risk_control import guaranteed_threshold, label_free_threshold, risk_curve, selective_risk, sequence_start
from training.artifact_scoring import load_served_model, load_verified_artifact, option_probabilities
from training.evaluate import DatasetSpec, question_sets
from training.scoring import load_tokenizer


@dataclass(frozen=True)
class PolicyFitConfig:
    artifact: str
    dataset: DatasetSpec
    target_risk: float
    delta: float = 0.1
    limit: int | None = None
    seed: int = 0
    domain: str = "all"  # whose reference histogram starts the test sequence and gives the label-free threshold
    model: str | None = None
    out_dir: str = "reports/policy-fit"
    action: str = "abstain"  # what happens below the threshold: abstain, escalate or review (the wording of the plot)


def reference_of(manifest, domain: str) -> tuple[list[float], list[int]] | None:
    ref = manifest.reference_histograms.get(domain) or manifest.reference_histograms.get("all")
    return (ref.bin_edges, ref.counts) if ref else None


def run_policy_fit(cfg: PolicyFitConfig) -> dict:
    (label, questions), = question_sets((cfg.dataset,), cfg.limit, cfg.seed).items()
    resolved = resolve_model(cfg.model, "float32")
    tokenizer = load_tokenizer(resolved.path)
    loaded = load_verified_artifact(cfg.artifact, resolved.path, tokenizer)
    model = load_served_model(str(resolved.path), loaded.adapter_dir)
    probs = option_probabilities(model, tokenizer, questions, loaded.manifest.answer_format, loaded.head,
                                 option_temperature=loaded.manifest.option_temperature)
    labels = np.asarray([q.answer for q in questions])
    confidence, correct = probs.max(axis=1), probs.argmax(axis=1) == labels
    reference = reference_of(loaded.manifest, cfg.domain)
    start = sequence_start(reference)
    fit = guaranteed_threshold(confidence, correct, cfg.target_risk, cfg.delta, start=start)
    label_free = label_free_threshold(*reference, cfg.target_risk) if reference else None
    lf_coverage, lf_risk = selective_risk(confidence, correct, label_free)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "scores.npz", confidence=confidence, correct=correct,
                        question_ids=np.asarray([q.id for q in questions]))
    summary = {
        "artifact": loaded.manifest.artifact_version, "dataset": label, "n": len(questions),
        "accuracy": float(correct.mean()), "mean_confidence": float(confidence.mean()),
        "sequence_start": start, "action": cfg.action,
        "guaranteed": {**asdict(fit), "handed_off": 1.0 - fit.coverage},
        "label_free": {"threshold": label_free, "coverage": lf_coverage, "selective_risk": lf_risk,
                       "handed_off": 1.0 - lf_coverage},
        "config": {**asdict(cfg), "dataset": label},
    }
    (out / "fit.json").write_text(json.dumps(summary, indent=2))
    plot_selective_risk(confidence, correct, fit.threshold, label_free, cfg.target_risk, out / "selective_risk.png",
                        f"{loaded.manifest.artifact_version} on {label}", cfg.action)
    return summary


def plot_selective_risk(confidence, correct, guaranteed: float | None, label_free: float | None, target: float,
                        path: Path, title: str, action: str = "abstain") -> None:
    """Error rate of the answers let through against coverage; for escalate and review against the share handed off
    (1 - coverage), the reading an operator needs before switching the policy on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    handed = action in ("escalate", "review")
    x = (lambda c: 1.0 - c) if handed else (lambda c: c)
    thresholds, coverage, risk = risk_curve(confidence, correct)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([x(c) for c in coverage], risk, marker=".", label="error rate of the answers kept, each threshold")
    ax.axhline(target, color="grey", linestyle="--", label=f"target risk {target}")
    for t, name, colour in ((guaranteed, "guaranteed", "tab:green"), (label_free, "label-free", "tab:red")):
        if t is not None:
            c, r = selective_risk(confidence, correct, t)
            ax.scatter([x(c)], [r if r is not None else 0.0], color=colour, zorder=3, label=f"{name} t = {t:.2f}")
    verb = {"escalate": "escalated", "review": "sent to review"}.get(action)
    ax.set_xlabel(f"share of answers {verb}" if handed else "coverage (share of answers let through)")
    ax.set_ylabel("error rate of the answers kept" if handed else "error rate of the answers let through")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
