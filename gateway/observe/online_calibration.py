"""Online accuracy and ECE from user feedback (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from calm_core.metrics import binned_calibration_error


def online_accuracy_and_ece(confidences: Sequence[float], correct: Sequence[bool], n_bins: int = 10) -> tuple[float, float]:
    if not confidences:
        return float("nan"), float("nan")
    acc = sum(bool(c) for c in correct) / len(correct)
    return acc, binned_calibration_error(list(confidences), list(correct), n_bins)
