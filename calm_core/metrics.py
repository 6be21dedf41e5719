"""Calibration and discrimination metrics, pure numpy.

Inputs are `probs` (N, K) — a probability distribution over K classes per row, padded classes with probability 0 —
and `labels` (N,) with 0-based gold indices. Confidence is the top-label probability max_k p_k.

References: Guo et al. 2017 (ECE), Nixon et al. 2019 (adaptive ECE), Kull et al. 2019 (class-wise ECE),
Geifman & El-Yaniv 2017 / Geifman et al. 2019 (risk-coverage, AURC).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

_ROW_SUM_TOL = 1e-3


def _check_n_bins(n_bins: int) -> None:
    if not isinstance(n_bins, (int, np.integer)) or isinstance(n_bins, bool) or n_bins < 1:
        raise ValueError(f"Expected `n_bins` to be a positive integer, but got {n_bins!r}")


def check_probs_labels(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels)
    if probs.ndim != 2:
        raise ValueError(f"Expected `probs` of shape (N, K), but got shape {probs.shape}")
    if labels.shape != (probs.shape[0],):
        raise ValueError(f"Expected `labels` of shape ({probs.shape[0]},), but got shape {labels.shape}")
    if probs.shape[0] == 0:
        raise ValueError("Expected at least one sample, but got none")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"Expected integer `labels`, but got dtype {labels.dtype}")
    if labels.min() < 0 or labels.max() >= probs.shape[1]:
        raise ValueError(f"Expected `labels` in [0, {probs.shape[1] - 1}], but got range [{labels.min()}, {labels.max()}]")
    if np.any(probs < 0) or not np.all(np.isfinite(probs)):
        raise ValueError("Expected `probs` to be finite and non-negative")
    sums = probs.sum(axis=1)
    if np.any(np.abs(sums - 1.0) > _ROW_SUM_TOL):
        raise ValueError(f"Expected every row of `probs` to sum to 1, but found a row summing to {sums[np.argmax(np.abs(sums - 1))]:.4f}")
    return probs, labels.astype(np.int64)


def _check_conf_correct(confidence, correct) -> tuple[np.ndarray, np.ndarray]:
    confidence = np.asarray(confidence, dtype=np.float64)
    correct = np.asarray(correct).astype(bool)
    if confidence.ndim != 1 or correct.shape != confidence.shape:
        raise ValueError(f"Expected 1-D `confidence` and `correct` of equal length, but got {confidence.shape} and {correct.shape}")
    if confidence.size == 0:
        raise ValueError("Expected at least one sample, but got none")
    return confidence, correct


def top_label(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    """(confidence, correct) of the top-label prediction; ties resolve to the lowest index (np.argmax)."""
    probs, labels = check_probs_labels(probs, labels)
    pred = probs.argmax(axis=1)
    return probs.max(axis=1), pred == labels


def binned_calibration_error(confidence, correct, n_bins: int = 10) -> float:
    """Σ_b |B_b|/N · |acc(B_b) − conf(B_b)| over equal-width bins; bin b holds (b/n, (b+1)/n], bin 0 also holds 0."""
    _check_n_bins(n_bins)
    confidence, correct = _check_conf_correct(confidence, correct)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    idx = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, n_bins - 1)
    total = 0.0
    for b in range(n_bins):
        mask = idx == b
        if mask.any():
            total += mask.sum() * abs(correct[mask].mean() - confidence[mask].mean())
    return float(total / confidence.size)


def ece(probs, labels, n_bins: int = 10) -> float:
    """Top-label expected calibration error with `n_bins` equal-width bins (Guo et al. 2017)."""
    return binned_calibration_error(*top_label(probs, labels), n_bins=n_bins)


def adaptive_ece(probs, labels, n_bins: int = 15) -> float:
    """Top-label ECE with equal-mass bins: samples sorted by confidence, split into `n_bins` near-equal groups."""
    _check_n_bins(n_bins)
    confidence, correct = top_label(probs, labels)
    order = np.argsort(confidence, kind="stable")
    total = 0.0
    for group in np.array_split(order, min(n_bins, confidence.size)):
        total += group.size * abs(correct[group].mean() - confidence[group].mean())
    return float(total / confidence.size)


def classwise_ece(probs, labels, n_bins: int = 10) -> float:
    """Mean over classes k of the binned calibration error of p_k against 1[y = k] (Kull et al. 2019)."""
    probs, labels = check_probs_labels(probs, labels)
    per_class = [binned_calibration_error(probs[:, k], labels == k, n_bins) for k in range(probs.shape[1])]
    return float(np.mean(per_class))


def brier(probs, labels) -> float:
    """Multi-class Brier score: mean over samples of Σ_k (p_k − 1[y = k])²."""
    probs, labels = check_probs_labels(probs, labels)
    onehot = np.zeros_like(probs)
    onehot[np.arange(labels.size), labels] = 1.0
    return float(((probs - onehot) ** 2).sum(axis=1).mean())


def nll(probs, labels, eps: float = 1e-12) -> float:
    """Mean negative log-likelihood of the gold class; probabilities are clipped at `eps`."""
    probs, labels = check_probs_labels(probs, labels)
    return float(-np.log(np.clip(probs[np.arange(labels.size), labels], eps, 1.0)).mean())


def accuracy(probs, labels) -> float:
    return float(top_label(probs, labels)[1].mean())


def auroc(confidence, correct) -> float:
    """AUROC of confidence separating correct from wrong answers (Mann-Whitney U, ties count one half).

    NaN when all answers are correct or all wrong: the quantity is undefined there.
    """
    confidence, correct = _check_conf_correct(confidence, correct)
    n_pos, n_neg = int(correct.sum()), int((~correct).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _average_ranks(confidence)
    return float((ranks[correct].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _average_ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    ranks = np.empty(x.size, dtype=np.float64)
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], x.size]
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e + 1) / 2.0  # 1-based average rank of the tie group
    return ranks


def risk_coverage(confidence, correct) -> tuple[np.ndarray, np.ndarray]:
    """Coverage k/N and selective risk (error rate of the k most confident answers), k = 1..N."""
    confidence, correct = _check_conf_correct(confidence, correct)
    order = np.argsort(-confidence, kind="stable")
    errors = np.cumsum(~correct[order])
    k = np.arange(1, confidence.size + 1)
    return k / confidence.size, errors / k


def aurc(confidence, correct) -> float:
    """Area under the risk-coverage curve: mean selective risk over coverages k/N (lower is better)."""
    return float(risk_coverage(confidence, correct)[1].mean())


def bootstrap_ci(
    metric: Callable[..., float],
    *arrays,
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `metric(*arrays)`, resampling rows of all arrays together."""
    if n_boot < 1:
        raise ValueError(f"Expected `n_boot` to be a positive integer, but got {n_boot!r}")
    if not 0 < level < 1:
        raise ValueError(f"Expected `level` in (0, 1), but got {level!r}")
    arrays = [np.asarray(a) for a in arrays]
    n = arrays[0].shape[0]
    rng = np.random.default_rng(seed)
    stats = []
    for _ in range(n_boot):
        idx = rng.integers(0, n, size=n)
        value = metric(*(a[idx] for a in arrays))
        if np.isfinite(value):
            stats.append(value)
    if not stats:
        return float("nan"), float("nan")
    lo, hi = np.quantile(stats, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


@dataclass(frozen=True)
class CalibrationReport:
    n: int
    accuracy: float
    mean_confidence: float
    ece_10: float
    ece_15: float
    adaptive_ece: float
    classwise_ece: float
    brier: float
    nll: float
    auroc: float
    aurc: float
    ece_10_ci: tuple[float, float]
    auroc_ci: tuple[float, float]

    def as_dict(self) -> dict:
        return asdict(self)


def calibration_report(probs, labels, n_boot: int = 200, seed: int = 0) -> CalibrationReport:
    """Every metric above on one set of predictions, with bootstrap intervals for ECE-10 and AUROC."""
    probs, labels = check_probs_labels(probs, labels)
    conf, correct = top_label(probs, labels)
    return CalibrationReport(
        n=int(labels.size),
        accuracy=float(correct.mean()),
        mean_confidence=float(conf.mean()),
        ece_10=binned_calibration_error(conf, correct, 10),
        ece_15=binned_calibration_error(conf, correct, 15),
        adaptive_ece=adaptive_ece(probs, labels, 15),
        classwise_ece=classwise_ece(probs, labels, 10),
        brier=brier(probs, labels),
        nll=nll(probs, labels),
        auroc=auroc(conf, correct),
        aurc=aurc(conf, correct),
        ece_10_ci=bootstrap_ci(lambda c, k: binned_calibration_error(c, k, 10), conf, correct, n_boot=n_boot, seed=seed),
        auroc_ci=bootstrap_ci(auroc, conf, correct, n_boot=n_boot, seed=seed),
    )


def confidence_histogram(confidence, n_bins: int = 20) -> tuple[list[float], list[int]]:
    """Equal-width histogram of confidences on [0, 1]: (edges, counts); the reference for drift detection."""
    _check_n_bins(n_bins)
    counts, edges = np.histogram(np.asarray(confidence, dtype=np.float64), bins=n_bins, range=(0.0, 1.0))
    return edges.tolist(), counts.astype(int).tolist()
