"""Traffic capture for retraining: opt-in per domain, off by default.

A captured item is what CALM's upper level needs and nothing more: the question (the last user message or the
completion prompt) and, for multiple choice, the options. The answer is stored only when the domain's settings say so.
Each domain's capture is bounded by count and age (the oldest items go first) and can be deleted whole through the
admin API. Captured text never reaches logs or metrics.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text, delete, func, select

from calm_core.db import Database

META = MetaData()
SETTINGS = Table("capture_settings", META,
                 Column("domain", String(64), primary_key=True),
                 Column("enabled", Integer, nullable=False),
                 Column("max_items", Integer, nullable=False),
                 Column("max_age_s", Float, nullable=False),
                 Column("include_answers", Integer, nullable=False),
                 Column("updated_at", Float, nullable=False))
CAPTURED = Table("captured_prompts", META,
                 Column("seq", Integer, primary_key=True, autoincrement=True),
                 Column("domain", String(64), nullable=False, index=True),
                 Column("kind", String(16), nullable=False),  # multiple_choice | free_form
                 Column("question", Text, nullable=False),
                 Column("options", Text),  # JSON list, multiple choice only
                 Column("answer", Text),  # only with include_answers
                 Column("at", Float, nullable=False, index=True))


@dataclass(frozen=True)
class CaptureSettings:
    enabled: bool = False
    max_items: int = 5000
    max_age_s: float = 7 * 24 * 3600.0
    include_answers: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CapturedPrompt:
    kind: str
    question: str
    options: tuple[str, ...] | None
    answer: str | None
    at: float


class Capture:
    def __init__(self, db: Database, clock=time.time):
        self.db, self.clock = db, clock
        db.create_tables(META)

    def settings(self) -> dict[str, CaptureSettings]:
        with self.db.engine.connect() as c:
            rows = c.execute(select(SETTINGS)).mappings().all()
        return {r["domain"]: CaptureSettings(bool(r["enabled"]), r["max_items"], r["max_age_s"], bool(r["include_answers"]))
                for r in rows}

    def configure(self, domain: str, settings: CaptureSettings) -> CaptureSettings:
        row = dict(enabled=int(settings.enabled), max_items=settings.max_items, max_age_s=settings.max_age_s,
                   include_answers=int(settings.include_answers), updated_at=self.clock())
        with self.db._write() as c:
            c.execute(delete(SETTINGS).where(SETTINGS.c.domain == domain))
            c.execute(SETTINGS.insert().values(domain=domain, **row))
            self._prune(c, domain, settings)
        return settings

    def add(self, domain: str, settings: CaptureSettings, items: list[tuple[str, str, list[str] | None, str | None]]) -> None:
        """Store (kind, question, options, answer) items of one domain; the answer is dropped unless configured."""
        now = self.clock()
        rows = [dict(domain=domain, kind=kind, question=question, options=json.dumps(options) if options else None,
                     answer=answer if settings.include_answers else None, at=now)
                for kind, question, options, answer in items]
        with self.db._write() as c:
            c.execute(CAPTURED.insert(), rows)
            for kind in {r["kind"] for r in rows}:
                self._prune(c, domain, settings, kind)

    def add_labelled(self, domain: str, items: list[tuple[str, list[str] | None, int | list[str]]]) -> None:
        """Questions an operator uploaded with their answers (/admin/labels): kept whether or not traffic capture is
        on (they are the operator's data, not users'), for the retraining gate; bounded like a capture. Multiple
        choice: options and the answer's index; free form: no options, the answer's aliases (a JSON list)."""
        self.add(domain, CaptureSettings(enabled=True, include_answers=True),
                 [("labelled", question, options, json.dumps(answer) if options is None else str(answer))
                  for question, options, answer in items])

    def _prune(self, c, domain: str, settings: CaptureSettings, kind: str | None = None) -> None:
        """Drop what is older than the domain's age limit, then the oldest beyond its count limit (per kind, so
        traffic never pushes out an operator's labelled questions)."""
        c.execute(delete(CAPTURED).where(CAPTURED.c.domain == domain, CAPTURED.c.at < self.clock() - settings.max_age_s))
        for k in [kind] if kind else ("multiple_choice", "free_form", "labelled"):
            mine = (CAPTURED.c.domain == domain) & (CAPTURED.c.kind == k)
            cutoff = c.execute(select(CAPTURED.c.seq).where(mine).order_by(CAPTURED.c.seq.desc())
                               .offset(settings.max_items).limit(1)).scalar()
            if cutoff is not None:
                c.execute(delete(CAPTURED).where(mine, CAPTURED.c.seq <= cutoff))

    def prompts(self, domain: str, kind: str | None = None) -> list[CapturedPrompt]:
        query = select(CAPTURED).where(CAPTURED.c.domain == domain).order_by(CAPTURED.c.seq)
        if kind is not None:
            query = query.where(CAPTURED.c.kind == kind)
        with self.db.engine.connect() as c:
            rows = c.execute(query).mappings().all()
        return [CapturedPrompt(r["kind"], r["question"], tuple(json.loads(r["options"])) if r["options"] else None,
                               r["answer"], r["at"]) for r in rows]

    def counts(self) -> dict[str, int]:
        with self.db.engine.connect() as c:
            return dict(c.execute(select(CAPTURED.c.domain, func.count()).group_by(CAPTURED.c.domain)).all())

    def delete(self, domain: str) -> int:
        with self.db._write() as c:
            return c.execute(delete(CAPTURED).where(CAPTURED.c.domain == domain)).rowcount


def prompts_sha256(prompts: list[CapturedPrompt]) -> str:
    """The calibration data's identity in a candidate's lineage: a hash over the captured questions and options."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.kind, p.question, list(p.options or ())]).encode())
    return h.hexdigest()
