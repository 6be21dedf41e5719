"""The α head under vLLM's Model Runner V2 (what vLLM runs on GPUs wherever Triton is installed, and the only runner
from vLLM 0.34 on): a logits processor with state per request slot.

vLLM calls `add_request` when a request takes a slot (slots are recycled, so every call overwrites the slot's head),
`apply_staged_writes` once per step before the forward pass, and `apply` on the step's logits rows, each row mapped
to its slot by `ctx.expanded_idx_mapping`. The slot -> head table lives on the host (to choose the path without a
device sync) and in a device tensor that vLLM's own UVA buffer keeps current (the row gather in a mixed batch).
V2 calls custom processors after its built-in bias, penalty and bad-words stages (V1: before penalties) and before
temperature, min-p and top-k/top-p; as on V1, processed log-probs are taken after all of them.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor, LogitsProcRequestState

from adapters.vllm_plugins.alpha_heads import IDENTITY, EngineHeads, HeadProcessor


class AlphaHeadV2(HeadProcessor, LogitsProcessor):
    def __init__(self, vllm_config, req_states: LogitsProcRequestState):
        # Imported here, as vLLM's own built-in processors do: the front end loads this class to validate requests,
        # and the buffers module is the model runner's.
        from vllm.v1.worker.gpu.buffer_utils import UvaBackedTensor

        self.heads = EngineHeads(vllm_config, req_states.device)
        self.slot_head = UvaBackedTensor(req_states.max_num_reqs, dtype=torch.int32)  # .np on the host, .gpu
        self._staged = False

    def add_request(self, req_idx: int, sampling_params) -> bool:
        if not self.active:
            return False
        head = self.heads.index(sampling_params)
        self.slot_head.np[req_idx] = head
        self._staged = True
        return head != IDENTITY

    def apply_staged_writes(self) -> None:
        if self._staged:
            self.slot_head.copy_to_uva()
            self._staged = False

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self.active:
            return logits
        batch = self.slot_head.np[ctx.idx_mapping_np]
        return self.heads.table.apply(logits, batch, lambda: self.slot_head.gpu[ctx.expanded_idx_mapping].long())
