"""`calm report`: every method on the declared split, several seeds, one table.

Trained methods run through the same Trainer (same data, steps and batch size); post-hoc temperature and vector
scaling reuse the fine-tuned (SFT) model's logits, fitted on the labelled calibration questions (in-domain
validation); the uncalibrated model is evaluated once. Outputs in --out: report.json, report.md, reliability.png
(out-of-domain, pooled, first seed) and curves.png (training curves of CALM and the single-level baselines).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from calm_core.scoring import option_probs  # noqa: E402
from calm_core.metrics import calibration_report, top_label  # noqa: E402
from calm_core.plots import reliability_diagram  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.posthoc import fit_daca_temperature, fit_temperature, fit_vector_scaling  # noqa: E402
from training.trainer import Trainer  # noqa: E402

# Row name -> config overrides of the trained methods; CALM's upper level is reported with both entropies.
TRAINED = {
    "sft": {"method": "sft"},
    "label_smoothing": {"method": "label_smoothing"},
    "cft": {"method": "cft"},
    "regularization": {"method": "regularization"},
    "iterate": {"method": "iterate"},
    "calm": {"method": "calm", "entropy_over": "options"},
    "calm_vocab_entropy": {"method": "calm", "entropy_over": "vocab"},
    "calm_scalar": {"method": "calm_scalar", "entropy_over": "options"},
}
ROWS = ("uncalibrated", "sft", "sft+temperature", "sft+vector_scaling", "sft+daca", "label_smoothing", "cft",
        "regularization", "iterate", "calm_scalar", "calm_vocab_entropy", "calm")
# Rows each trained method's run produces (the SFT run also gives the post-hoc rows and, at the first seed, the
# uncalibrated model).
PRODUCES = {"sft": ("uncalibrated", "sft", "sft+temperature", "sft+vector_scaling", "sft+daca")}
METRICS = ("accuracy", "ece_10", "ece_15", "classwise_ece", "brier", "nll", "auroc", "aurc")
ROLES = (("test_in_domain", "in_domain"), ("test_out_of_domain", "out_of_domain"))


@dataclass
class Predictions:
    """Per role, the stacked probabilities/labels of every test source (padded to a common option count)."""

    probs: dict[str, list[np.ndarray]]
    labels: dict[str, list[np.ndarray]]


def _role_metrics(trainer: Trainer, probs_of) -> tuple[dict, dict]:
    """Metrics per role as the mean over that role's test sources; also the pooled (conf, correct) for plots."""
    out, pooled = {}, {}
    for role, name in ROLES:
        per_source, confs, corrects = [], [], []
        for data in trainer.sets[role].values():
            probs = probs_of(data)
            labels = data.labels.numpy()
            per_source.append(calibration_report(probs, labels, n_boot=1).as_dict())
            c, k = top_label(probs, labels)
            confs.append(c)
            corrects.append(k)
        out[name] = {m: float(np.mean([r[m] for r in per_source])) for m in METRICS}
        pooled[name] = (np.concatenate(confs), np.concatenate(corrects))
    return out, pooled


def _posthoc_rows(trainer: Trainer, z_initial: np.ndarray) -> dict[str, tuple[dict, dict]]:
    """Temperature and vector scaling on top of the trained SFT model, fitted on labelled calibration questions; DACA
    fitted label-free on the same questions where the initial model (`z_initial`, its calibration option logits) and
    the SFT model choose the same option."""
    val = trainer.calib_set
    z_val = trainer.option_logits(val)  # SFT never trains α: these are the raw option logits
    width = z_val.shape[1]
    t = fit_temperature(z_val, val.labels.numpy(), val.n_options.numpy())
    d, l = fit_vector_scaling(z_val, val.labels.numpy(), val.n_options.numpy())
    real = np.arange(width)[None, :] < val.n_options.numpy()[:, None]
    t_daca = fit_daca_temperature(np.where(real, z_initial, -np.inf), np.where(real, z_val, -np.inf))

    def scaled(scale: np.ndarray, shift: np.ndarray):
        def probs_of(data):
            z = trainer.option_logits(data)
            k = z.shape[1]
            # Option slots the validation questions never had (5-way CommonsenseQA after 4-way ARC) get the mean fit.
            fill = lambda v: np.concatenate([v[:k], np.full(max(k - len(v), 0), v.mean())])  # noqa: E731
            return option_probs(z * fill(scale) + fill(shift), data.n_options.numpy())
        return probs_of

    rows = {"sft+temperature": _role_metrics(trainer, scaled(np.array([1.0 / t]), np.zeros(1))),
            "sft+vector_scaling": _role_metrics(trainer, scaled(d[:width], l[:width])),
            "sft+daca": _role_metrics(trainer, scaled(np.array([1.0 / t_daca]), np.zeros(1)))}
    rows["sft+temperature"][0]["fitted_temperature"] = t
    rows["sft+daca"][0]["fitted_temperature"] = t_daca
    return rows


