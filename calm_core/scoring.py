"""The answer-scoring rules, shared by training, `calm eval` and the gateway (pure numpy functions).

How each answer format turns calibrated log-probs into option scores, the options' distribution, confidence and
entropy. The prompts and token ids each format scores come from calm_core.prompts (`letter_prompt`,
`letter_token_ids`, `cloze_tokens`); the α head from calm_core.alpha_head. Training applies the same rules to
batches of torch tensors (training/cloze.py's `option_scores` is `cloze_scores` over a packed batch); a test checks
the two agree.

Multiple choice: the engine returns the calibrated log-prob of every option's answer token at the first position;
confidence is the chosen option's probability after renormalising over the options (softmax of d ⊙ z + l restricted
to the option tokens). Entropy is that distribution's Shannon entropy (nats).

Multiple choice by cloze (heads fitted with answer_format "cloze"): each option's score is the mean calibrated
log-prob of its text's tokens after the question, log softmax(d ⊙ z + l)[y_t] with teacher forcing; the options'
distribution is the softmax of the scores, as in training.

Free form: confidence is the geometric mean of the generated tokens' calibrated probabilities,
exp(mean_t log p(y_t | y_<t, x)) — length-normalised so long answers are not penalised for their length alone.
Entropy is the mean over positions of the entropy of the renormalised top-k calibrated distribution (a lower bound
on the full-vocabulary entropy when k < V).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class OptionDistribution:
    probs: np.ndarray  # over options, sums to 1
    chosen: int

    @property
    def confidence(self) -> float:
        return float(self.probs[self.chosen])

    @property
    def entropy(self) -> float:
        p = self.probs[self.probs > 0]
        return float(-(p * np.log(p)).sum())


def log_softmax_np(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def option_probs(option_logits: np.ndarray, n_options: np.ndarray | None = None) -> np.ndarray:
    """Softmax over each row's first n_options entries (the options' answer tokens); padding gets probability 0."""
    option_logits = np.asarray(option_logits, dtype=np.float64)
    if n_options is None:
        return np.exp(log_softmax_np(option_logits))
    mask = np.arange(option_logits.shape[1])[None, :] < np.asarray(n_options)[:, None]
    masked = np.where(mask, option_logits, -np.inf)
    probs = np.exp(log_softmax_np(masked))
    return np.where(mask, probs, 0.0)


def option_distribution(logprobs: dict[int, float], option_token_ids: Sequence[int], chosen_token: int | None = None,
                        temperature: float = 1.0) -> OptionDistribution:
    """Renormalise the options' log-probs (divided by a recalibrated version's temperature); the chosen option is the
    sampled one, else the most probable."""
    lp = np.array([logprobs.get(t, -math.inf) for t in option_token_ids], dtype=np.float64) / temperature
    ids = list(option_token_ids)
    return options_softmax(lp, ids.index(chosen_token) if chosen_token in ids else None)


def options_softmax(scores: Sequence[float], chosen: int | None = None) -> OptionDistribution:
    """softmax over the options' scores (log-probs, or cloze scores); without a chosen option, the most probable."""
    lp = np.asarray(scores, dtype=np.float64)
    if not np.isfinite(lp).any():
        raise ValueError("the engine returned no finite log-prob for any option")
    probs = option_probs(lp[None])[0]
    return OptionDistribution(probs, int(np.argmax(probs)) if chosen is None else chosen)


def cloze_scores(option_token_logprobs: Sequence[Sequence[float]]) -> np.ndarray:
    """Each option's mean calibrated token log-prob (the score training fits the head on, training/cloze.py)."""
    return np.array([float(np.mean(lps)) for lps in option_token_logprobs], dtype=np.float64)


def sequence_confidence(token_logprobs: Sequence[float]) -> float:
    """exp of the mean calibrated token log-prob; 0 answers tokens-free output with confidence 1 (nothing claimed)."""
    finite = [lp for lp in token_logprobs if math.isfinite(lp)]
    if not finite:
        return 1.0 if not token_logprobs else 0.0
    return float(math.exp(sum(finite) / len(finite)))


def topk_entropy(top_logprobs: Sequence[dict[int, float]]) -> float:
    """Mean over positions of the entropy of each position's renormalised top-k distribution (nats).

    Plain floats, not numpy: a position holds a handful of values, where numpy's per-call cost was most of a free-form
    answer's scoring time."""
    total, positions = 0.0, 0
    for position in top_logprobs:
        lp = [v for v in position.values() if math.isfinite(v)]
        if not lp:
            continue
        top = max(lp)
        # Tokens masked by top-k / min-p (-inf, or -9999 over HTTP) carry no mass: exp underflows to 0, left out.
        weights = [w for w in (math.exp(v - top) for v in lp) if w > 0.0]
        z = sum(weights)
        total -= sum(w / z * math.log(w / z) for w in weights)
        positions += 1
    return total / positions if positions else 0.0
