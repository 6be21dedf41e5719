"""Benchmark JSONL schema and loaders (see ../shared/data/README.md).

Multiple choice: id, dataset, split, question, choices, answer (0-based), answer_letter, domain (+ optional fields).
Open-ended: id, dataset, split, question, answer, answers, domain.
A malformed line raises DataError naming file and line number.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from calm_core.errors import DataError
from calm_core.paths import data_dir

MAX_OPTIONS = 13  # letters A..M
MIN_OPTIONS = 2


@dataclass(frozen=True)
class MCQuestion:
    id: str
    dataset: str
    split: str
    question: str
    choices: tuple[str, ...]
    answer: int
    domain: str
    subject: str | None = None
    category: str | None = None

    @property
    def n_options(self) -> int:
        return len(self.choices)


@dataclass(frozen=True)
class OpenQuestion:
    id: str
    dataset: str
    split: str
    question: str
    answer: str
    answers: tuple[str, ...]
    domain: str
    extra: dict = field(default_factory=dict, compare=False, hash=False)


# dataset name -> {split: file relative to the data root}
DATASET_FILES: dict[str, dict[str, str]] = {
    "mmlu": {"dev": "mmlu/mmlu_dev.jsonl", "val": "mmlu/mmlu_val.jsonl", "test": "mmlu/mmlu_test.jsonl"},
    "arc_challenge": {"dev": "arc_challenge/arc_challenge_dev.jsonl", "test": "arc_challenge/arc_challenge_test.jsonl"},
    "arc_easy": {"dev": "arc_easy/arc_easy_dev.jsonl", "test": "arc_easy/arc_easy_test.jsonl"},
    "openbookqa": {"test": "openbookqa/openbookqa_test.jsonl"},
    "commonsenseqa": {"dev": "commonsenseqa/commonsenseqa_dev.jsonl"},
    "medmcqa": {"dev": "medmcqa/medmcqa_dev_single.jsonl"},
    "triviaqa": {"sample": "triviaqa/triviaqa_3000.jsonl"},
    "popqa": {"dev": "popqa/popqa_dev.jsonl", "test": "popqa/popqa_test.jsonl"},
}
MC_DATASETS = ("arc_easy", "arc_challenge", "openbookqa", "commonsenseqa", "mmlu", "medmcqa")
OPEN_DATASETS = ("triviaqa", "popqa")


def dataset_path(dataset: str, split: str, root: Path | None = None) -> Path:
    if dataset not in DATASET_FILES:
        raise DataError(f"unknown dataset {dataset!r}; known: {', '.join(sorted(DATASET_FILES))}")
    splits = DATASET_FILES[dataset]
    if split not in splits:
        raise DataError(f"dataset {dataset!r} has no split {split!r}; it has: {', '.join(splits)}")
    path = (root or data_dir()) / splits[split]
    if not path.is_file():
        raise DataError(f"data file not found: {path} (set CALM_DATA_DIR to the folder holding the benchmarks)")
    return path


def default_split(dataset: str) -> str:
    """The split used for testing when none is named: test if the dataset has one, else its only split."""
    splits = DATASET_FILES.get(dataset)
    if splits is None:
        raise DataError(f"unknown dataset {dataset!r}; known: {', '.join(sorted(DATASET_FILES))}")
    return "test" if "test" in splits else next(iter(splits))


def _require(row: dict, key: str, typ: type, where: str):
    if key not in row:
        raise DataError(f"{where}: missing field {key!r}")
    value = row[key]
    if not isinstance(value, typ) or isinstance(value, bool) and typ is not bool:
        raise DataError(f"{where}: field {key!r} must be {typ.__name__}, got {type(value).__name__}")
    return value


def parse_mc(row: dict, where: str) -> MCQuestion:
    choices = _require(row, "choices", list, where)
    if not MIN_OPTIONS <= len(choices) <= MAX_OPTIONS:
        raise DataError(f"{where}: {len(choices)} choices; supported are {MIN_OPTIONS}-{MAX_OPTIONS}")
    if not all(isinstance(c, str) for c in choices):
        raise DataError(f"{where}: every choice must be a string")
    answer = _require(row, "answer", int, where)
    if not 0 <= answer < len(choices):
        raise DataError(f"{where}: answer index {answer} out of range for {len(choices)} choices")
    question = _require(row, "question", str, where)
    context = row.get("context")
    if context is not None:  # reading comprehension: the passage goes before the question
        if not isinstance(context, str):
            raise DataError(f"{where}: field 'context' must be str, got {type(context).__name__}")
        question = f"{context.strip()}\n\n{question}" if context.strip() else question
    return MCQuestion(
        id=_require(row, "id", str, where),
        dataset=_require(row, "dataset", str, where),
        split=str(row.get("split", "")),
        question=question,
        choices=tuple(choices),
        answer=answer,
        domain=str(row.get("domain", "other")),
        subject=row.get("subject"),
        category=row.get("category"),
    )


def parse_open(row: dict, where: str) -> OpenQuestion:
    answers = _require(row, "answers", list, where)
    known = {"id", "dataset", "split", "question", "answer", "answers", "domain"}
    return OpenQuestion(
        id=_require(row, "id", str, where),
        dataset=_require(row, "dataset", str, where),
        split=str(row.get("split", "")),
        question=_require(row, "question", str, where),
        answer=_require(row, "answer", str, where),
        answers=tuple(str(a) for a in answers),
        domain=str(row.get("domain", "other")),
        extra={k: v for k, v in row.items() if k not in known},
    )


def read_jsonl(path: str | Path) -> list[tuple[str, dict]]:
    """Rows of a JSONL file with their 'file:line' location; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            rows.append((where, row))
    return rows


def load_mc_file(path: str | Path) -> list[MCQuestion]:
    return [parse_mc(row, where) for where, row in read_jsonl(path)]


def load_open_file(path: str | Path) -> list[OpenQuestion]:
    return [parse_open(row, where) for where, row in read_jsonl(path)]


def load_mc(dataset: str, split: str | None = None, root: Path | None = None) -> list[MCQuestion]:
    if dataset in OPEN_DATASETS:
        raise DataError(f"dataset {dataset!r} is open-ended, not multiple choice")
    return load_mc_file(dataset_path(dataset, split or default_split(dataset), root))


def load_open(dataset: str, split: str | None = None, root: Path | None = None) -> list[OpenQuestion]:
    if dataset not in OPEN_DATASETS:
        raise DataError(f"dataset {dataset!r} is multiple choice, not open-ended")
    return load_open_file(dataset_path(dataset, split or default_split(dataset), root))


_SERVING_DOMAINS = {
    "arc_easy": "science", "arc_challenge": "science", "openbookqa": "science",
    "commonsenseqa": "commonsense", "medmcqa": "medicine", "triviaqa": "trivia", "popqa": "entity_knowledge",
}


def serving_domain(q: MCQuestion | OpenQuestion) -> str:
    """The domain label the gateway uses for a question (bounded, lower-case): science, commonsense, medicine,
    mmlu_stem, mmlu_humanities, mmlu_social_sciences, mmlu_other, ..."""
    if q.dataset == "mmlu":
        category = getattr(q, "category", None) or "other"
        return f"mmlu_{category.lower()}"
    return _SERVING_DOMAINS.get(q.dataset, q.domain.lower())


_WS = re.compile(r"\s+")
_PUNCT = re.compile(r"[^\w\s]")


def normalize_text(text: str) -> str:
    """Lower-case, punctuation-free, whitespace-collapsed text: used to check that no test question leaks."""
    return _WS.sub(" ", _PUNCT.sub(" ", text.lower())).strip()
