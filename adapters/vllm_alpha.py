"""The α head inside vLLM: a v1 batch-level logits processor computing d ⊙ z + l for every request.

vLLM builds one instance per engine (worker process) and calls `apply` on the whole batch, so the artifact is loaded
once, at construction, from the folder named by the engine's `additional_config["calm_artifact"]` (several engines in
one process each carry their own head), else by $CALM_ARTIFACT (the `calm engine` server). With the engine's `logprobs_mode` set to
`processed_logprobs`, the log-probs vLLM returns are the calibrated ones (raw modes would return uncalibrated
numbers). A request opts out with `extra_args={"calm_alpha": False}` (HTTP: `vllm_xargs`).
Written against vLLM 0.32's interface (pinned in pyproject); the interface moves between versions.
"""

from __future__ import annotations

import os

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from adapters.vllm_common import ARTIFACT_CONFIG_KEY, ARTIFACT_ENV, OPT_OUT_KEY
from calm_core.alpha_head import apply_alpha
from calm_core.artifact import load_artifact


_OFF = (False, 0, "0", "false", "off")


def wants_alpha(params: SamplingParams) -> bool:
    # HTTP's vllm_xargs carries no booleans, so 0 / "false" / "off" opt out as well as False.
    return not (params.extra_args and params.extra_args.get(OPT_OUT_KEY, True) in _OFF)


class AlphaHeadLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        extra = getattr(vllm_config, "additional_config", None) or {}
        path = (extra.get(ARTIFACT_CONFIG_KEY) if isinstance(extra, dict) else None) or os.environ.get(ARTIFACT_ENV)
        if not path:
            raise ValueError(f"AlphaHeadLogitsProcessor needs ${ARTIFACT_ENV} naming an alpha-head artifact folder")
        vocab = vllm_config.model_config.get_vocab_size() if vllm_config is not None else None
        loaded = load_artifact(path, expect_vocab_size=vocab)
        head = loaded.head
        self.artifact_version = loaded.manifest.artifact_version
        self.scale = torch.as_tensor(head.scale, device=device)
        self.shift = torch.as_tensor(head.shift, device=device)
        self.opted_out: set[int] = set()  # batch rows whose request asked for raw logits

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        args = sampling_params.extra_args or {}
        if OPT_OUT_KEY in args and args[OPT_OUT_KEY] not in (*_OFF, True, 1, "1", "true", "on"):
            raise ValueError(f"extra_args[{OPT_OUT_KEY!r}] must be a boolean (or 0/1)")

    def is_argmax_invariant(self) -> bool:
        return False  # per-token scales and shifts can change which token is most likely

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index, params, _, _ in batch_update.added:
            if wants_alpha(params):
                self.opted_out.discard(index)
            else:
                self.opted_out.add(index)
        for index in batch_update.removed:
            self.opted_out.discard(index)
        for a, b, direction in batch_update.moved:
            a_out, b_out = a in self.opted_out, b in self.opted_out
            self.opted_out.discard(a)
            self.opted_out.discard(b)
            if a_out:
                self.opted_out.add(b)
            if b_out and direction == MoveDirectionality.SWAP:
                self.opted_out.add(a)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        width = logits.shape[-1]
        scale, shift = self.scale[:width].to(logits.dtype), self.shift[:width].to(logits.dtype)
        rows = [i for i in self.opted_out if i < logits.shape[0]]
        if not rows:
            return apply_alpha(logits, scale, shift)
        keep = logits[rows].clone()
        out = apply_alpha(logits, scale, shift)
        out[rows] = keep
        return out
