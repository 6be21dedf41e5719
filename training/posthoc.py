"""Post-hoc calibration baselines on the fine-tuned model's logits, reused instead of retraining: temperature scaling
(one scalar) and vector scaling (a scale and a shift per option slot) fitted on labelled validation option logits;
temperature scaling of free-form answers fitted on gold answer tokens; DACA, a label-free temperature fitted where the
model before fine-tuning and the fine-tuned one agree."""

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


def fit_daca_temperature(z_reference, z_target, mask=None) -> float:
    """DACA (arXiv 2505.16690), label-free: T minimising KL(p_reference ‖ softmax(z_target / T)) over the rows where
    the two models agree on the top answer (disagreements would pull T towards uniform); reference = the model before
    fine-tuning, target = the fine-tuned one. Rows are questions (option logits, -inf where a question has no option)
    or answer positions (vocabulary logits). `mask`: rows to use at all. T clipped to [0.01, 100]; no agreeing row: 1."""
    zr, zt = torch.as_tensor(z_reference, dtype=torch.float64), torch.as_tensor(z_target, dtype=torch.float64)
    agree = zr.argmax(-1) == zt.argmax(-1)
    if mask is not None:
        agree &= torch.as_tensor(mask, dtype=torch.bool)
    if not bool(agree.any()):
        return 1.0
    zr, zt = zr[agree], zt[agree]
    p_ref = torch.softmax(zr, -1)
    finite = torch.isfinite(zt)
    log_t = torch.zeros(1, dtype=torch.float64, requires_grad=True)

    zt = zt.masked_fill(~finite, 0.0)  # -inf / T would make T's gradient NaN: masked after scaling instead

    def loss():
        logq = torch.log_softmax((zt / log_t.exp()).masked_fill(~finite, float("-inf")), -1).masked_fill(~finite, 0.0)
        return -(p_ref * logq).sum(-1).mean()  # KL up to the reference's entropy, a constant in T

    _fit([log_t], loss)
    return float(np.clip(np.exp(log_t.item()), 0.01, MAX_TEMPERATURE))


def fit_token_temperature(z: torch.Tensor, targets: torch.Tensor) -> float:
    """T minimising the mean NLL of labelled answer tokens under softmax(z / T): temperature scaling of free-form
    answers, fitted on gold answers to labelled calibration questions ((P, V) logits at their positions)."""
    z, targets = z.double(), targets.long()
    log_t = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    _fit([log_t], lambda: torch.nn.functional.cross_entropy(z / log_t.exp(), targets))
    return float(np.clip(np.exp(log_t.item()), 0.01, MAX_TEMPERATURE))
