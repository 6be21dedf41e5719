"""What each served answer's confidence was made of, and its verdict once feedback judges it: the labels a domain's
traffic gives for recalibration (training/retrain/labelled.py), beside the questions operators upload.

A row per answer the gateway records (its response key): the domain and the version that served it; for multiple
choice the options' log-probabilities as served and the option chosen, for a free-form answer its token confidence as
served (the free-form labelled map is a temperature on that number). Feedback (and a closed review) sets `correct`.
No text is stored: a verdict needs the scores, not the question. Free-form answers under semantic confidence get no
row: no map is fitted to that number yet.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text, select, update

META = MetaData()
SERVED_ANSWERS = Table("served_answers", META,
                       Column("id", String(128), primary_key=True),  # the response key (gateway/serving/wire.py's response_key)
                       Column("domain", String(64), nullable=False, index=True),
                       Column("version", String(128), nullable=False),
                       Column("kind", String(16), nullable=False),  # multiple_choice | free_form
                       Column("method", String(16)),  # free form: token | semantic
                       Column("confidence", Float, nullable=False),
                       Column("chosen", Integer),  # multiple choice: the option answered
                       Column("log_probs", Text),  # multiple choice: JSON list, the options' served log-probs
                       Column("correct", Integer))  # the verdict, once there is one


@dataclass(frozen=True)
class ServedAnswer:
    """One answer as served, in the terms a recalibration needs."""

    version: str
    kind: str
    confidence: float
    method: str | None = None
    chosen: int | None = None
    option_probs: tuple[float, ...] | None = None

    def row(self, key: str, domain: str) -> dict:
        log_probs = (json.dumps([round(math.log(max(p, 1e-300)), 6) for p in self.option_probs])
                     if self.option_probs is not None else None)
        return dict(id=key, domain=domain, version=self.version, kind=self.kind, method=self.method,
                    confidence=self.confidence, chosen=self.chosen, log_probs=log_probs, correct=None)


@dataclass(frozen=True)
class JudgedChoice:
    """A served multiple-choice answer and its verdict: which option was right is known only when it was right."""

    log_probs: np.ndarray
    chosen: int
    correct: bool


@dataclass(frozen=True)
class JudgedConfidence:
    """A served free-form answer's token confidence and its verdict."""

    confidence: float
    correct: bool


def judge(connection, key: str, correct: bool) -> None:
    """Record a verdict (inside the caller's transaction, beside its feedback row)."""
    connection.execute(update(SERVED_ANSWERS).where(SERVED_ANSWERS.c.id == key).values(correct=int(correct)))


def judged_choices(db, domain: str, version: str) -> list[JudgedChoice]:
    """The domain's multiple-choice answers served by `version` that feedback judged (in key order). The table is
    created if this database has none yet (a worker may start before any gateway)."""
    db.create_tables(META)
    query = (select(SERVED_ANSWERS.c.log_probs, SERVED_ANSWERS.c.chosen, SERVED_ANSWERS.c.correct)
             .where(SERVED_ANSWERS.c.domain == domain, SERVED_ANSWERS.c.version == version,
                    SERVED_ANSWERS.c.kind == "multiple_choice", SERVED_ANSWERS.c.correct.is_not(None),
                    SERVED_ANSWERS.c.log_probs.is_not(None))
             .order_by(SERVED_ANSWERS.c.id))
    with db.engine.connect() as c:
        rows = c.execute(query).all()
    return [JudgedChoice(np.array(json.loads(lp), dtype=np.float64), int(chosen), bool(correct))
            for lp, chosen, correct in rows]


def judged_free_form(db, domain: str, version: str) -> list[JudgedConfidence]:
    """The domain's free-form answers served by `version` with token confidence that feedback judged (in key order)."""
    db.create_tables(META)
    query = (select(SERVED_ANSWERS.c.confidence, SERVED_ANSWERS.c.correct)
             .where(SERVED_ANSWERS.c.domain == domain, SERVED_ANSWERS.c.version == version,
                    SERVED_ANSWERS.c.kind == "free_form", SERVED_ANSWERS.c.method == "token",
                    SERVED_ANSWERS.c.correct.is_not(None))
             .order_by(SERVED_ANSWERS.c.id))
    with db.engine.connect() as c:
        rows = c.execute(query).all()
    return [JudgedConfidence(float(confidence), bool(correct)) for confidence, correct in rows]
