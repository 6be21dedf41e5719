"""What escalate and review policies store, in the gateway's database beside its responses (gateway/records/store.py).

- escalations: one row per escalated choice (its response id, the first model's confidence, the target model and
  its confidence); feedback on an escalated answer judges the target and is kept here, never as a label of the first
  model, whose answer the caller did not see;
- reviews: the queue an operator reads. Unlike every other table it holds text (the question and the first answer),
  since judging them is its purpose; a verdict closes the review and becomes the feedback of its response, a label
  of the first model's answer at its confidence (online ECE, guaranteed-risk fits). The caller saw only the policy's
  message, so its own feedback on that response is refused (gateway/routers/feedback.py), and the reviewer's verdict
  replaces any the caller gave before that rule.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text, delete, select, update
from sqlalchemy.exc import IntegrityError, ProgrammingError

from calm_core.prompts import LETTERS
from calm_core.served_answers import judge
from gateway.records.store import FEEDBACK, Store

META = MetaData()
ESCALATIONS = Table("escalations", META,
                    Column("response_id", String(128), primary_key=True),
                    Column("domain", String(64), nullable=False, index=True),
                    Column("confidence", Float, nullable=False),
                    Column("target_model", String(256), nullable=False),
                    Column("target_confidence", Float),
                    Column("correct", Integer),
                    Column("created_at", Float, nullable=False),
                    Column("key_id", String(32)),  # the client key that received the target's answer
                    Column("judged_by", String(32)))  # the key whose feedback `correct` is
REVIEWS = Table("reviews", META,
                Column("id", String(40), primary_key=True),
                Column("domain", String(64), nullable=False, index=True),
                Column("response_id", String(128), nullable=False, index=True),  # read for every feedback
                Column("request", Text, nullable=False),
                Column("answer", Text, nullable=False),
                Column("confidence", Float, nullable=False),
                Column("created_at", Float, nullable=False, index=True),
                Column("closed_at", Float),
                Column("correct", Integer),
                Column("reviewer", String(64)),
                Column("note", Text))


@dataclass(frozen=True)
class Review:
    id: str
    domain: str
    response_id: str
    request: dict  # the caller's messages or prompt, and options
    answer: str
    confidence: float
    created_at: float
    closed_at: float | None = None
    correct: bool | None = None
    reviewer: str | None = None
    note: str | None = None

    @property
    def answer_option(self) -> str | None:
        """The text of the option a withheld multiple-choice letter names, for the person judging it (None for a
        free-form answer)."""
        options = self.request.get("options") or []
        return str(options[LETTERS.index(self.answer)]) if self.answer in LETTERS[:len(options)] else None


class HandoffStore:
    def __init__(self, store: Store):
        self.db = store
        store.create_tables(META)
        self._index_existing_reviews()

    def _index_existing_reviews(self) -> None:
        """A reviews table made before feedback looked reviews up by response has no index on it; create_tables leaves
        an existing table as it is, so the index is added here."""
        for index in REVIEWS.indexes:
            try:
                index.create(self.db.engine, checkfirst=True)
            except (IntegrityError, ProgrammingError):  # another replica created it between the check and ours
                pass

    # -- escalations ----------------------------------------------------------------------------------------------
    def record_escalations(self, rows: list[tuple[str, str, float, str, float | None, str | None]]) -> None:
        """(response id, domain, first confidence, target model, target confidence, key id) per escalated choice."""
        at = time.time()
        with self.db._write() as c:
            c.execute(ESCALATIONS.insert(), [dict(response_id=r, domain=d, confidence=conf, target_model=m,
                                                  target_confidence=t, created_at=at, key_id=k)
                                             for r, d, conf, m, t, k in rows])

    def escalation_of(self, response_id: str) -> tuple[str, str | None] | None:
        """(domain, id of the key that received it) of an escalated answer."""
        e = ESCALATIONS.c
        with self.db.engine.connect() as c:
            row = c.execute(select(e.domain, e.key_id).where(e.response_id == response_id)).first()
        return (row[0], row[1]) if row else None

    def judge_escalation(self, response_id: str, correct: bool, key_id: str | None = None) -> bool | None:
        """Feedback on an escalated answer, once: True stored now, False the same verdict was stored, None a different
        one was (a conflict)."""
        e = ESCALATIONS.c
        with self.db._write() as c:
            stored = c.execute(select(e.correct).where(e.response_id == response_id)).scalar()
            if stored is not None:
                return False if bool(stored) == correct else None
            c.execute(update(ESCALATIONS).where(e.response_id == response_id).values(correct=int(correct),
                                                                                     judged_by=key_id))
        return True

    # -- reviews --------------------------------------------------------------------------------------------------
    def open_reviews(self, reviews: list[Review]) -> None:
        with self.db._write() as c:
            c.execute(REVIEWS.insert(), [dict(id=r.id, domain=r.domain, response_id=r.response_id,
                                              request=json.dumps(r.request), answer=r.answer, confidence=r.confidence,
                                              created_at=r.created_at) for r in reviews])

    def reviews(self, status: str = "open", domain: str | None = None, limit: int = 100) -> list[Review]:
        """Oldest first (the queue's order); status open, closed or all."""
        r = REVIEWS.c
        query = select(REVIEWS).order_by(r.created_at, r.id).limit(limit)
        if status != "all":
            query = query.where(r.closed_at.is_(None) if status == "open" else r.closed_at.is_not(None))
        if domain is not None:
            query = query.where(r.domain == domain)
        with self.db.engine.connect() as c:
            return [_review(row) for row in c.execute(query).mappings()]

    def review_of(self, response_id: str) -> str | None:
        """The id of the review a response's answer was withheld for (open or closed), if any."""
        with self.db.engine.connect() as c:
            return c.execute(select(REVIEWS.c.id).where(REVIEWS.c.response_id == response_id).limit(1)).scalar()

    def review(self, review_id: str) -> Review | None:
        with self.db.engine.connect() as c:
            row = c.execute(select(REVIEWS).where(REVIEWS.c.id == review_id)).mappings().first()
        return _review(row) if row else None

    def close_review(self, review_id: str, correct: bool, reviewer: str, note: str | None) -> bool | None:
        """Close a review with its verdict and store that verdict as its response's feedback, in one transaction.
        True closed now, False already closed with the same verdict, None closed with another (a conflict).
        Feedback a caller gave on the withheld answer before such feedback was refused is replaced, not a conflict:
        the caller never saw the answer, and a review that could not close would stay in the queue for ever."""
        r = REVIEWS.c
        with self.db._write() as c:
            # Locked: two replicas closing one review at once get closed-now and a conflict, not two verdicts.
            row = c.execute(select(r.correct, r.response_id).where(r.id == review_id).with_for_update()).first()
            if row is None:
                raise LookupError(review_id)
            if row[0] is not None:
                return False if bool(row[0]) == correct else None
            c.execute(update(REVIEWS).where(r.id == review_id).values(
                correct=int(correct), closed_at=time.time(), reviewer=reviewer, note=note))
            c.execute(delete(FEEDBACK).where(FEEDBACK.c.response_id == row[1]))
            c.execute(FEEDBACK.insert().values(response_id=row[1], correct=int(correct), at=time.time()))
            judge(c, row[1], correct)
        return True


def _review(row) -> Review:
    return Review(row["id"], row["domain"], row["response_id"], json.loads(row["request"]), row["answer"],
                  row["confidence"], row["created_at"], row["closed_at"],
                  bool(row["correct"]) if row["correct"] is not None else None, row["reviewer"], row["note"])
