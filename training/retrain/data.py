"""A retraining job's data, read from the domain's capture (calm_core/capture.py): captured prompts as the unlabelled
calibration set of the mode they asked for (multiple choice or free form), uploaded labelled questions of both kinds,
and the job's split files."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from calm_core.capture import CapturedPrompt
from calm_core.data import MAX_OPTIONS, MIN_OPTIONS, MCQuestion, OpenQuestion
from calm_core.splits import SourceSpec, load_split
from calm_core.toml_config import dump_toml

MULTIPLE_CHOICE, FREE_FORM = "multiple_choice", "free_form"


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def captured_questions(prompts: list[CapturedPrompt], domain: str) -> list[MCQuestion]:
    """Captured multiple-choice prompts as unlabelled questions (answer 0 is a placeholder), duplicates removed."""
    seen, out = set(), []
    for p in prompts:
        if p.kind != MULTIPLE_CHOICE or not p.options or not MIN_OPTIONS <= len(p.options) <= MAX_OPTIONS:
            continue
        key = _key(p.question, list(p.options))
        if key not in seen:
            seen.add(key)
            out.append(MCQuestion(f"captured-{key}", f"captured:{domain}", "live", p.question, tuple(p.options), 0, domain))
    return out


def captured_open_questions(prompts: list[CapturedPrompt], domain: str) -> list[OpenQuestion]:
    """Captured free-form prompts as unlabelled open questions (no answers: generative CALM's upper level needs only
    the prompts, the model's own greedy answers), duplicates removed."""
    seen, out = set(), []
    for p in prompts:
        if p.kind != FREE_FORM or not p.question.strip():
            continue
        key = _key(p.question)
        if key not in seen:
            seen.add(key)
            out.append(OpenQuestion(f"captured-{key}", f"captured:{domain}", "live", p.question, "", (), domain))
    return out


def labelled_questions(prompts: list[CapturedPrompt], domain: str) -> list[MCQuestion]:
    """Multiple-choice questions an operator uploaded with their answers (/admin/labels)."""
    out = []
    for i, p in enumerate(prompts):
        if p.kind == "labelled" and p.options and p.answer is not None and p.answer.isdigit() and int(p.answer) < len(p.options):
            out.append(MCQuestion(f"labelled-{i}", f"labelled:{domain}", "live", p.question, tuple(p.options), int(p.answer), domain))
    return out


def labelled_open_questions(prompts: list[CapturedPrompt], domain: str) -> list[OpenQuestion]:
    """Free-form questions an operator uploaded with their accepted answers (a JSON list of aliases)."""
    out = []
    for i, p in enumerate(prompts):
        if p.kind != "labelled" or p.options or not p.answer or not p.answer.startswith("["):
            continue
        aliases = tuple(str(a) for a in json.loads(p.answer))
        if aliases:
            out.append(OpenQuestion(f"labelled-{i}", f"labelled:{domain}", "live", p.question, aliases[0], aliases, domain))
    return out


def traffic_counts(prompts: list[CapturedPrompt], domain: str) -> dict[str, int]:
    """Distinct captured prompts per mode: what a label-free job can calibrate on."""
    return {MULTIPLE_CHOICE: len(captured_questions(prompts, domain)),
            FREE_FORM: len(captured_open_questions(prompts, domain))}


def write_questions(path: Path, questions: list[MCQuestion] | list[OpenQuestion]) -> Path:
    """The project's JSONL format (multiple choice: `choices` and `answer`; open-ended: `answer` and `answers`)."""
    def row(q) -> dict:
        common = {"id": q.id, "dataset": q.dataset, "split": q.split, "question": q.question, "domain": q.domain}
        if isinstance(q, OpenQuestion):
            return {**common, "answer": q.answer, "answers": list(q.answers)}
        return {**common, "choices": list(q.choices), "answer": q.answer}

    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row(q)) + "\n" for q in questions), encoding="utf-8")
    os.replace(tmp, path)
    return path


def job_split(train_split_path: str, domain: str, calibration_file: Path, out: Path,
              tests: list[SourceSpec] | None = None, open_ended: bool = False) -> Path:
    """The job's split: the training config's labelled training set and out-of-domain tests, the domain's captured
    prompts as calibration, the domain's labelled questions (`tests`) or the training split's as in-domain tests."""
    base = load_split(train_split_path)
    split = base.model_copy(update={
        "name": f"retrain-{domain}" + ("-free-form" if open_ended else ""),
        "calibration": [SourceSpec(dataset=f"captured:{domain}", split="live", path=str(calibration_file),
                                   open_ended=open_ended, labelled=False)],
        "test_in_domain": tests or base.test_in_domain,
    })
    out.write_text(dump_toml(split.model_dump(mode="json", exclude_none=True)), encoding="utf-8")
    load_split(out)  # what was written reads back as a valid split
    return out
