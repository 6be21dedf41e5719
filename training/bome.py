"""The first-order bilevel step of BOME (Liu et al. 2022, arXiv 2209.08709), pure torch.

Given ∇f (upper level) and ∇q, q(α,θ) = g(α,θ) − g(α,θ̃) with θ̃ the detached result of T inner steps, over the
joint parameters (θ, α):
    λ = max(φ − ⟨∇f, ∇q⟩, 0) / (‖∇q‖² + ε),  φ = η‖∇q‖²
and the step direction is ∇f + λ∇q. λ is the smallest multiplier that makes the step decrease q at rate φ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BomeStep:
    direction: list[torch.Tensor]
    lam: float
    grad_q_sq: float
    inner: float  # ⟨∇f, ∇q⟩


def bome_direction(grad_f: list[torch.Tensor], grad_q: list[torch.Tensor], eta: float, eps: float = 1e-12) -> BomeStep:
    if len(grad_f) != len(grad_q):
        raise ValueError(f"Expected gradients for the same parameters, but got {len(grad_f)} and {len(grad_q)}")
    q_sq = sum(float((gq * gq).sum()) for gq in grad_q)
    inner = sum(float((gf * gq).sum()) for gf, gq in zip(grad_f, grad_q))
    lam = max(eta * q_sq - inner, 0.0) / (q_sq + eps)
    return BomeStep([gf + lam * gq for gf, gq in zip(grad_f, grad_q)], lam, q_sq, inner)
