"""Inside an in-process CPU engine's core: its OpenMP team re-sized before every step to its share of the cores among
the engines computing at that moment (adapters/hosting/core_share.py).

A vLLM logits processor, because that is the hook vLLM calls in the engine core at every step: `update_state` before
the forward pass (the step starts: take the share, `torch.set_num_threads` where it changed, which the forward pass's
parallel regions then use), `apply` after it (the step ended). It leaves the logits as they are. Configured by the
gateway through `additional_config["calm_core_share"]` (the board's path, this engine's row, the usable cores); an
engine without it (`calm engine`, a stock vLLM, fixed thread counts) runs it as a no-op.
"""

from __future__ import annotations

import time

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from adapters.hosting.core_share import CoreBoard
from adapters.vllm_plugins.common import CORE_SHARE_KEY, additional_config


class CoreShareLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        share = additional_config(vllm_config).get(CORE_SHARE_KEY)
        self.board = CoreBoard(share["path"]) if share else None
        self.slot = share["slot"] if share else 0
        self.cpus = share["cpus"] if share else 0
        self.team = torch.get_num_threads()
        self.requests = 0  # in the engine's batch

    def is_argmax_invariant(self) -> bool:
        # vLLM skips argmax-invariant processors' `apply` when every request is greedy; this one must see every step.
        return self.board is None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if self.board is None:
            return
        if batch_update is not None:
            self.requests = batch_update.batch_size
        if self.requests == 0:  # the last requests left the batch: vLLM runs no forward pass on an empty one
            self.board.went_idle(self.slot)
            return
        team = self.board.step_started(self.slot, time.monotonic(), self.cpus)
        if team != self.team:
            # torch's own function: vLLM's CPU worker replaces `torch.set_num_threads` by a no-op that warns, for
            # workers whose OpenMP threads it bound to cores (its "mp" executor); the "uni" executor binds none.
            torch._C.set_num_threads(team)
            self.team = team

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.board is not None:
            self.board.step_ended(self.slot, time.monotonic())
        return logits
