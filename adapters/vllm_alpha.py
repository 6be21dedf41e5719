"""The α head inside vLLM: a v1 batch-level logits processor computing d ⊙ z + l for every request.

It is installed as a vLLM plugin (entry point group `vllm.logits_processors`, pyproject.toml), so any vLLM engine in
this environment loads it: a stock `vllm serve MODEL --logprobs-mode processed_logprobs --additional-config
'{"calm_artifact": "/registry/VERSION"}'` serves that version's head, with no CALM launcher. Without a configured
artifact it changes nothing (an engine that is not CALM's, or one whose requests all name their head). Named also
explicitly (`--logits-processors`, the in-process engines), vLLM builds it twice; the second instance for an engine
stands aside.

vLLM builds one instance per engine (worker process) and calls `apply` on the whole batch, so the engine's own head
is loaded once, at construction, from the folder named by `additional_config["calm_artifact"]`, else
$CALM_ARTIFACT. With `logprobs_mode` set to `processed_logprobs`, the log-probs vLLM returns are the calibrated ones.
A request opts out with `extra_args={"calm_alpha": False}` (HTTP: `vllm_xargs`), or names another artifact *version*
with `extra_args={"calm_head": "VERSION"}` (one engine serving several versions, e.g. vLLM multi-LoRA): the version
is looked up in the registry folder ($CALM_REGISTRY_DIR or `additional_config["calm_registry"]`), its head's hash and
vocabulary checked, and it is cached; anything else (a path, `..`, an unknown version) is refused with a 400 before
the request reaches the engine.
Written against vLLM 0.32's interface (pinned in pyproject); the interface moves between versions.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from adapters.vllm_common import (ARTIFACT_CONFIG_KEY, ARTIFACT_ENV, HEAD_ARG_KEY, OPT_OUT_KEY, additional_config,
                                  resolve_version)
from calm_core.artifact import MANIFEST_FILE, load_artifact


_OFF = (False, 0, "0", "false", "off")
_RAW = ""  # a row's head key: the request opted out (raw logits)


def wants_alpha(params: SamplingParams) -> bool:
    # HTTP's vllm_xargs carries no booleans, so 0 / "false" / "off" opt out as well as False.
    return not (params.extra_args and params.extra_args.get(OPT_OUT_KEY, True) in _OFF)


def head_key(params: SamplingParams) -> str | None:
    """Which head a request wants: _RAW (none), an artifact version (`extra_args["calm_head"]`: several versions
    served by one engine), or None for the engine's own head."""
    if not wants_alpha(params):
        return _RAW
    return (params.extra_args or {}).get(HEAD_ARG_KEY) or None


_INSTANCE = "_calm_alpha_processor"  # marks an engine's config once its processor exists


_VERIFIED: set[tuple[Path, int]] = set()


def _verify(folder: Path) -> None:
    """The version loads and its head matches the hash in its manifest (once per folder and manifest write)."""
    manifest = folder / MANIFEST_FILE
    key = (folder, manifest.stat().st_mtime_ns if manifest.is_file() else 0)
    if key not in _VERIFIED:
        try:
            load_artifact(folder)
        except Exception as e:  # the request is refused (a 400), the engine is untouched
            raise ValueError(f"extra_args[{HEAD_ARG_KEY!r}]: version {folder.name!r} does not load: {e}") from None
        _VERIFIED.add(key)


class AlphaHeadLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.extra = additional_config(vllm_config)
        # Built once from the plugin entry point and once more when also named explicitly: only the first one acts.
        self.active = not getattr(vllm_config, _INSTANCE, False)
        if vllm_config is not None and self.active:
            setattr(vllm_config, _INSTANCE, True)
        path = self.extra.get(ARTIFACT_CONFIG_KEY) or os.environ.get(ARTIFACT_ENV)
        self.vocab = vllm_config.model_config.get_vocab_size() if vllm_config is not None else None
        self.device = device
        self.artifact_version, self.scale, self.shift = None, None, None  # no head of its own: logits unchanged
        if path and self.active:
            loaded = load_artifact(path, expect_vocab_size=self.vocab)
            self.artifact_version = loaded.manifest.artifact_version
            self.scale, self.shift = self._tensors(loaded.head)
        self._heads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # named versions' heads, loaded on first use
        self.rows: dict[int, str] = {}  # batch row -> its head key, for rows not on the engine's own head

    def _tensors(self, head) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.as_tensor(head.scale, device=self.device), torch.as_tensor(head.shift, device=self.device)

    def _head(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self._heads:
            folder = resolve_version(key, self.extra)
            self._heads[key] = self._tensors(load_artifact(folder, expect_vocab_size=self.vocab).head)
        return self._heads[key]

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        args = sampling_params.extra_args or {}
        if OPT_OUT_KEY in args and args[OPT_OUT_KEY] not in (*_OFF, True, 1, "1", "true", "on"):
            raise ValueError(f"extra_args[{OPT_OUT_KEY!r}] must be a boolean (or 0/1)")
        if args.get(HEAD_ARG_KEY) is not None:
            _verify(resolve_version(args[HEAD_ARG_KEY]))

    def is_argmax_invariant(self) -> bool:
        # Per-token scales and shifts can change which token is most likely; the stand-aside instance changes nothing.
        return not self.active

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None or not self.active:
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
        if not self.active:
            return logits
        width = logits.shape[-1]

        def alpha(scale, shift, x):
            if scale is None:  # no head of the engine's own
                return x
            # d ⊙ z + l (calm_core.alpha_head.apply_alpha) in one fused pass: half the time of a multiply, then an add
            return torch.addcmul(shift[:width].to(x.dtype), x, scale[:width].to(x.dtype))

        def head(key):
            return (None, None) if key == _RAW else (self.scale, self.shift) if key is None else self._head(key)

        # Each row's head key (None: the engine's own). A batch on one head (a gateway names its version in every
        # request) takes one pass over it; only a mixed batch is split into groups of rows.
        keys = [self.rows.get(row) for row in range(logits.shape[0])]
        if len(set(keys)) <= 1:
            return alpha(*head(keys[0] if keys else None), logits)
        groups: dict[str | None, list[int]] = {}
        for row, key in enumerate(keys):
            groups.setdefault(key, []).append(row)
        for key, members in groups.items():
            if key != _RAW:
                logits[members] = alpha(*head(key), logits[members])  # indexing copies the rows: groups are disjoint
        return logits
