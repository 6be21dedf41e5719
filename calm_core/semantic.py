"""Semantic confidence: how often the model, sampled, says what it answered; and a version's map from that share to a
calibrated probability (pure functions).

The answer a user gets is never a sample: it is the answer token confidence would return for the same request. The
samples only measure agreement. They are drawn from the mode's weights *without* its α head at a moderate temperature:
the head flattens the distribution on purpose (the shipped free-form mode's d ≈ 0.63, temperature ≈ 1.6), and samples
from it are mostly noise that agrees with nothing, so every answer would score the same. Without the head, at 0.5, the
model's samples are answers it would plausibly give, and how many of them say what the returned answer says ranks
right answers above wrong ones (`benchmarks/scoring/bench_semantic_sampling.py` compares temperatures). That share is then mapped to a probability by the version's `SemanticCalibration`: a
Platt map on the logit of the smoothed share, fitted once per version (`calm artifacts fit-semantic`), either label-free (onto
the version's own calibrated token confidence of the same answers, the number CALM's head makes honest without
labels) or on labelled questions where there are some.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, Field

# bench_semantic_sampling.py: the share ranks answers best at 0.5-0.7 (AUROC 0.69-0.90), worse at 1.0 (0.57-0.66), and
# through the head no sample agreed at all; 0.5 over 0.7 for twice the mean share (fewer answers tied at 0 agreeing).
SAMPLE_TEMPERATURE = 0.5
SAMPLE_TOKENS = 48  # as many as an evaluated greedy answer: agreement is read on both answers' first 24 words


class SemanticCalibration(BaseModel):
    """A free-form mode's semantic-confidence settings: how samples are drawn, and the map from share to probability."""

    temperature: float = Field(default=SAMPLE_TEMPERATURE, gt=0)
    max_tokens: int = Field(default=SAMPLE_TOKENS, ge=1)
    slope: float = 1.0
    intercept: float = 0.0
    fitted_on: str = "not fitted: the smoothed share itself"

    def confidence(self, agreeing: int, n: int) -> float:
        return float(_sigmoid(self.slope * _logit(smoothed_share(agreeing, n)) + self.intercept))


def smoothed_share(agreeing: int, n: int) -> float:
    """The share of samples that agree, pulled toward 1/2 by half a sample (never 0 or 1: a logit exists)."""
    if not 0 <= agreeing <= n:
        raise ValueError(f"{agreeing} of {n} samples cannot agree")
    return (agreeing + 0.5) / (n + 1)


def fit_platt(shares: Sequence[float], targets: Sequence[float]) -> tuple[float, float]:
    """Slope and intercept of sigmoid(a · logit(share) + b) minimising the cross-entropy to `targets` in [0, 1]: the
    right/wrong labels of the answers, or (label-free) another calibrated probability of the same answers. Newton's
    method (damped) on a convex objective with a small ridge on the slope, so a set where every share is equal still fits."""
    x = _logit(np.clip(np.asarray(shares, dtype=float), 1e-6, 1 - 1e-6))
    y = np.asarray(targets, dtype=float)
    if x.shape != y.shape or x.size == 0 or np.any((y < 0) | (y > 1)):
        raise ValueError("need as many targets in [0, 1] as shares, at least one")
    features = np.stack([x, np.ones_like(x)], axis=1)
    prior, ridge = np.array([1.0, 0.0]), np.diag([1e-3, 0.0])

    def loss(w):
        z = features @ w
        return float(np.mean(np.logaddexp(0, z) - y * z) + 0.5 * (w - prior) @ ridge @ (w - prior))

    w = prior.copy()
    for _ in range(100):
        p = _sigmoid(features @ w)
        grad = features.T @ (p - y) / len(y) + ridge @ (w - prior)
        hess = (features * (p * (1 - p))[:, None]).T @ features / len(y) + ridge + 1e-9 * np.eye(2)
        step, before = np.linalg.solve(hess, grad), loss(w)
        while loss(w - step) > before and np.max(np.abs(step)) > 1e-12:  # damped: Newton overshoots far from the optimum
            step = step / 2
        w = w - step
        if np.max(np.abs(step)) < 1e-10:
            break
    return float(w[0]), float(w[1])


def _logit(p):
    return np.log(p) - np.log1p(-p) if isinstance(p, np.ndarray) else math.log(p) - math.log1p(-p)


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))
