"""The trainable α head: d = exp(s) keeps every scale positive; l is a free shift. Scalar variant: one s, no shift."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from calm_core.alpha_head import AlphaHead


class AlphaParams(nn.Module):
    def __init__(self, vocab_size: int, scalar: bool = False):
        super().__init__()
        size = 1 if scalar else vocab_size
        self.scalar = scalar
        self.log_scale = nn.Parameter(torch.zeros(size))
        # A scalar head's shift would add one constant to every logit: no effect on any softmax, so none is learned.
        self.shift = nn.Parameter(torch.zeros(size), requires_grad=not scalar)

    @classmethod
    def from_head(cls, head: AlphaHead) -> "AlphaParams":
        """A fixed head as parameters (evaluation reuses the training code's formats with it)."""
        params = cls(head.size, scalar=head.kind.value == "scalar")
        with torch.no_grad():
            params.log_scale.copy_(torch.as_tensor(np.log(head.scale)))
            params.shift.copy_(torch.as_tensor(head.shift))
        return params.requires_grad_(False)

    def rows(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scalar:
            return self.log_scale.exp().expand(len(token_ids)), self.shift.expand(len(token_ids))
        return self.log_scale[token_ids].exp(), self.shift[token_ids]

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.log_scale.exp(), self.shift

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in (self.log_scale, self.shift) if p.requires_grad]

    def to_head(self) -> AlphaHead:
        d, l = self.full()
        return AlphaHead(d.detach().cpu().numpy().astype(np.float32), l.detach().cpu().numpy().astype(np.float32))
