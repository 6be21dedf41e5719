"""Encoded question sets: the frozen-prefix hidden states of every prompt in a split, cached on disk.

The cache key covers the model's weights id, the layer where training starts and the exact prompt texts, so a
changed prompt format or model never reuses stale states.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from calm_core.data import MCQuestion
from calm_core.prompts import letter_prompt
from calm_core.splits import ROLES, MaterializedSplit
from training.top_layers import encode_prefix


@dataclass
class EncodedSet:
    label: str
    questions: list[MCQuestion]
    hidden: list[torch.Tensor]
    labels: torch.Tensor
    n_options: torch.Tensor

    def __len__(self) -> int:
        return len(self.questions)


def _key(weights_id: str, first_trained: int, prompts: list[str]) -> str:
    h = hashlib.sha256(f"{weights_id}|{first_trained}".encode())
    for p in prompts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def encode_sets(model, tokenizer, split: MaterializedSplit, first_trained: int, weights_id: str, cache_dir: Path,
                batch_size: int = 16) -> dict[str, dict[str, EncodedSet]]:
    """Per role and source label, the encoded questions; computed once per (model, layer, prompts)."""
    sets = {role: {label: qs for label, qs in split.sources[role].items()} for role in ROLES}
    prompts = {role: {label: [letter_prompt(tokenizer, q) for q in qs] for label, qs in d.items()} for role, d in sets.items()}
    flat = [p for d in prompts.values() for ps in d.values() for p in ps]
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"prefix-{_key(weights_id, first_trained, flat)}.pt"
    if path.is_file():
        hidden = torch.load(path)
    else:
        with Progress(TextColumn("encoding frozen layers"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()) as bar:
            task = bar.add_task("encode", total=len(flat))
            hidden = encode_prefix(model, tokenizer, flat, first_trained, batch_size, lambda n: bar.advance(task, n))
        tmp = path.with_suffix(".tmp")
        torch.save(hidden, tmp)
        tmp.rename(path)
    out, i = {}, 0
    for role, d in sets.items():
        out[role] = {}
        for label, qs in d.items():
            out[role][label] = EncodedSet(label, qs, hidden[i : i + len(qs)], torch.tensor([q.answer for q in qs]),
                                          torch.tensor([q.n_options for q in qs]))
            i += len(qs)
    return out


def concat(sets: list[EncodedSet], label: str) -> EncodedSet:
    return EncodedSet(label, [q for s in sets for q in s.questions], [h for s in sets for h in s.hidden],
                      torch.cat([s.labels for s in sets]), torch.cat([s.n_options for s in sets]))
