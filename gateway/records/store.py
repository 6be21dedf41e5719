"""Persistence through one data layer (SQLAlchemy Core) on SQLite (the embedded default) or PostgreSQL (replicas
sharing one database): policies with a versioned audit log, responses and their feedback, risk fits, client keys.

Only what the product needs is stored: response id, domain, confidence, time. Never prompt or answer text (the one
exception is the review queue of review policies, gateway/records/handoff_store.py, which exists to show them to an operator).
Writes are transactions, so a crash loses at most the write in flight, never what was stored before. Policy writes
take a row lock (PostgreSQL `SELECT … FOR UPDATE`; SQLite's single writer), so concurrent writers on several replicas
get a version conflict, not a lost update.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import Boolean, Column, Float, Integer, MetaData, String, Table, Text, delete, func, select, update
from sqlalchemy.exc import IntegrityError

from calm_core.db import Database, WriterBusy
from calm_core.served_answers import META as SERVED_META
from calm_core.served_answers import SERVED_ANSWERS, judge
from gateway.records.client_keys import ClientKey

META = MetaData()
POLICIES = Table("policies", META,
                 Column("domain", String(64), primary_key=True),
                 Column("body", Text, nullable=False),
                 Column("version", Integer, nullable=False),
                 Column("updated_at", Float, nullable=False))
AUDIT = Table("policy_audit", META,
              Column("seq", Integer, primary_key=True, autoincrement=True),
              Column("domain", String(80), nullable=False, index=True),
              Column("version", Integer, nullable=False),
              Column("action", String(16), nullable=False),
              Column("before", Text),
              Column("after", Text),
              Column("actor", String(64), nullable=False),
              Column("at", Float, nullable=False))
RESPONSES = Table("responses", META,
                  Column("id", String(128), primary_key=True),
                  Column("domain", String(64), nullable=False),
                  Column("confidence", Float, nullable=False),
                  Column("created_at", Float, nullable=False),
                  Column("key_id", String(32)))  # the client key that received it (None: served without keys)
FEEDBACK = Table("feedback", META,
                 Column("response_id", String(128), primary_key=True),
                 Column("correct", Integer, nullable=False),
                 Column("at", Float, nullable=False, index=True),
                 Column("key_id", String(32)))  # the key that gave it (None: without keys, or a reviewer's verdict)
RISK_FITS = Table("risk_fits", META,
                  Column("seq", Integer, primary_key=True, autoincrement=True),
                  Column("domain", String(64), nullable=False),
                  Column("fit", Text, nullable=False),
                  Column("at", Float, nullable=False))
CLIENT_KEYS = Table("client_keys", META,
                    Column("id", String(32), primary_key=True),
                    Column("name", String(128), nullable=False),
                    Column("key_sha256", String(64), nullable=False, unique=True),
                    Column("domains", Text),
                    Column("requests_per_minute", Float),
                    Column("created_at", Float, nullable=False),
                    Column("revoked_at", Float),
                    Column("labeller", Boolean),  # may give feedback on any answer of its domains
                    Column("sequences_per_minute", Integer))  # engine work per minute, all replicas (gateway/edge/usage.py)


class Store(Database):
    def __init__(self, path_or_url: str | Path):
        super().__init__(path_or_url)
        self.create_tables(META)
        self.create_tables(SERVED_META)
        # Compiled once: these run for every answer served.
        self._insert_responses = self.insert_ignoring_duplicates(RESPONSES, "id")
        self._insert_served = self.insert_ignoring_duplicates(SERVED_ANSWERS, "id")

    # -- policies ---------------------------------------------------------------------------------------------
    def list_policies(self) -> dict[str, tuple[dict, int]]:
        with self.engine.connect() as c:
            rows = c.execute(select(POLICIES.c.domain, POLICIES.c.body, POLICIES.c.version)
                             .order_by(POLICIES.c.domain)).all()
        return {d: (json.loads(b), v) for d, b, v in rows}

    def get_policy(self, domain: str) -> tuple[dict, int] | None:
        with self.engine.connect() as c:
            row = c.execute(select(POLICIES.c.body, POLICIES.c.version).where(POLICIES.c.domain == domain)).first()
        return (json.loads(row[0]), row[1]) if row else None

    def put_policy(self, domain: str, body: dict, actor: str, expected_version: int | None = None) -> int:
        """Create or replace; returns the new version. `expected_version` guards against lost updates."""
        text = json.dumps(body, sort_keys=True)
        try:
            with self._write() as c:
                row = c.execute(select(POLICIES.c.body, POLICIES.c.version).where(POLICIES.c.domain == domain)
                                .with_for_update()).first()
                current = row[1] if row else 0
                if expected_version is not None and expected_version != current:
                    raise VersionConflict(domain, expected_version, current)
                version = current + 1
                values = dict(body=text, version=version, updated_at=time.time())
                if row:
                    c.execute(update(POLICIES).where(POLICIES.c.domain == domain).values(**values))
                else:
                    c.execute(POLICIES.insert().values(domain=domain, **values))
                self._audit(c, domain, version, "update" if row else "create", row[0] if row else None, text, actor)
        except IntegrityError:  # another replica created the same domain's policy first
            raise VersionConflict(domain, expected_version or 0, (self.get_policy(domain) or ({}, 0))[1]) from None
        return version

    def delete_policy(self, domain: str, actor: str) -> bool:
        with self._write() as c:
            row = c.execute(select(POLICIES.c.body, POLICIES.c.version).where(POLICIES.c.domain == domain)
                            .with_for_update()).first()
            if not row:
                return False
            c.execute(delete(POLICIES).where(POLICIES.c.domain == domain))
            self._audit(c, domain, row[1] + 1, "delete", row[0], None, actor)
        return True

    @staticmethod
    def _audit(c, domain, version, action, before, after, actor) -> None:
        c.execute(AUDIT.insert().values(domain=domain, version=version, action=action, before=before, after=after,
                                        actor=actor, at=time.time()))

    def audit_log(self, domain: str | None = None, limit: int = 100) -> list[dict]:
        query = select(AUDIT.c.seq, AUDIT.c.domain, AUDIT.c.version, AUDIT.c.action, AUDIT.c.before, AUDIT.c.after,
                       AUDIT.c.actor, AUDIT.c.at)
        if domain is not None:
            query = query.where(AUDIT.c.domain == domain)
        with self.engine.connect() as c:
            rows = c.execute(query.order_by(AUDIT.c.seq.desc()).limit(limit)).all()
        keys = ("seq", "domain", "version", "action", "before", "after", "actor", "at")
        out = []
        for row in rows:
            item = dict(zip(keys, row))
            item["before"] = json.loads(item["before"]) if item["before"] else None
            item["after"] = json.loads(item["after"]) if item["after"] else None
            out.append(item)
        return out

    # -- responses and feedback ---------------------------------------------------------------------------------
    def record_response(self, response_id: str, domain: str, confidence: float) -> None:
        self.record_responses([(response_id, domain, confidence)])

    def record_responses(self, rows: Sequence[tuple], wait: bool = True) -> bool:
        """Several (id, domain, confidence[, ServedAnswer[, key id]]) in one transaction (the choices of one response, or a group
        commit's); ids already stored are left as they are. A ServedAnswer keeps what the confidence was made of (the
        labels feedback gives for recalibration, calm_core/served_answers.py). With `wait=False` nothing is written and
        False returned where the write would wait for SQLite's lock (calm_core/db.py WriterBusy)."""
        at = time.time()
        served = [r[3].row(r[0], r[1]) for r in rows if len(r) > 3 and r[3] is not None]
        try:
            with self._write(wait) as c:  # one statement per table, no read first
                self._insert_responses.execute(c, [dict(id=r[0], domain=r[1], confidence=r[2], created_at=at,
                                                        key_id=r[4] if len(r) > 4 else None) for r in rows])
                self._insert_served.execute(c, served)
        except WriterBusy:
            return False
        return True

    def get_response(self, response_id: str) -> tuple[str, float, str | None] | None:
        """(domain, confidence, id of the key that received it) of a stored answer."""
        r = RESPONSES.c
        with self.engine.connect() as c:
            row = c.execute(select(r.domain, r.confidence, r.key_id).where(r.id == response_id)).first()
        return (row[0], row[1], row[2]) if row else None

    def add_feedback(self, response_id: str, correct: bool, key_id: str | None = None) -> bool | None:
        """Store feedback once. Returns True if stored now, False if the same verdict was already stored, and None
        if a different verdict was stored before (a conflict the caller reports)."""
        try:
            with self._write() as c:
                row = c.execute(select(FEEDBACK.c.correct).where(FEEDBACK.c.response_id == response_id)).first()
                if row is not None:
                    return False if bool(row[0]) == correct else None
                c.execute(FEEDBACK.insert().values(response_id=response_id, correct=int(correct), at=time.time(),
                                                   key_id=key_id))
                judge(c, response_id, correct)
        except IntegrityError:  # the same response's feedback arrived at another replica in between
            stored = self._feedback_of(response_id)
            return False if stored == correct else None
        return True

    def _feedback_of(self, response_id: str) -> bool | None:
        with self.engine.connect() as c:
            row = c.execute(select(FEEDBACK.c.correct).where(FEEDBACK.c.response_id == response_id)).first()
        return bool(row[0]) if row else None

    def _labelled(self, domain: str):
        return (select(RESPONSES.c.confidence, FEEDBACK.c.correct)
                .join_from(FEEDBACK, RESPONSES, RESPONSES.c.id == FEEDBACK.c.response_id)
                .where(RESPONSES.c.domain == domain))

    def _pairs(self, query) -> tuple[list[float], list[bool]]:
        with self.engine.connect() as c:
            rows = c.execute(query).all()
        return [r[0] for r in rows], [bool(r[1]) for r in rows]

    def labelled_answers(self, domain: str) -> tuple[list[float], list[bool]]:
        """Every answer of the domain that has a verdict: (confidence, correct), oldest first."""
        return self._pairs(self._labelled(domain).order_by(FEEDBACK.c.at))

    def labelled_domains(self) -> list[str]:
        with self.engine.connect() as c:
            rows = c.execute(select(RESPONSES.c.domain).distinct()
                             .join_from(FEEDBACK, RESPONSES, RESPONSES.c.id == FEEDBACK.c.response_id)).all()
        return [r[0] for r in rows]

    def feedback_since(self, domain: str, since: float) -> tuple[list[float], list[bool]]:
        return self._pairs(self._labelled(domain).where(FEEDBACK.c.at > since).order_by(FEEDBACK.c.at))

    def recent_feedback(self, domain: str, limit: int = 500) -> tuple[list[float], list[bool]]:
        return self._pairs(self._labelled(domain).order_by(FEEDBACK.c.at.desc()).limit(limit))

    def record_risk_fit(self, domain: str, fit: dict, policy_version: int, previous: dict | None) -> float:
        """Keep a guaranteed-threshold fit and audit it like a policy change; returns its time."""
        at = time.time()
        with self._write() as c:
            c.execute(RISK_FITS.insert().values(domain=domain, fit=json.dumps(fit), at=at))
            self._audit(c, domain, policy_version, "refit", json.dumps(previous) if previous else None, json.dumps(fit),
                        "risk-control")
        return at

    def latest_risk_fits(self) -> dict[str, tuple[dict, float]]:
        latest = select(func.max(RISK_FITS.c.seq)).group_by(RISK_FITS.c.domain)
        with self.engine.connect() as c:
            rows = c.execute(select(RISK_FITS.c.domain, RISK_FITS.c.fit, RISK_FITS.c.at)
                             .where(RISK_FITS.c.seq.in_(latest))).all()
        return {d: (json.loads(f), at) for d, f, at in rows}

    # -- client keys (hashes only; the key itself is shown once, at creation) ------------------------------------
    def add_client_key(self, key_id: str, name: str, key_sha256: str, domains: list[str] | None,
                       requests_per_minute: float | None, labeller: bool = False,
                       sequences_per_minute: int | None = None) -> float:
        at = time.time()
        with self._write() as c:
            c.execute(CLIENT_KEYS.insert().values(
                id=key_id, name=name, key_sha256=key_sha256, domains=json.dumps(domains) if domains is not None else None,
                requests_per_minute=requests_per_minute, created_at=at, labeller=labeller,
                sequences_per_minute=sequences_per_minute))
            self._audit(c, f"key:{key_id}", 1, "create", None, json.dumps(
                {"name": name, "domains": domains, "requests_per_minute": requests_per_minute, "labeller": labeller,
                 "sequences_per_minute": sequences_per_minute}), "admin")
        return at

    def revoke_client_key(self, key_id: str) -> bool:
        with self._write() as c:
            done = c.execute(update(CLIENT_KEYS).where(CLIENT_KEYS.c.id == key_id, CLIENT_KEYS.c.revoked_at.is_(None))
                             .values(revoked_at=time.time())).rowcount
            if done:
                self._audit(c, f"key:{key_id}", 2, "revoke", None, None, "admin")
        return bool(done)

    def client_keys(self) -> list[tuple[ClientKey, str]]:
        k = CLIENT_KEYS.c
        with self.engine.connect() as c:
            rows = c.execute(select(k.id, k.name, k.domains, k.requests_per_minute, k.created_at, k.revoked_at,
                                    k.key_sha256, k.labeller, k.sequences_per_minute).order_by(k.created_at)).all()
        return [(ClientKey(r[0], r[1], tuple(json.loads(r[2])) if r[2] else None, r[3], r[4], r[5], bool(r[7]), r[8]),
                 r[6]) for r in rows]

    def active_client_keys(self) -> dict[str, ClientKey]:
        """key hash -> ClientKey, revoked keys left out."""
        return {digest: key for key, digest in self.client_keys() if key.revoked_at is None}


class VersionConflict(Exception):
    def __init__(self, domain: str, expected: int, current: int):
        super().__init__(f"policy {domain!r} is at version {current}, not {expected}")
        self.current = current
