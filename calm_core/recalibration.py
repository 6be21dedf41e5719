"""Labelled recalibration of multiple-choice answers: one temperature on a version's option scores, fitted on a
domain's labels in seconds, and the held-out check that decides whether it may serve (pure functions).

Why a temperature on the option scores, rather than Platt or isotonic on the chosen option's confidence:
- it divides every option's score by one number, so the most probable option, hence the answer and the accuracy,
  never changes, and the options still sum to one (the `options` field and sampled answers stay coherent);
- it corrects both directions: T < 1 sharpens an under-confident head, T > 1 flattens an over-confident one, where
  CALM's label-free upper level (maximum entropy) can only flatten;
- one parameter fits from a few hundred labels without overfitting them; a two-parameter Platt map on the top
  option's confidence would leave the other options' probabilities inconsistent with it, and isotonic needs
  thousands of labels to be smooth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar

from calm_core.metrics import auroc, binned_calibration_error
from calm_core.served_answers import JudgedChoice
from calm_core.scoring import options_softmax

AUROC_TOLERANCE = 0.01  # a temperature reorders answers across questions only slightly; more than this is a change


def tempered(log_probs: Sequence[np.ndarray], temperature: float) -> list[np.ndarray]:
    """softmax(scores / T) per question (any scores that are log-probs up to a constant: option log-probs, cloze
    scores)."""
    return [options_softmax(np.asarray(lp, dtype=np.float64) / temperature).probs for lp in log_probs]


def fit_temperature(log_probs: Sequence[np.ndarray], labels: Sequence[int],
                    judged: Sequence[JudgedChoice] = ()) -> float:
    """The T in [0.05, 20] minimising the negative log-likelihood under softmax(scores / T) of the labelled questions
    (the right option's probability) and of served answers judged by feedback (`judged`: the chosen option's
    probability if it was right, one minus it if not; which option was right is unknown then)."""
    if len(log_probs) != len(labels) or len(log_probs) + len(judged) == 0:
        raise ValueError("need one label per scored question, at least one question or judged answer")

    def nll(log_t: float) -> float:
        t = float(np.exp(log_t))
        terms = [np.log(max(p[y], 1e-300)) for p, y in zip(tempered(log_probs, t), labels)]
        for j, p in zip(judged, tempered([j.log_probs for j in judged], t)):
            terms.append(np.log(max(p[j.chosen] if j.correct else 1.0 - p[j.chosen], 1e-300)))
        return -float(np.mean(terms))

    return float(np.exp(minimize_scalar(nll, bounds=(np.log(0.05), np.log(20.0)), method="bounded").x))


@dataclass(frozen=True)
class HeldOutCheck:
    """A temperature judged on labels it was not fitted on: ECE must fall and AUROC must not."""

    n: int
    temperature: float
    accuracy: float
    ece_before: float
    ece_after: float
    auroc_before: float
    auroc_after: float
    mean_confidence_before: float
    mean_confidence_after: float

    @property
    def passed(self) -> bool:
        return self.ece_after < self.ece_before and not self.auroc_after < self.auroc_before - AUROC_TOLERANCE

    @property
    def reason(self) -> str:
        verdict = "passes" if self.passed else "fails"
        return (f"T = {self.temperature:.3f} {verdict} on {self.n} held-out labels: ECE {self.ece_before:.3f} -> "
                f"{self.ece_after:.3f} (must fall), AUROC {self.auroc_before:.3f} -> {self.auroc_after:.3f} (must not "
                f"fall by more than {AUROC_TOLERANCE}), accuracy {self.accuracy:.3f} unchanged")


def check_held_out(log_probs: Sequence[np.ndarray], labels: Sequence[int], temperature: float,
                   judged: Sequence[JudgedChoice] = ()) -> HeldOutCheck:
    """The map judged on held-out labelled questions (their top option against the label) and judged answers (the
    chosen option's confidence against the verdict)."""
    before, after = tempered(log_probs, 1.0), tempered(log_probs, temperature)
    judged_scores = [j.log_probs for j in judged]
    chosen_b = [p[j.chosen] for j, p in zip(judged, tempered(judged_scores, 1.0))]
    chosen_a = [p[j.chosen] for j, p in zip(judged, tempered(judged_scores, temperature))]
    conf_b, conf_a = [p.max() for p in before] + chosen_b, [p.max() for p in after] + chosen_a
    correct = [int(np.argmax(p)) == y for p, y in zip(before, labels)] + [j.correct for j in judged]
    return _held_out(np.array(conf_b), np.array(conf_a), np.array(correct, dtype=bool), temperature)


def _held_out(conf_b: np.ndarray, conf_a: np.ndarray, correct: np.ndarray, temperature: float) -> HeldOutCheck:
    """The numbers of a map judged on held-out labels: confidences before and after it, and the verdicts."""
    return HeldOutCheck(len(correct), temperature, float(correct.mean()),
                        binned_calibration_error(conf_b, correct), binned_calibration_error(conf_a, correct),
                        auroc(conf_b, correct), auroc(conf_a, correct), float(conf_b.mean()), float(conf_a.mean()))


def powered(confidence: float | np.ndarray, temperature: float) -> float | np.ndarray:
    """A free-form answer's token confidence c (exp of its mean token log-prob) as c ** (1 / T): the mean log-prob
    divided by T. Monotone, so the ranking of answers (AUROC) and the answers themselves never change."""
    if temperature == 1.0:
        return confidence
    return np.clip(confidence, 1e-300, 1.0) ** (1.0 / temperature)


def fit_confidence_temperature(confidence: Sequence[float], correct: Sequence[bool]) -> float:
    """The T in [0.05, 20] minimising the Bernoulli negative log-likelihood of c ** (1 / T) on labelled answers (the
    free-form counterpart of `fit_temperature`: one number, both directions)."""
    conf, y = np.asarray(confidence, dtype=np.float64), np.asarray(correct, dtype=np.float64)
    if len(conf) == 0 or len(conf) != len(y):
        raise ValueError("need one verdict per answer, at least one")

    def nll(log_t: float) -> float:
        p = np.clip(powered(conf, float(np.exp(log_t))), 1e-12, 1 - 1e-12)
        return -float(np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))

    return float(np.exp(minimize_scalar(nll, bounds=(np.log(0.05), np.log(20.0)), method="bounded").x))


def check_held_out_confidence(confidence: Sequence[float], correct: Sequence[bool], temperature: float) -> HeldOutCheck:
    conf_b = np.asarray(confidence, dtype=np.float64)
    return _held_out(conf_b, np.asarray(powered(conf_b, temperature)), np.asarray(correct, dtype=bool), temperature)


def split_fit_held_out(n: int, held_out: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the fitting and held-out parts of n labels (a seeded shuffle; at least one in each)."""
    if n < 2:
        raise ValueError("need at least two labels: one to fit on, one to check on")
    order = np.random.default_rng(seed).permutation(n)
    k = min(max(1, round(n * held_out)), n - 1)
    return np.sort(order[k:]), np.sort(order[:k])
