"""The calibration head α = (d, l): calibrated logits are d ⊙ z + l, d > 0 per token (d = 1/τ), l a per-token shift.

A scalar head (one d, l = 0) is the ablation "CALM with scalar α" and equals temperature scaling. The functions work
on numpy arrays and torch tensors alike (broadcast over leading dimensions), so training, evaluation and the vLLM
logits processor share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np


class HeadKind(str, Enum):
    VECTOR = "vector"
    SCALAR = "scalar"


@dataclass(frozen=True)
class AlphaHead:
    """scale: d, shape (V,) or (1,); shift: l, same shape. Stored float32."""

    scale: np.ndarray
    shift: np.ndarray

    def __post_init__(self):
        scale = np.asarray(self.scale, dtype=np.float32)
        shift = np.asarray(self.shift, dtype=np.float32)
        if scale.ndim != 1 or shift.shape != scale.shape:
            raise ValueError(f"Expected 1-D `scale` and `shift` of equal shape, but got {scale.shape} and {shift.shape}")
        if not np.all(np.isfinite(scale)) or not np.all(np.isfinite(shift)):
            raise ValueError("Expected finite `scale` and `shift`")
        if np.any(scale <= 0):
            raise ValueError(f"Expected `scale` > 0 everywhere (d = 1/τ), but got minimum {scale.min()}")
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "shift", shift)

    @property
    def kind(self) -> HeadKind:
        return HeadKind.SCALAR if self.scale.shape == (1,) else HeadKind.VECTOR

    @property
    def size(self) -> int:
        return int(self.scale.shape[0])

    @property
    def keeps_order(self) -> bool:
        """One scale and one shift for every token (a temperature): the tokens' order, so the argmax, is unchanged."""
        return bool(np.all(self.scale == self.scale[0]) and np.all(self.shift == self.shift[0]))

    @classmethod
    def identity(cls, vocab_size: int) -> "AlphaHead":
        return cls(np.ones(vocab_size, np.float32), np.zeros(vocab_size, np.float32))

    @classmethod
    def scalar(cls, temperature: float) -> "AlphaHead":
        if not temperature > 0:
            raise ValueError(f"Expected `temperature` > 0, but got {temperature!r}")
        return cls(np.array([1.0 / temperature], np.float32), np.zeros(1, np.float32))

    def check_vocab(self, vocab_size: int) -> None:
        if self.kind is HeadKind.VECTOR and self.size != vocab_size:
            raise ValueError(f"alpha head has {self.size} entries but the model's vocabulary has {vocab_size}")

    def rows(self, token_ids) -> tuple[np.ndarray, np.ndarray]:
        """(d, l) for the given token ids; a scalar head broadcasts."""
        if self.kind is HeadKind.SCALAR:
            ids = np.zeros_like(np.asarray(token_ids))
        else:
            ids = np.asarray(token_ids)
        return self.scale[ids], self.shift[ids]


def apply_alpha(logits, scale, shift):
    """d ⊙ z + l over the last dimension; works for numpy arrays and torch tensors."""
    return logits * scale + shift
