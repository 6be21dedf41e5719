"""Post-hoc calibration baselines fitted on labelled validation logits: temperature scaling (one scalar) and vector
scaling (a scale and a shift per option slot). Both act on the fine-tuned model's option logits (letter logits or cloze
option scores), so they reuse them instead of retraining."""

from __future__ import annotations

import numpy as np
import torch

from training.objectives import cross_entropy, mask_options

MAX_TEMPERATURE = 100.0


def _fit(params: list[torch.Tensor], loss_fn, steps: int = 200) -> None:
    opt = torch.optim.LBFGS(params, lr=0.5, max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    opt.step(closure)


def fit_temperature(z: np.ndarray, labels: np.ndarray, n_options: np.ndarray) -> float:
    """T minimising validation NLL of softmax(z / T) over each question's options (T clipped to [0.01, 100])."""
    zt, yt, nt = torch.tensor(z), torch.tensor(labels), torch.tensor(n_options)
    log_t = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    _fit([log_t], lambda: cross_entropy(mask_options(zt / log_t.exp(), nt), yt))
    return float(np.clip(np.exp(log_t.item()), 0.01, MAX_TEMPERATURE))


def fit_vector_scaling(z: np.ndarray, labels: np.ndarray, n_options: np.ndarray, l2: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """(d, l) per option slot minimising validation NLL of softmax(d ⊙ z + l), lightly L2-regularised towards
    identity so slots rarely seen as answers stay put."""
    zt, yt, nt = torch.tensor(z), torch.tensor(labels), torch.tensor(n_options)
    s = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    l = torch.zeros(z.shape[1], dtype=torch.float64, requires_grad=True)
    _fit([s, l], lambda: cross_entropy(mask_options(zt * s.exp() + l, nt), yt) + l2 * (s.square().sum() + l.square().sum()))
    return np.exp(s.detach().numpy()), l.detach().numpy()
