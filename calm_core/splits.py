"""Domain splits declared in config: which datasets (and MMLU subjects/categories) are used to train, to calibrate,
to test in-domain and to test out-of-domain.

A source takes a fraction range of a seeded permutation of one file, so one file can feed several roles without
overlap. Whatever the config says, no test question reaches training or calibration: questions whose normalised text
appears in any test set are dropped from those roles (MMLU, for one, repeats val questions in test).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from calm_core.data import (
    DATASET_FILES, OPEN_DATASETS, MCQuestion, OpenQuestion, load_mc, load_mc_file, load_open, load_open_file,
    normalize_text,
)
from calm_core.errors import ConfigError
from calm_core.toml_config import load_toml_model

ROLES = ("train", "calibration", "test_in_domain", "test_out_of_domain")
TEST_ROLES = ("test_in_domain", "test_out_of_domain")


class SourceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: str
    split: str
    subjects: list[str] | None = None
    categories: list[str] | None = None
    fraction: tuple[float, float] = (0.0, 1.0)
    limit: int | None = None
    name: str | None = None  # label in reports; defaults to dataset[:categories]
    # A JSONL file of multiple-choice questions (the project's format) instead of a benchmark: a domain's captured
    # traffic or its own labelled test questions (the retraining worker writes both). `dataset` and `split` then only
    # name it.
    path: str | None = None
    # A file source of open-ended questions (`answers` aliases, no options) rather than multiple choice.
    open_ended: bool = False
    # False: the questions' answers are placeholders (captured prompts): only the calibration role may use them.
    labelled: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.path is not None:
            if self.subjects or self.categories:
                raise ValueError("a file source has no subjects or categories")
        elif self.open_ended:
            raise ValueError("open_ended describes a file source (`path`); a benchmark's kind is known")
        elif self.dataset not in DATASET_FILES:
            raise ValueError(f"unknown dataset {self.dataset!r}")
        elif self.split not in DATASET_FILES[self.dataset]:
            raise ValueError(f"dataset {self.dataset!r} has no split {self.split!r}")
        lo, hi = self.fraction
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"fraction must satisfy 0 <= start < end <= 1, got {self.fraction}")
        if self.dataset in OPEN_DATASETS and (self.subjects or self.categories):
            raise ValueError(f"{self.dataset!r} is open-ended: it has no subjects or categories")
        if self.limit is not None and self.limit < 1:
            raise ValueError("limit must be positive")
        return self

    @property
    def is_open(self) -> bool:
        return self.open_ended if self.path is not None else self.dataset in OPEN_DATASETS

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return self.dataset + (f"[{'+'.join(self.categories)}]" if self.categories else "")


class DomainSplit(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    seed: int = 0
    train: list[SourceSpec]
    calibration: list[SourceSpec]
    test_in_domain: list[SourceSpec]
    test_out_of_domain: list[SourceSpec]

    @field_validator("train", "calibration", "test_in_domain", "test_out_of_domain")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("needs at least one source")
        return v

    @model_validator(mode="after")
    def _labels_where_needed(self):
        for role in ("train", "test_in_domain", "test_out_of_domain"):
            if any(not s.labelled for s in getattr(self, role)):
                raise ValueError(f"{role} needs labelled questions; unlabelled sources belong to calibration")
        return self

    @model_validator(mode="after")
    def _one_kind(self):
        kinds = {s.is_open for role in ROLES for s in getattr(self, role)}
        if len(kinds) > 1:
            raise ValueError("a split is either multiple choice or open-ended; it mixes both")
        return self

    @property
    def open_ended(self) -> bool:
        return self.train[0].is_open


def load_split(path: str | Path) -> DomainSplit:
    return load_toml_model(path, DomainSplit, "split config")


Question = MCQuestion | OpenQuestion


def select(spec: SourceSpec, seed: int, root: Path | None = None) -> list[Question]:
    if spec.path is not None:
        questions = load_open_file(spec.path) if spec.open_ended else load_mc_file(spec.path)
    elif spec.dataset in OPEN_DATASETS:
        questions = load_open(spec.dataset, spec.split, root)
    else:
        questions = load_mc(spec.dataset, spec.split, root)
    if spec.subjects is not None:
        questions = [q for q in questions if q.subject in spec.subjects]
    if spec.categories is not None:
        questions = [q for q in questions if q.category in spec.categories]
    # The permutation depends on the file and seed only, so fraction ranges of one file never overlap.
    order = list(range(len(questions)))
    random.Random(f"{seed}:{spec.dataset}:{spec.split}").shuffle(order)
    lo, hi = (round(f * len(order)) for f in spec.fraction)
    picked = [questions[i] for i in order[lo:hi]]
    return picked[: spec.limit] if spec.limit else picked


@dataclass
class MaterializedSplit:
    """Questions per role and source label, after leakage removal; `dropped` counts removed questions per role."""

    config: DomainSplit
    sources: dict[str, dict[str, list[Question]]]
    dropped: dict[str, int]

    def role(self, role: str) -> list[Question]:
        return [q for qs in self.sources[role].values() for q in qs]


def materialize(split: DomainSplit, root: Path | None = None) -> MaterializedSplit:
    sources = {role: {s.label: select(s, split.seed, root) for s in getattr(split, role)} for role in ROLES}
    test_texts = {normalize_text(q.question) for role in TEST_ROLES for qs in sources[role].values() for q in qs}
    dropped = {}
    for role in ("train", "calibration"):
        before = sum(len(qs) for qs in sources[role].values())
        sources[role] = {
            label: [q for q in qs if normalize_text(q.question) not in test_texts] for label, qs in sources[role].items()
        }
        dropped[role] = before - sum(len(qs) for qs in sources[role].values())
    result = MaterializedSplit(split, sources, dropped)
    assert_no_leakage(result)
    return result


def assert_no_leakage(m: MaterializedSplit) -> None:
    test_texts = {normalize_text(q.question) for role in TEST_ROLES for q in m.role(role)}
    for role in ("train", "calibration"):
        leaked = [q.id for q in m.role(role) if normalize_text(q.question) in test_texts]
        if leaked:
            raise ConfigError(f"split {m.config.name!r}: {len(leaked)} test questions leak into {role} (e.g. {leaked[0]})")
