"""How far a candidate version moved from the serving one on the same unlabelled prompts (pure functions): the share
of prompts whose chosen option stays the same, and the rank correlation of the two versions' confidences. The
retraining gate reads both on a domain's captured traffic (training/retrain/gate.py): a label-free job may change how
confident the version is, and these say whether it also changed what it answers and which answers it trusts most,
which is where a lower ECE bought with discrimination shows before any label does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import spearmanr


@dataclass(frozen=True)
class ChoiceMovement:
    """How far a candidate moved from the serving version on the same unlabelled prompts."""

    choice_agreement: float  # the share of prompts whose chosen option (free form: answer) stays the same
    confidence_correlation: float | None  # Spearman's ρ of the two versions' confidences (None: one is constant)


def choice_movement(active: np.ndarray, candidate: np.ndarray) -> ChoiceMovement:
    """Between two versions' option probabilities (one row per prompt, padded with zeros)."""
    if active.shape != candidate.shape or active.shape[0] < 2:
        raise ValueError(f"need the same prompts, at least two: {active.shape} and {candidate.shape}")
    return ChoiceMovement(float((active.argmax(1) == candidate.argmax(1)).mean()),
                          confidence_correlation(active.max(1), candidate.max(1)))


def confidence_correlation(active: Sequence[float], candidate: Sequence[float]) -> float | None:
    """Spearman's ρ: 1 when the candidate ranks the prompts by confidence as the active version does."""
    a, c = np.asarray(active, dtype=np.float64), np.asarray(candidate, dtype=np.float64)
    if np.ptp(a) == 0 or np.ptp(c) == 0:
        return None
    return float(spearmanr(a, c).statistic)
