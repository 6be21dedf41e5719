"""The α heads one vLLM engine applies, whichever model runner calls it (adapters/vllm_plugins/alpha.py): which head each
request wants, the heads' tensors stacked on the engine's device, and d ⊙ z + l on a batch of logits rows.

No vLLM import here: the runner-specific processors (adapters/vllm_plugins/alpha_v1.py, adapters/vllm_plugins/alpha_v2.py) only map
their batch rows to an index into `HeadTable`, and the GPU check runs `HeadTable.apply` on CUDA without vLLM.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from adapters.vllm_plugins.common import (ARTIFACT_CONFIG_KEY, ARTIFACT_ENV, HEAD_ARG_KEY, OPT_OUT_KEY, additional_config,
                                  resolve_version)
from calm_core.artifact import MANIFEST_FILE, load_artifact

OFF = (False, 0, "0", "false", "off")  # HTTP's vllm_xargs carries no booleans: 0 / "false" / "off" opt out too
ON = (True, 1, "1", "true", "on")
RAW = ""  # a request's head key when it opted out (raw logits)
IDENTITY = 0  # HeadTable's row for raw logits: scale 1 and shift 0, exact in floating point
MIXED_ROWS = 64  # rows of a mixed batch whose heads are gathered at once (64 x 128k tokens x 4 B = 32 MiB a table)
_INSTANCE = "_calm_alpha_processor"  # marks an engine's config once its processor exists


def wants_alpha(params) -> bool:
    return not (params.extra_args and params.extra_args.get(OPT_OUT_KEY, True) in OFF)


def head_key(params) -> str | None:
    """Which head a request wants: RAW (none), an artifact version (`extra_args["calm_head"]`: several versions served
    by one engine), or None for the engine's own head."""
    if not wants_alpha(params):
        return RAW
    return (params.extra_args or {}).get(HEAD_ARG_KEY) or None


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


def validate_head_params(params) -> None:
    """At admission, in the engine's front end (either runner): ValueError, which vLLM answers with a 400."""
    args = params.extra_args or {}
    if OPT_OUT_KEY in args and args[OPT_OUT_KEY] not in (*OFF, *ON):
        raise ValueError(f"extra_args[{OPT_OUT_KEY!r}] must be a boolean (or 0/1)")
    if args.get(HEAD_ARG_KEY) is not None:
        _verify(resolve_version(args[HEAD_ARG_KEY]))


class HeadTable:
    """Heads stacked as rows of (scale, shift) on one device; row IDENTITY leaves logits unchanged. A batch on one head
    (a gateway names its version in every request) takes one fused pass; a mixed batch gathers each row's head."""

    def __init__(self, device: torch.device, width: int | None = None):
        self.device = device
        self.width = width  # the vocabulary (from the engine's config), else the first head's size
        self._rows: list[tuple[np.ndarray, np.ndarray]] = []
        self.scales = self.shifts = None  # [heads, width] once a head is added

    def add(self, scale: np.ndarray, shift: np.ndarray) -> int:
        if self.width is None:
            self.width = int(scale.shape[0])
        if not self._rows:
            self._rows.append((np.ones(self.width, np.float32), np.zeros(self.width, np.float32)))
        # A scalar head (temperature scaling) broadcasts over the vocabulary.
        self._rows.append((np.broadcast_to(scale, self.width), np.broadcast_to(shift, self.width)))
        self.scales = torch.as_tensor(np.stack([s for s, _ in self._rows]), device=self.device)
        self.shifts = torch.as_tensor(np.stack([b for _, b in self._rows]), device=self.device)
        return len(self._rows) - 1

    def apply(self, logits: torch.Tensor, batch_heads: np.ndarray, row_heads) -> torch.Tensor:
        """d ⊙ z + l, in place, on every row of `logits`: `batch_heads` is the head of each request of the batch (on
        the host, so choosing the path needs no device sync), `row_heads()` the head of each logits row as an index
        tensor on the logits' device (a request may own several rows, e.g. under speculative decoding)."""
        distinct = np.unique(batch_heads)
        if self.scales is None or not np.any(distinct != IDENTITY):
            return logits
        width = logits.shape[-1]
        scales, shifts = self.scales[:, :width], self.shifts[:, :width]
        if scales.dtype != logits.dtype:
            scales, shifts = scales.to(logits.dtype), shifts.to(logits.dtype)
        if distinct.size == 1:
            head = int(distinct[0])
            return torch.addcmul(shifts[head], logits, scales[head], out=logits)
        # Each row's head gathered for a slice of rows at a time: a batch of 1,024 rows of a 128k vocabulary would
        # otherwise gather 1 GB per table at every step (read-backs on the head beside draws without it mix batches).
        rows = row_heads()
        for start in range(0, logits.shape[0], MIXED_ROWS):
            part, heads = logits[start:start + MIXED_ROWS], rows[start:start + MIXED_ROWS]
            torch.addcmul(shifts[heads], part, scales[heads], out=part)
        return logits


class EngineHeads:
    """One engine's heads: its own (from `additional_config["calm_artifact"]`, else $CALM_ARTIFACT; none for an engine
    that is not CALM's), and the versions its requests name, loaded into the table on first use."""

    def __init__(self, vllm_config, device: torch.device):
        self.extra = additional_config(vllm_config)
        # Built once from the plugin entry point and once more when also named explicitly: only the first one acts.
        self.active = not getattr(vllm_config, _INSTANCE, False)
        if vllm_config is not None and self.active:
            setattr(vllm_config, _INSTANCE, True)
        model_config = getattr(vllm_config, "model_config", None)
        self.vocab = model_config.get_vocab_size() if model_config is not None else None
        self.table = HeadTable(device, self.vocab)
        self.own, self.artifact_version = IDENTITY, None  # no head of its own: its requests' logits unchanged
        self._named: dict[str, int] = {}
        path = self.extra.get(ARTIFACT_CONFIG_KEY) or os.environ.get(ARTIFACT_ENV)
        if path and self.active:
            loaded = load_artifact(path, expect_vocab_size=self.vocab)
            self.artifact_version = loaded.manifest.artifact_version
            self.own = self.table.add(loaded.head.scale, loaded.head.shift)

    def index(self, params) -> int:
        """The table row of the head a request wants (validated at admission: validate_head_params)."""
        key = head_key(params)
        if key == RAW:
            return IDENTITY
        if key is None:
            return self.own
        if key not in self._named:
            head = load_artifact(resolve_version(key, self.extra), expect_vocab_size=self.vocab).head
            self._named[key] = self.table.add(head.scale, head.shift)
        return self._named[key]


class HeadProcessor:
    """What the processors of both runners share: the engine's heads and the admission check."""

    heads: EngineHeads

    @property
    def active(self) -> bool:
        """False for the second instance vLLM builds for an engine (named twice): it stands aside."""
        return self.heads.active

    @property
    def artifact_version(self) -> str | None:
        return self.heads.artifact_version

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        validate_head_params(sampling_params)
