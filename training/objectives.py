"""Losses over the answer distribution, pure torch.

`logits` are calibrated option logits, (B, K_max) (letter logits or cloze option scores, see answer_formats.py),
with `-inf` where a question has fewer options; `labels` are gold option indices.
"""

from __future__ import annotations

import torch


def mask_options(logits: torch.Tensor, n_options: torch.Tensor) -> torch.Tensor:
    keep = torch.arange(logits.shape[-1], device=logits.device)[None, :] < n_options[:, None]
    return logits.masked_fill(~keep, float("-inf"))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    """Mean CE of the gold option; with smoothing, the target spreads `smoothing` evenly over the real options."""
    logp = torch.log_softmax(logits, -1)
    nll = -logp.gather(1, labels[:, None]).squeeze(1)
    if smoothing == 0.0:
        return nll.mean()
    real = torch.isfinite(logits)
    uniform = -(logp.masked_fill(~real, 0.0)).sum(-1) / real.sum(-1)
    return ((1 - smoothing) * nll + smoothing * uniform).mean()


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-row Shannon entropy (nats) of softmax(logits); -inf entries contribute nothing."""
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    return -(p * logp.masked_fill(~torch.isfinite(logp), 0.0)).sum(-1)


def cft_gap(logits: torch.Tensor, bin_accuracy: torch.Tensor) -> torch.Tensor:
    """Calibration-aware fine-tuning term: mean squared gap between each answer's confidence and the accuracy of its
    confidence bin, bin accuracies fixed from the initial model (len(bin_accuracy) equal-width bins)."""
    conf = torch.softmax(logits, -1).max(-1).values
    n_bins = bin_accuracy.shape[0]
    idx = torch.clamp((conf.detach() * n_bins).long(), max=n_bins - 1)
    return ((conf - bin_accuracy[idx]) ** 2).mean()


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float((logits.argmax(-1) == labels).float().mean())
