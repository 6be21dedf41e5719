"""Labelled recalibration on ARC-Easy: 300 labels of the domain, and what the shipped version serves afterwards.

    python benchmarks/loop/bench_recalibration.py --out benchmarks/results

Every ARC-Easy test question is scored once as the shipped version serves it (offline engine, the gateway's scorers;
cached in recalibration_scores.npz). Then, for each of 200 random splits: 300 questions are the uploaded labels, and as
`calm artifacts recalibrate` does, a temperature is fitted on 2/3 of them and checked on the other 1/3; the remaining
2,076 questions are the domain's later traffic, on which accuracy, mean confidence, ECE-10 and AUROC are measured
before and after, and the label-free target-risk threshold (α = 0.45, from the reference histogram of the labelled
questions' recalibrated confidences, as the new version's manifest carries it) is applied: its coverage and the error
rate of the answers it lets through. Results: recalibration.json / .md in --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from calm_cli.serving import DEFAULT_ARTIFACTS  # noqa: E402
from calm_core.metrics import auroc, binned_calibration_error  # noqa: E402
from calm_core.models import EMBEDDED_ID  # noqa: E402
from calm_core.recalibration import check_held_out, fit_temperature, split_fit_held_out, tempered  # noqa: E402
from calm_core.risk_control import label_free_threshold, selective_risk  # noqa: E402
from training.artifacts import reference_histogram  # noqa: E402
from training.evaluate import DatasetSpec  # noqa: E402
from training.recalibrate import RecalibrateConfig, served_log_probs  # noqa: E402

LABELS, SPLITS, TARGET_RISK = 300, 200, 0.45


def scores(out: Path) -> tuple[list[np.ndarray], np.ndarray]:
    cache = out / "recalibration_scores.npz"
    if cache.is_file():
        data = np.load(cache)
        return [row[:k] for row, k in zip(data["log_probs"], data["n_options"])], data["labels"]
    cfg = RecalibrateConfig(str(DEFAULT_ARTIFACTS[EMBEDDED_ID]), DatasetSpec.parse("arc_easy:test"), "science", "")
    log_probs, labels, _ = served_log_probs(cfg)
    width = max(len(lp) for lp in log_probs)
    padded = np.full((len(log_probs), width), -np.inf)
    for i, lp in enumerate(log_probs):
        padded[i, : len(lp)] = lp
    np.savez_compressed(cache, log_probs=padded, n_options=[len(lp) for lp in log_probs], labels=labels)
    return log_probs, labels


def measure(probs: list[np.ndarray], labels: np.ndarray) -> dict:
    conf = np.array([p.max() for p in probs])
    correct = np.array([int(np.argmax(p)) for p in probs]) == labels
    return {"accuracy": float(correct.mean()), "mean_confidence": float(conf.mean()),
            "ece_10": binned_calibration_error(conf, correct), "auroc": auroc(conf, correct)}


def one_split(log_probs, labels, seed: int) -> dict:
    order = np.random.default_rng(seed).permutation(len(labels))
    labelled, later = order[:LABELS], order[LABELS:]
    fit, held = split_fit_held_out(LABELS, 1 / 3, seed)
    fit, held = labelled[fit], labelled[held]
    t = fit_temperature([log_probs[i] for i in fit], labels[fit])
    check = check_held_out([log_probs[i] for i in held], labels[held], t)
    later_lp = [log_probs[i] for i in later]
    row = {"temperature": t, "passed": check.passed, "before": measure(tempered(later_lp, 1.0), labels[later]),
           "after": measure(tempered(later_lp, t), labels[later])}
    for name, temp in (("before", 1.0), ("after", t)):
        reference = reference_histogram(np.array([p.max() for p in tempered([log_probs[i] for i in labelled], temp)]))
        threshold = label_free_threshold(reference.bin_edges, reference.counts, TARGET_RISK)
        probs = tempered(later_lp, temp)
        conf = np.array([p.max() for p in probs])
        correct = np.array([int(np.argmax(p)) for p in probs]) == labels[later]
        coverage, risk = selective_risk(conf, correct, threshold)
        row[name].update(label_free_threshold=threshold, coverage=coverage, selective_risk=risk)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log_probs, labels = scores(args.out)
    rows = [one_split(log_probs, labels, seed) for seed in range(SPLITS)]
    keys = ("accuracy", "mean_confidence", "ece_10", "auroc", "coverage", "selective_risk")

    def mean(side: str, key: str) -> float:
        values = [r[side][key] for r in rows if r[side][key] is not None]
        return float(np.mean(values)) if values else float("nan")

    summary = {"questions": len(labels), "labels": LABELS, "splits": SPLITS, "target_risk": TARGET_RISK,
               "passed": sum(r["passed"] for r in rows), "temperature_mean": float(np.mean([r["temperature"] for r in rows])),
               "before": {k: mean("before", k) for k in keys}, "after": {k: mean("after", k) for k in keys},
               "risk_within_0.03": float(np.mean([abs(r["after"]["selective_risk"] - TARGET_RISK) <= 0.03
                                                   for r in rows if r["after"]["selective_risk"] is not None]))}
    (args.out / "recalibration.json").write_text(json.dumps({"summary": summary, "splits": rows}, indent=1))
    lines = ["| ARC-Easy, later traffic | accuracy | mean conf. | ECE-10 | AUROC | label-free coverage (α = 0.45) "
             "| error rate of answers let through |", "|---|---|---|---|---|---|---|"]
    for side, name in (("before", "shipped version"), ("after", "recalibrated on 300 labels")):
        m = summary[side]
        lines.append(f"| {name} | {m['accuracy']:.3f} | {m['mean_confidence']:.3f} | {m['ece_10']:.3f} | "
                     f"{m['auroc']:.3f} | {m['coverage']:.3f} | {m['selective_risk']:.3f} |")
    lines += ["", f"Means over {SPLITS} random splits of the {len(labels)} ARC-Easy test questions into {LABELS} labels "
              f"and {len(labels) - LABELS} later questions; mean temperature {summary['temperature_mean']:.3f}; the "
              f"held-out check passed in {summary['passed']} of {SPLITS}; realised error within 0.03 of α in "
              f"{summary['risk_within_0.03']:.0%} of splits. `python benchmarks/loop/bench_recalibration.py`."]
    (args.out / "recalibration.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
