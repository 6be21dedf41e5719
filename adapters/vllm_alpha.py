"""The α head inside vLLM: a v1 batch-level logits processor computing d ⊙ z + l for every request.

vLLM builds one instance per engine (worker process) and calls `apply` on the whole batch, so the artifact is loaded
once, at construction, from the folder named by the engine's `additional_config["calm_artifact"]` (several engines in
one process each carry their own head), else by $CALM_ARTIFACT (the `calm engine` server). With the engine's `logprobs_mode` set to
`processed_logprobs`, the log-probs vLLM returns are the calibrated ones (raw modes would return uncalibrated
numbers). A request opts out with `extra_args={"calm_alpha": False}` (HTTP: `vllm_xargs`), or names another artifact's
head with `extra_args={"calm_head": "/path/to/artifact"}` (one engine serving several artifact versions).
Written against vLLM 0.32's interface (pinned in pyproject); the interface moves between versions.
"""

from __future__ import annotations

import os

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from adapters.vllm_common import ARTIFACT_CONFIG_KEY, ARTIFACT_ENV, HEAD_ARG_KEY, OPT_OUT_KEY
from calm_core.alpha_head import apply_alpha
from calm_core.artifact import load_artifact


_OFF = (False, 0, "0", "false", "off")
_RAW = ""  # a row's head key: the request opted out (raw logits)


def wants_alpha(params: SamplingParams) -> bool:
    # HTTP's vllm_xargs carries no booleans, so 0 / "false" / "off" opt out as well as False.
    return not (params.extra_args and params.extra_args.get(OPT_OUT_KEY, True) in _OFF)


def head_key(params: SamplingParams) -> str | None:
    """Which head a request wants: _RAW (none), an artifact folder (`extra_args["calm_head"]`: several artifact
    versions served by one engine, e.g. vLLM multi-LoRA on CUDA), or None for the engine's own head."""
    if not wants_alpha(params):
        return _RAW
    return (params.extra_args or {}).get(HEAD_ARG_KEY) or None


class AlphaHeadLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        extra = getattr(vllm_config, "additional_config", None) or {}
        path = (extra.get(ARTIFACT_CONFIG_KEY) if isinstance(extra, dict) else None) or os.environ.get(ARTIFACT_ENV)
        if not path:
            raise ValueError(f"AlphaHeadLogitsProcessor needs ${ARTIFACT_ENV} naming an alpha-head artifact folder")
        self.vocab = vllm_config.model_config.get_vocab_size() if vllm_config is not None else None
        self.device = device
        loaded = load_artifact(path, expect_vocab_size=self.vocab)
        self.artifact_version = loaded.manifest.artifact_version
        self.scale, self.shift = self._tensors(loaded.head)
        self._heads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # other artifacts' heads, loaded on first use
        self.rows: dict[int, str] = {}  # batch row -> its head key, for rows not on the engine's own head

    def _tensors(self, head) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.as_tensor(head.scale, device=self.device), torch.as_tensor(head.shift, device=self.device)

    def _head(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self._heads:
            self._heads[key] = self._tensors(load_artifact(key, expect_vocab_size=self.vocab).head)
        return self._heads[key]

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        args = sampling_params.extra_args or {}
        if OPT_OUT_KEY in args and args[OPT_OUT_KEY] not in (*_OFF, True, 1, "1", "true", "on"):
            raise ValueError(f"extra_args[{OPT_OUT_KEY!r}] must be a boolean (or 0/1)")
        head = args.get(HEAD_ARG_KEY)
        if head is not None and not (isinstance(head, str) and os.path.isdir(head)):
            raise ValueError(f"extra_args[{HEAD_ARG_KEY!r}] must name an alpha-head artifact folder")

    def is_argmax_invariant(self) -> bool:
        return False  # per-token scales and shifts can change which token is most likely

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index, params, _, _ in batch_update.added:
            key = head_key(params)
            if key is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = key
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for a, b, direction in batch_update.moved:
            a_key, b_key = self.rows.pop(a, None), self.rows.pop(b, None)
            if a_key is not None:
                self.rows[b] = a_key
            if b_key is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = b_key

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        width = logits.shape[-1]
        rows = {r: k for r, k in self.rows.items() if r < logits.shape[0]}

        def alpha(scale, shift, x):
            return apply_alpha(x, scale[:width].to(x.dtype), shift[:width].to(x.dtype))

        if not rows:
            return alpha(self.scale, self.shift, logits)
        original = logits.clone()
        out = alpha(self.scale, self.shift, logits)
        groups: dict[str, list[int]] = {}
        for row, key in rows.items():
            groups.setdefault(key, []).append(row)
        for key, members in groups.items():
            out[members] = original[members] if key == _RAW else alpha(*self._head(key), original[members])
        return out
