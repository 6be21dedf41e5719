"""SQLite persistence (the embedded default): policies with versioned audit log, responses and their feedback.

Only what the product needs is stored: response id, domain, confidence, time. Never prompt or answer text.
Writes are transactions, so a crash loses at most the write in flight, never what was stored before.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

from gateway.keys import ClientKey

SCHEMA = """
CREATE TABLE IF NOT EXISTS policies (
    domain TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    version INTEGER NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS policy_audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    domain TEXT NOT NULL,
    version INTEGER NOT NULL,
    action TEXT NOT NULL,
    before TEXT,
    after TEXT,
    actor TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    domain TEXT NOT NULL,
    confidence REAL NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS feedback (
    response_id TEXT PRIMARY KEY REFERENCES responses(id),
    correct INTEGER NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS feedback_at ON feedback(at);
CREATE TABLE IF NOT EXISTS client_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    key_sha256 TEXT NOT NULL UNIQUE,
    domains TEXT,
    requests_per_minute REAL,
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS risk_fits (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    domain TEXT NOT NULL,
    fit TEXT NOT NULL,
    at REAL NOT NULL
);
"""


class Store:
    def __init__(self, path: str | Path):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # -- policies ---------------------------------------------------------------------------------------------
    def list_policies(self) -> dict[str, tuple[dict, int]]:
        with self._lock:
            rows = self._conn.execute("SELECT domain, body, version FROM policies ORDER BY domain").fetchall()
        return {d: (json.loads(b), v) for d, b, v in rows}

    def get_policy(self, domain: str) -> tuple[dict, int] | None:
        with self._lock:
            row = self._conn.execute("SELECT body, version FROM policies WHERE domain = ?", (domain,)).fetchone()
        return (json.loads(row[0]), row[1]) if row else None

    def put_policy(self, domain: str, body: dict, actor: str, expected_version: int | None = None) -> int:
        """Create or replace; returns the new version. `expected_version` guards against lost updates."""
        with self._lock, self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            row = self._conn.execute("SELECT body, version FROM policies WHERE domain = ?", (domain,)).fetchone()
            current = row[1] if row else 0
            if expected_version is not None and expected_version != current:
                raise VersionConflict(domain, expected_version, current)
            version = current + 1
            text = json.dumps(body, sort_keys=True)
            self._conn.execute(
                "INSERT INTO policies(domain, body, version, updated_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(domain) DO UPDATE SET body = excluded.body, version = excluded.version, "
                "updated_at = excluded.updated_at",
                (domain, text, version, time.time()),
            )
            self._audit(domain, version, "update" if row else "create", row[0] if row else None, text, actor)
        return version

    def delete_policy(self, domain: str, actor: str) -> bool:
        with self._lock, self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            row = self._conn.execute("SELECT body, version FROM policies WHERE domain = ?", (domain,)).fetchone()
            if not row:
                self._conn.execute("ROLLBACK")
                return False
            self._conn.execute("DELETE FROM policies WHERE domain = ?", (domain,))
            self._audit(domain, row[1] + 1, "delete", row[0], None, actor)
        return True

    def _audit(self, domain, version, action, before, after, actor) -> None:
        self._conn.execute(
            "INSERT INTO policy_audit(domain, version, action, before, after, actor, at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (domain, version, action, before, after, actor, time.time()),
        )

    def audit_log(self, domain: str | None = None, limit: int = 100) -> list[dict]:
        query = "SELECT seq, domain, version, action, before, after, actor, at FROM policy_audit"
        args: tuple = ()
        if domain is not None:
            query += " WHERE domain = ?"
            args = (domain,)
        with self._lock:
            rows = self._conn.execute(query + " ORDER BY seq DESC LIMIT ?", (*args, limit)).fetchall()
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
        with self._lock:
            self._conn.execute(
                "INSERT OR IGNORE INTO responses(id, domain, confidence, created_at) VALUES (?, ?, ?, ?)",
                (response_id, domain, confidence, time.time()),
            )

    def record_responses(self, rows: list[tuple[str, str, float]]) -> None:
        """Several (id, domain, confidence) in one transaction: the choices of one response."""
        at = time.time()
        with self._lock, self._conn:
            self._conn.executemany(
                "INSERT OR IGNORE INTO responses(id, domain, confidence, created_at) VALUES (?, ?, ?, ?)",
                [(i, d, c, at) for i, d, c in rows])

    def get_response(self, response_id: str) -> tuple[str, float] | None:
        with self._lock:
            row = self._conn.execute("SELECT domain, confidence FROM responses WHERE id = ?", (response_id,)).fetchone()
        return (row[0], row[1]) if row else None

    def add_feedback(self, response_id: str, correct: bool) -> bool | None:
        """Store feedback once. Returns True if stored now, False if the same verdict was already stored, and None
        if a different verdict was stored before (a conflict the caller reports)."""
        with self._lock, self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            row = self._conn.execute("SELECT correct FROM feedback WHERE response_id = ?", (response_id,)).fetchone()
            if row is not None:
                return False if bool(row[0]) == correct else None
            self._conn.execute(
                "INSERT INTO feedback(response_id, correct, at) VALUES (?, ?, ?)", (response_id, int(correct), time.time())
            )
        return True

    def labelled_answers(self, domain: str) -> tuple[list[float], list[bool]]:
        """Every answer of the domain that has a verdict: (confidence, correct), oldest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT r.confidence, f.correct FROM feedback f JOIN responses r ON r.id = f.response_id "
                "WHERE r.domain = ? ORDER BY f.at", (domain,)).fetchall()
        return [r[0] for r in rows], [bool(r[1]) for r in rows]

    def labelled_domains(self) -> list[str]:
        with self._lock:
            rows = self._conn.execute("SELECT DISTINCT r.domain FROM feedback f JOIN responses r ON r.id = f.response_id").fetchall()
        return [r[0] for r in rows]

    def feedback_since(self, domain: str, since: float) -> tuple[list[float], list[bool]]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT r.confidence, f.correct FROM feedback f JOIN responses r ON r.id = f.response_id "
                "WHERE r.domain = ? AND f.at > ?", (domain, since)).fetchall()
        return [r[0] for r in rows], [bool(r[1]) for r in rows]

    def record_risk_fit(self, domain: str, fit: dict, policy_version: int, previous: dict | None) -> float:
        """Keep a guaranteed-threshold fit and audit it like a policy change; returns its time."""
        at = time.time()
        with self._lock, self._conn:
            self._conn.execute("BEGIN IMMEDIATE")
            self._conn.execute("INSERT INTO risk_fits(domain, fit, at) VALUES (?, ?, ?)", (domain, json.dumps(fit), at))
            self._audit(domain, policy_version, "refit", json.dumps(previous) if previous else None, json.dumps(fit),
                        "risk-control")
        return at

    def latest_risk_fits(self) -> dict[str, tuple[dict, float]]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT domain, fit, at FROM risk_fits WHERE seq IN (SELECT MAX(seq) FROM risk_fits GROUP BY domain)"
            ).fetchall()
        return {d: (json.loads(f), at) for d, f, at in rows}

    def recent_feedback(self, domain: str, limit: int = 500) -> tuple[list[float], list[bool]]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT r.confidence, f.correct FROM feedback f JOIN responses r ON r.id = f.response_id "
                "WHERE r.domain = ? ORDER BY f.at DESC LIMIT ?",
                (domain, limit),
            ).fetchall()
        return [r[0] for r in rows], [bool(r[1]) for r in rows]


    # -- client keys (hashes only; the key itself is shown once, at creation) ------------------------------------
    def add_client_key(self, key_id: str, name: str, key_sha256: str, domains: list[str] | None,
                       requests_per_minute: float | None) -> float:
        at = time.time()
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT INTO client_keys(id, name, key_sha256, domains, requests_per_minute, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (key_id, name, key_sha256, json.dumps(domains) if domains is not None else None, requests_per_minute, at))
            self._audit(f"key:{key_id}", 1, "create", None, json.dumps({"name": name, "domains": domains,
                                                                         "requests_per_minute": requests_per_minute}),
                        "admin")
        return at

    def revoke_client_key(self, key_id: str) -> bool:
        with self._lock, self._conn:
            cur = self._conn.execute("UPDATE client_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                                     (time.time(), key_id))
            if cur.rowcount:
                self._audit(f"key:{key_id}", 2, "revoke", None, None, "admin")
        return bool(cur.rowcount)

    def client_keys(self) -> list[tuple[ClientKey, str]]:
        with self._lock:
            rows = self._conn.execute("SELECT id, name, domains, requests_per_minute, created_at, revoked_at, key_sha256 "
                                      "FROM client_keys ORDER BY created_at").fetchall()
        return [(ClientKey(r[0], r[1], tuple(json.loads(r[2])) if r[2] else None, r[3], r[4], r[5]), r[6]) for r in rows]

    def active_client_keys(self) -> dict[str, ClientKey]:
        """key hash -> ClientKey, revoked keys left out."""
        return {digest: key for key, digest in self.client_keys() if key.revoked_at is None}


class VersionConflict(Exception):
    def __init__(self, domain: str, expected: int, current: int):
        super().__init__(f"policy {domain!r} is at version {current}, not {expected}")
        self.current = current
