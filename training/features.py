"""Encoded question sets: the frozen-prefix hidden states of every question in a split, cached on disk.

A file per source set: its key covers the model's weights id, the layer where training starts, the answer format and
the exact input texts, so a changed prompt, format or model never reuses stale states, and splits that share a set
(retraining jobs: the same training and test sets beside each job's captured prompts) encode it once.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from calm_core.data import MCQuestion
from calm_core.splits import ROLES, MaterializedSplit
from training.answer_formats import FormatEncoder
from training.cloze import PackedQuestion


@dataclass
class EncodedSet:
    label: str
    questions: list[MCQuestion]
    items: list  # per question, what the answer format encoded (hidden states entering the first trained layer)
    labels: torch.Tensor
    n_options: torch.Tensor

    def __len__(self) -> int:
        return len(self.questions)


    @property
    def width(self) -> int:
        return int(self.n_options.max())


def _key(weights_id: str, first_trained: int, fmt: str, texts: list[str]) -> str:
    h = hashlib.sha256(f"{weights_id}|{first_trained}|{fmt}".encode())
    for p in texts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def encode_sets(model, tokenizer, split: MaterializedSplit, first_trained: int, weights_id: str, cache_dir: Path,
                fmt: FormatEncoder, batch_size: int = 16) -> dict[str, dict[str, EncodedSet]]:
    """Per role and source label, the encoded questions; each set computed once per (model, layer, format, inputs)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    sets = [(role, label, qs) for role in ROLES for label, qs in split.sources[role].items()]
    keys = [_key(weights_id, first_trained, fmt.name, [fmt.fingerprint(tokenizer, q) for q in qs]) for _, _, qs in sets]
    paths = [cache_dir / f"prefix-{fmt.name}-{key}.pt" for key in keys]
    items = {path: _read_cached(path) for path in paths if path.is_file()}
    missing = {path: qs for path, (_, _, qs) in zip(paths, sets) if path not in items}
    if missing:
        with Progress(TextColumn(f"encoding frozen layers ({fmt.name})"), BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn()) as bar:
            task = bar.add_task("encode", total=sum(len(qs) for qs in missing.values()))
            for path, qs in missing.items():
                items[path] = fmt.encode(model, tokenizer, qs, first_trained, batch_size, lambda n: bar.advance(task, n))
                # Two processes may encode a shared set at once (the suite's workers, two workers' jobs): each writes
                # its own file, and the rename keeps one whole.
                tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
                try:
                    torch.save(items[path], tmp)
                    os.replace(tmp, path)
                finally:
                    tmp.unlink(missing_ok=True)  # a failed write leaves no stray copy (hundreds of MB)
    out: dict[str, dict[str, EncodedSet]] = {role: {} for role in ROLES}
    for (role, label, qs), path in zip(sets, paths):
        # Free-form questions have one "option", their answer: label 0 of 1.
        labels = [q.answer if isinstance(q, MCQuestion) else 0 for q in qs]
        n_options = [q.n_options if isinstance(q, MCQuestion) else 1 for q in qs]
        out[role][label] = EncodedSet(label, qs, items[path], torch.tensor(labels, dtype=torch.long),
                                      torch.tensor(n_options, dtype=torch.long))
    return out


def _read_cached(path: Path) -> list:
    # Tensors, plain values and the packed questions of cloze and free-form formats, nothing else: a cache file is
    # data, never code (a full unpickler would run whatever a file put there).
    with torch.serialization.safe_globals([PackedQuestion]):
        return torch.load(path, weights_only=True)


def concat(sets: list[EncodedSet], label: str) -> EncodedSet:
    return EncodedSet(label, [q for s in sets for q in s.questions], [h for s in sets for h in s.items],
                      torch.cat([s.labels for s in sets]), torch.cat([s.n_options for s in sets]))


@dataclass
class Batch:
    items: list  # encoded questions, as the answer format made them
    labels: torch.Tensor
    n_options: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.n_options.max())


class BatchStream:
    """Deterministic batches: a fresh seeded permutation per epoch; the position is two integers (resumable)."""

    def __init__(self, data: EncodedSet, batch_size: int, seed: int):
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.epoch, self.pos = 0, 0

    def _perm(self) -> torch.Tensor:
        return torch.randperm(len(self.data), generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch))

    def next(self) -> Batch:
        if self.pos + self.batch_size > len(self.data):
            self.epoch, self.pos = self.epoch + 1, 0
        idx = self._perm()[self.pos : self.pos + self.batch_size].tolist()
        self.pos += self.batch_size
        return Batch([self.data.items[i] for i in idx], self.data.labels[idx], self.data.n_options[idx])

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