def run_report(base: TrainConfig, seeds: list[int], out: Path, steps: int | None = None,
               only: list[str] | None = None) -> dict:
    """Every row, or with `only` the rows of those trained methods, merged into the report already in `out` (its other
    rows kept as they were)."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict]] = {row: {} for row in ROWS}
    if only:
        unknown = set(only) - set(TRAINED)
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; known: {', '.join(TRAINED)}")
        previous = json.loads((out / "report.json").read_text())["per_seed"] if (out / "report.json").is_file() else {}
        rerun = {row for m in only for row in PRODUCES.get(m, (m,))}
        for row, by_seed in previous.items():
            if row in results and row not in rerun:
                results[row] = {int(s): v for s, v in by_seed.items()}
    curves: dict[str, list[dict]] = {}
    pooled_first: dict[str, tuple] = {}
    for seed in seeds:
        for method, overrides in TRAINED.items():
            if only and method not in only:
                continue
            cfg = base.model_copy(update={**overrides, "seed": seed, "out_dir": str(out / "runs" / f"{method}-s{seed}"),
                                          **({"steps": steps} if steps else {})})
            cfg = TrainConfig.model_validate(cfg.model_dump())  # re-run validators (calm_scalar -> scalar head)
            trainer = Trainer(cfg).setup()
            if method == "sft" and seed == seeds[0]:
                metrics, pooled = _role_metrics(trainer, trainer.probs)  # before any step: the uncalibrated model
                results["uncalibrated"][seed] = metrics
                pooled_first["uncalibrated"] = pooled["out_of_domain"]
            z_initial = trainer.option_logits(trainer.calib_set).copy() if method == "sft" else None
            trainer.resume(restart_if_mismatched=True)
            trainer.train()
            trainer.export()
            metrics, pooled = _role_metrics(trainer, trainer.probs)
            results[method][seed] = metrics
            if seed == seeds[0]:
                pooled_first[method] = pooled["out_of_domain"]
                curves[method] = trainer.history
            if method == "sft":
                for row, (m, p) in _posthoc_rows(trainer, z_initial).items():
                    results[row][seed] = m
                    if seed == seeds[0]:
                        pooled_first[row] = p["out_of_domain"]
        done = seeds[: seeds.index(seed) + 1]  # written after every seed, so a long run leaves usable results
        summary = {"config": base.model_dump(), "seeds": done, "steps": steps or base.steps,
                   "table": _aggregate(results), "per_seed": results}
        (out / "report.json").write_text(json.dumps(summary, indent=2))
        (out / "report.md").write_text(markdown(summary))
        if not only:  # a partial rerun keeps the plots of the full one
            reliability_diagram({k: pooled_first[k] for k in ROWS if k in pooled_first}, out / "reliability.png",
                                title="Out-of-domain reliability (pooled test sets, first seed)")
            plot_curves(curves, out / "curves.png")
    return summary


def _aggregate(results: dict[str, dict[int, dict]]) -> dict:
    table = {}
    for row, by_seed in results.items():
        if not by_seed:
            continue
        table[row] = {}
        for _, name in ROLES:
            table[row][name] = {}
            for m in METRICS:
                values = [by_seed[s][name][m] for s in by_seed]
                table[row][name][m] = {"mean": float(np.mean(values)), "std": float(np.std(values))}
    return table


def markdown(summary: dict) -> str:
    cfg = summary["config"]
    lines = [f"# CALM report: {cfg['split']}, {len(summary['seeds'])} seed(s) {summary['seeds']}, {summary['steps']} steps, "
             f"batch {cfg['batch_size']}, LoRA r={cfg['lora_rank']} on the top {cfg['lora_top_layers']} layers, "
             f"{cfg.get('answer_format', 'letter')} answer format", ""]
    for _, name in ROLES:
        lines += [f"## {name.replace('_', '-')} (mean over its test sets; ± std over seeds)", "",
                  "| method | " + " | ".join(METRICS) + " |", "|---|" + "---|" * len(METRICS)]
        for row in ROWS:
            if row not in summary["table"]:
                continue
            cells = [f"{v['mean']:.3f} ± {v['std']:.3f}" for v in (summary["table"][row][name][m] for m in METRICS)]
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_curves(curves: dict[str, list[dict]], path: Path) -> None:
    keys = (("g", "lower level g (train CE)"), ("entropy", "calibration entropy (nats)"), ("lambda", "BOME λ"),
            ("alpha_scale_mean", "mean d over answer tokens"))
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    colors = {method: f"C{i}" for i, method in enumerate(curves)}  # one colour per method across panels
    for ax, (key, title) in zip(axes, keys):
        for method, history in curves.items():
            points = [(h["step"], h[key]) for h in history if key in h]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, label=method, lw=1, color=colors[method])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
