"""Every training method's step (training/method_specs.py registers the names and what each trains).

A step takes the trainer (its model, α, batch streams and optimizer) and returns the step's log record. Steps apply
every gradient through `trainer.apply`, which averages it across processes under `accelerate launch` and steps the
optimizer, so θ and α are averaged the same way in every method.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from training.alpha_params import AlphaParams
from training.bome import bome_direction
from training.config import TrainConfig
from training.features import Batch, BatchStream
from training.objectives import cft_gap


class Trainer(Protocol):
    """The trainer as a step sees it (training/trainer.py implements it): the steps name no more than this."""

    cfg: TrainConfig
    theta: list[torch.nn.Parameter]
    alpha: AlphaParams
    train_stream: BatchStream
    calib_stream: BatchStream
    cft_bins: torch.Tensor | None

    def forward(self, batch: Batch): ...

    def calibrated(self, raw, batch: Batch) -> torch.Tensor: ...

    def g(self, batch: Batch, raw=None, smoothing: float = 0.0) -> torch.Tensor: ...

    def f(self, batch: Batch) -> torch.Tensor: ...

    def apply(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None: ...


def step_sft(t: "Trainer", smoothing: float = 0.0, cft: bool = False) -> dict:
    """Cross-entropy on θ only; α stays the identity."""
    batch = t.train_stream.next()
    raw = t.forward(batch)
    loss = t.g(batch, raw, smoothing)
    if cft:
        loss = loss + t.cfg.cft_weight * cft_gap(t.calibrated(raw, batch), t.cft_bins)
    t.apply(t.theta, torch.autograd.grad(loss, t.theta))
    return {"g": float(loss.detach())}


def step_label_smoothing(t: "Trainer") -> dict:
    return step_sft(t, smoothing=t.cfg.label_smoothing)


def step_cft(t: "Trainer") -> dict:
    """Calibration-aware fine-tuning: cross-entropy plus the gap between confidence and binned accuracy."""
    return step_sft(t, cft=True)


def step_regularization(t: "Trainer") -> dict:
    """Single level: g + w·f on θ and α together."""
    train, calib = t.train_stream.next(), t.calib_stream.next()
    g, f = t.g(train), t.f(calib)
    params = t.theta + t.alpha.trainable()
    t.apply(params, torch.autograd.grad(g + t.cfg.reg_weight * f, params))
    return {"g": float(g.detach()), "f": float(f.detach())}


def step_iterate(t: "Trainer") -> dict:
    """Alternating: a step of θ on g, then a step of α on f (no coupling between the levels)."""
    train, calib = t.train_stream.next(), t.calib_stream.next()
    g = t.g(train)
    t.apply(t.theta, torch.autograd.grad(g, t.theta))
    f = t.f(calib)
    alpha = t.alpha.trainable()
    t.apply(alpha, torch.autograd.grad(f, alpha))
    return {"g": float(g.detach()), "f": float(f.detach())}


def step_calm(t: "Trainer", hold_theta: bool = False) -> dict:
    """The BOME step: T inner steps give θ̃; q = g(α,θ) − g(α,θ̃); move (θ, α) along ∇f + λ∇q. With `hold_theta`
    only α moves, along the α part of that direction (λ from α's gradients alone): θ̃ still defines the constraint,
    but θ, hence every answer's ranking of options before the head, stays the parent's."""
    cfg = t.cfg
    train, calib = t.train_stream.next(), t.calib_stream.next()
    alpha = t.alpha.trainable()
    # ∇g(α, θ): also the first inner step's gradient.
    g = t.g(train)
    grads_g = torch.autograd.grad(g, t.theta + alpha)
    g_theta, g_alpha = grads_g[: len(t.theta)], grads_g[len(t.theta) :]
    # θ̃: T inner SGD steps on g(α, ·) from θ, then back to θ afterwards.
    saved = [p.detach().clone() for p in t.theta]
    with torch.no_grad():
        for p, gr in zip(t.theta, g_theta):
            p -= cfg.inner_lr * gr
    for _ in range(cfg.inner_steps - 1):
        inner = torch.autograd.grad(t.g(train), t.theta)
        with torch.no_grad():
            for p, gr in zip(t.theta, inner):
                p -= cfg.inner_lr * gr
    with torch.no_grad():  # θ̃ is detached: only α's gradient flows through g(α, θ̃)
        raw_tilde = t.forward(train)
    g_tilde = t.g(train, raw_tilde)
    g_alpha_tilde = torch.autograd.grad(g_tilde, alpha)
    with torch.no_grad():
        for p, s in zip(t.theta, saved):
            p.copy_(s)
    grad_q = list(g_theta) + [a - b for a, b in zip(g_alpha, g_alpha_tilde)]
    f = t.f(calib)
    grad_f = list(torch.autograd.grad(f, t.theta + alpha, allow_unused=True))
    grad_f = [torch.zeros_like(p) if gr is None else gr for p, gr in zip(t.theta + alpha, grad_f)]
    if hold_theta:
        n = len(t.theta)
        step = bome_direction(grad_f[n:], grad_q[n:], cfg.eta)
        t.apply(alpha, step.direction)
    else:
        step = bome_direction(grad_f, grad_q, cfg.eta)
        t.apply(t.theta + alpha, step.direction)
    return {"g": float(g.detach()), "f": float(f.detach()), "q": float((g - g_tilde).detach()), "lambda": step.lam,
            "grad_q_sq": step.grad_q_sq, "entropy": -float(f.detach())}


def step_calm_head(t: "Trainer") -> dict:
    return step_calm(t, hold_theta=True)


# Each method's step, by the name training/method_specs.py registers it under (its spec says what it trains).
STEPS: dict[str, Callable[["Trainer"], dict]] = {
    "sft": step_sft, "label_smoothing": step_label_smoothing, "cft": step_cft, "regularization": step_regularization,
    "iterate": step_iterate, "calm": step_calm, "calm_scalar": step_calm, "calm_head": step_calm_head,
}
