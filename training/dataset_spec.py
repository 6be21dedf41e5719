"""Which questions a command scores: `--dataset` as `calm eval` and the other commands take it. Its own module, free of
the model code, so that a command refuses a bad name before it imports torch (`calm eval -d arc_medium` answered in
6.6 s, 0.3 s now)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from calm_core.data import OPEN_DATASETS, default_split, load_mc, load_mc_file, load_open, load_open_file
from calm_core.errors import DataError
from calm_core.splits import SourceSpec, select


@dataclass(frozen=True)
class DatasetSpec:
    name: str  # a known dataset, or a JSONL file in the shared schema
    split: str
    fraction: tuple[float, float] | None = None  # a range of the split's seeded order, as domain splits take it

    @classmethod
    def parse(cls, text: str) -> "DatasetSpec":
        """'arc_easy', 'arc_easy:dev', 'triviaqa:sample@0.7-0.8' (that fraction of the split, in the order domain
        splits use, so it can be kept apart from a split's training range), or a path to a .jsonl file."""
        if text.endswith(".jsonl") or Path(text).is_file():
            return cls(text, "file")
        text, _, part = text.partition("@")
        name, _, split = text.partition(":")
        fraction = None
        if part:
            try:
                lo, hi = (float(x) for x in part.split("-"))
            except ValueError:
                raise DataError(f"dataset range must look like name:split@0.7-0.8, not {part!r}") from None
            fraction = (lo, hi)
        return cls(name, split or default_split(name), fraction)

    @property
    def open_ended(self) -> bool:
        """A known open-ended dataset, or a JSONL file whose first question has no options (`answers` aliases)."""
        if self.split == "file":
            return _file_is_open_ended(self.name)
        return self.name in OPEN_DATASETS

    @property
    def label(self) -> str:
        if self.split == "file":
            return Path(self.name).stem
        return f"{self.name}:{self.split}" + (f"@{self.fraction[0]:g}-{self.fraction[1]:g}" if self.fraction else "")

    def load(self) -> list:
        if self.split == "file":
            if not Path(self.name).is_file():
                raise DataError(f"data file not found: {self.name}")
            return load_open_file(self.name) if self.open_ended else load_mc_file(self.name)
        if self.fraction is not None:
            try:
                return select(SourceSpec(dataset=self.name, split=self.split, fraction=self.fraction), seed=0)
            except ValidationError as e:
                raise DataError(f"{self.label}: {e.errors()[0]['msg']}") from None
        if self.open_ended:
            return load_open(self.name, self.split)
        return load_mc(self.name, self.split)


def _file_is_open_ended(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            first = json.loads(next((line for line in f if line.strip()), "{}"))
    except (OSError, ValueError):
        return False  # load() says what is wrong with the file
    return isinstance(first, dict) and "choices" not in first and "answers" in first
