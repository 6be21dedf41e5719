"""Engine work per client key, limited per minute across every replica that shares the database.

A request's cost is the engine sequences it started (calm_core.engine.EngineBudget: options × option tokens, samples,
`n`, prompts, read-backs), not one count per request: a per-token multiple-choice question costs what tens of
requests do. A key created with `sequences_per_minute` is refused (429, Retry-After to the next minute) once the
minute's total, summed over the replicas, reaches it. Each replica adds what its requests spent to its own tally and,
at most every `sync_s`, in a thread, adds the tally to the shared row of (key, minute) and reads the minute's totals
back; so a replica sees the others' work within `sync_s` and one request's read of the database never waits on the
event loop. The limit is a minute window, not a sliding one: a key may spend up to twice it across a minute's edge.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from sqlalchemy import Column, Integer, MetaData, String, Table, select
from sqlalchemy.dialects import postgresql, sqlite

from calm_core.db import Database
from gateway.records.cached import CachedRead
from gateway.errors import APIError
from gateway.records.client_keys import ClientKey

META = MetaData()
KEY_USAGE = Table("key_usage", META,
                  Column("key_id", String(32), primary_key=True),
                  Column("minute", Integer, primary_key=True),  # unix time // 60
                  Column("sequences", Integer, nullable=False))


class EngineWork(CachedRead[dict]):
    """The minute's engine sequences per key: this replica's unsynced tally plus the shared totals last read."""

    def __init__(self, db: Database, sync_s: float = 1.0, clock=time.time):
        self.db, self.wall = db, clock
        db.create_tables(META)
        self._pending: dict[tuple[str, int], int] = defaultdict(int)
        self._syncing: dict[tuple[str, int], int] = {}  # taken by a sync whose totals are not read back yet
        self._lock = threading.Lock()
        dialect = sqlite if db.sqlite else postgresql
        insert = dialect.insert(KEY_USAGE)
        self._add = insert.on_conflict_do_update(index_elements=[KEY_USAGE.c.key_id, KEY_USAGE.c.minute],
                                                 set_={"sequences": KEY_USAGE.c.sequences + insert.excluded.sequences})
        super().__init__(self._sync, sync_s)
        self.refresh()

    def minute(self) -> int:
        return int(self.wall() // 60)

    def spent(self, key_id: str) -> int:
        minute = self.minute()
        shared = self.get().get((key_id, minute), 0)
        with self._lock:
            return shared + self._pending.get((key_id, minute), 0) + self._syncing.get((key_id, minute), 0)

    def refresh(self) -> dict:
        value = super().refresh()
        self._syncing = {}  # in the totals now
        return value

    def admit(self, key: ClientKey | None) -> None:
        """429 once the key's engine sequences this minute, over every replica, reach its limit."""
        if key is None or key.sequences_per_minute is None:
            return
        if self.spent(key.id) >= key.sequences_per_minute:
            raise APIError(429, f"engine work limit of {key.sequences_per_minute} sequences per minute reached for key "
                           f"{key.id}", "rate_limit_error", code="engine_rate_limit_exceeded",
                           retry_after_s=max(1, 60 - int(self.wall() % 60)))

    def add(self, key: ClientKey | None, sequences: int) -> None:
        if key is None or key.sequences_per_minute is None or sequences <= 0:
            return
        with self._lock:
            self._pending[(key.id, self.minute())] += sequences

    def _sync(self) -> dict:
        """Add this replica's tally to the shared rows, then read the current minute's totals (one transaction)."""
        with self._lock:
            pending, self._pending = self._pending, defaultdict(int)
            self._syncing = dict(pending)
        minute = self.minute()
        try:
            with self.db._write() as c:
                if pending:
                    c.execute(self._add, [dict(key_id=k, minute=m, sequences=n) for (k, m), n in pending.items()])
                rows = c.execute(select(KEY_USAGE.c.key_id, KEY_USAGE.c.sequences)
                                 .where(KEY_USAGE.c.minute == minute)).all()
                c.execute(KEY_USAGE.delete().where(KEY_USAGE.c.minute < minute - 1))  # older minutes serve nobody
        except Exception:
            with self._lock:  # not lost: added again with the next sync
                for k, n in pending.items():
                    self._pending[k] += n
                self._syncing = {}
            raise
        return {(key_id, minute): n for key_id, n in rows}
