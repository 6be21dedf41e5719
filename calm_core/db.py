"""One database layer (SQLAlchemy Core) for every process that stores something: the gateway, the retraining worker
and the CLI. SQLite (a file, the embedded default) or PostgreSQL (replicas and workers sharing one database).

Writes are transactions: BEGIN IMMEDIATE on SQLite (its single writer taken up front, so two writers wait instead of
failing half-way), a plain transaction on PostgreSQL where row locks (`SELECT … FOR UPDATE`) order concurrent writers.
A SQLite write may also be asked not to wait (`_write(wait=False)`, for a caller on the event loop): it raises
WriterBusy instead, and the caller writes the usual way in a thread.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from sqlalchemy import Connection, create_engine, event, inspect
from sqlalchemy.exc import OperationalError
from sqlalchemy.dialects import postgresql, sqlite


def database_url(path_or_url: str | Path) -> str:
    """A SQLAlchemy URL: PostgreSQL URLs on psycopg 3, the driver installed (a plain postgresql:// or postgres:// URL,
    as PostgreSQL's own tools and most platforms write it, would make SQLAlchemy look for psycopg2), other URLs as
    given, anything else a SQLite file path."""
    text = str(path_or_url)
    for plain in ("postgresql://", "postgres://"):
        if text.startswith(plain):
            return "postgresql+psycopg://" + text[len(plain):]
    if "://" in text:
        return text
    if text != ":memory:":
        Path(text).parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{text}"


_SCHEMA_LOCK = 0x43414C4D  # "CALM": the advisory lock key under which tables are created
# A write that may not wait never checkpoints SQLite's WAL (a checkpoint copies up to ~1,000 pages and fsyncs: not on
# the event loop); it declines one time in this many, so a waiting write comes in between, whose connection runs
# SQLite's automatic checkpoint once the WAL passes 1,000 pages (an answer's record adds a few).
CHECKPOINT_EVERY = 64


POSTGRES_CONNECT_ARGS = {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
                         "keepalives_count": 3}


def _add_missing_columns(conn: Connection, meta) -> None:
    """Columns added to a table after it was first created (nullable ones only: the rows already stored get NULL), so a
    database made by an earlier version keeps everything it holds and gains them. create_all leaves existing tables as
    they are."""
    inspector = inspect(conn)
    for table in meta.sorted_tables:
        present = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name not in present and column.nullable:
                kind = column.type.compile(dialect=conn.dialect)
                # IF NOT EXISTS: another process (SQLite has no schema lock here) may add it first
                guard = "IF NOT EXISTS " if conn.dialect.name == "postgresql" else ""
                try:
                    conn.exec_driver_sql(f'ALTER TABLE {table.name} ADD COLUMN {guard}"{column.name}" {kind}')
                except OperationalError as e:
                    if "duplicate column" not in str(e):
                        raise


class WriterBusy(Exception):
    """A write asked not to wait would have had to: another writer holds SQLite's lock (in this process or another),
    a checkpoint is due, or the database is not SQLite. Nothing was written."""


class Database:
    def __init__(self, path_or_url: str | Path):
        self.url = database_url(path_or_url)
        self.sqlite = self.url.startswith("sqlite")
        if self.sqlite:
            self.engine = create_engine(self.url, connect_args={"check_same_thread": False, "timeout": 30})
            event.listen(self.engine, "connect", _sqlite_pragmas)
        else:
            # A server that accepts and never answers, or a network that drops packets, must fail a connection in
            # seconds, not at the kernel's TCP timeout (minutes; libpq's connect_timeout is unlimited by default): the
            # gateway answers 503 and its health checks keep answering. Keepalives notice a dead pooled connection.
            self.engine = create_engine(self.url, pool_pre_ping=True, pool_size=5, max_overflow=10,
                                        connect_args=POSTGRES_CONNECT_ARGS)
        # SQLite has one writer: this process's writes are serialised here rather than retried on "database is locked".
        self._write_lock = threading.Lock() if self.sqlite else _NoLock()
        self._unwaiting: Connection | None = None  # the connection of writes that may not wait, made on first use
        self._unwaiting_writes = 0

    def close(self) -> None:
        if self._unwaiting is not None:
            self._unwaiting.close()
        self.engine.dispose()

    def create_tables(self, meta) -> None:
        """Create the tables `meta` lists that do not exist yet. Several processes may start on one empty database at
        once (gateway replicas, the worker): on PostgreSQL the check-then-create runs under a transaction-scoped
        advisory lock, since two concurrent CREATE TABLEs of one name fail with a unique violation in the catalog."""
        if self.sqlite:
            meta.create_all(self.engine)
            with self.engine.begin() as conn:
                _add_missing_columns(conn, meta)
            return
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_SCHEMA_LOCK})")
            meta.create_all(conn)
            _add_missing_columns(conn, meta)

    def ping(self) -> None:
        """Raises the driver's error when the database does not answer (readiness)."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    def insert_ignoring_duplicates(self, table, key: str) -> "PreparedInsert":
        """`INSERT … ON CONFLICT (key) DO NOTHING` into `table`, compiled once for this database's driver."""
        dialect = sqlite if self.sqlite else postgresql
        statement = dialect.insert(table).on_conflict_do_nothing(index_elements=[table.c[key]])
        return PreparedInsert(statement.compile(dialect=self.engine.dialect))

    def _write(self, wait: bool = True):
        """A write transaction: `with db._write() as conn:`, committed on success, rolled back on any error. With
        `wait=False` its start raises WriterBusy where it would wait (SQLite only)."""
        return _WriteTx(self, wait)

    def _unwaiting_connection(self) -> Connection:
        """Kept out of the pool: it never waits for SQLite's lock (busy_timeout 0) and never checkpoints the WAL."""
        if self._unwaiting is None:
            conn = self.engine.connect()
            conn.connection.driver_connection.execute("PRAGMA busy_timeout=0")
            conn.connection.driver_connection.execute("PRAGMA wal_autocheckpoint=0")
            self._unwaiting = conn
        return self._unwaiting


class PreparedInsert:
    """An insert as the driver's SQL text, executed for many rows at once. SQLAlchemy does not cache the compiled form
    of an ON CONFLICT statement (it has no cache key in 2.0), so executing it compiled it on every call: a third of a
    millisecond of CPU per group commit at the gateway's ceiling."""

    def __init__(self, compiled):
        self.sql = str(compiled)
        # Positional drivers (sqlite3's "?") take tuples in the compiled order; named ones (psycopg's %(id)s) dicts.
        self.order = [compiled.binds[name].key for name in compiled.positiontup] if compiled.positiontup else None

    def execute(self, conn, rows: list[dict]) -> None:
        """On the driver's cursor of `conn`'s connection, inside its transaction: SQLAlchemy's execution context per
        statement was a fifth of a response record's CPU at the gateway's ceiling, and these statements need none of
        it (no result, no type processing)."""
        if not rows:
            return
        params = [tuple(r[k] for k in self.order) for r in rows] if self.order else rows
        cursor = conn.connection.cursor()
        try:
            cursor.executemany(self.sql, params)
        finally:
            cursor.close()


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # WAL: readers never wait for the writer; autocommit at the driver so BEGIN IMMEDIATE below is ours to issue.
    # FULL: each commit fsyncs the WAL before it returns, so what was acknowledged (an answer's record, a verdict, a
    # policy, a revoked key) survives a power loss; NORMAL could lose the last commits. The group commit
    # (gateway/records/group_commit.py) shares one fsync among the requests of a burst.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


class _NoLock:
    def acquire(self, blocking: bool = True) -> bool:
        return True

    def release(self) -> None:
        pass


class _WriteTx:
    def __init__(self, db: Database, wait: bool = True):
        self.db = db
        self.wait = wait

    def __enter__(self):
        if not self.wait:
            return self._enter_unwaiting()
        self.db._write_lock.acquire()
        try:
            self.conn = self.db.engine.connect()
            if self.db.sqlite:  # on the driver, as PreparedInsert: SQLite's autocommit mode leaves BEGIN to us
                self.conn.connection.driver_connection.execute("BEGIN IMMEDIATE")
            else:
                self.conn.begin()
        except BaseException:
            self.db._write_lock.release()
            raise
        return self.conn

    def _enter_unwaiting(self):
        db = self.db
        if not db.sqlite or not db._write_lock.acquire(blocking=False):
            raise WriterBusy
        try:
            db._unwaiting_writes += 1
            if db._unwaiting_writes % CHECKPOINT_EVERY == 0:
                raise WriterBusy
            self.conn = db._unwaiting_connection()
            try:
                self.conn.connection.driver_connection.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:  # another process's writer: SQLITE_BUSY at once, as busy_timeout 0 says
                if e.sqlite_errorcode == sqlite3.SQLITE_BUSY:
                    raise WriterBusy from None
                raise
        except BaseException:
            db._write_lock.release()
            raise
        return self.conn

    def __exit__(self, exc_type, exc, tb):
        ended = False
        try:
            if self.db.sqlite:
                self.conn.connection.driver_connection.execute("ROLLBACK" if exc_type else "COMMIT")
            elif exc_type:
                self.conn.rollback()
            else:
                self.conn.commit()
            ended = True
        finally:
            if self.wait:
                self.conn.close()  # the pool rolls back what a failed end left open
            elif not ended:  # its transaction may still be open: the next write that may not wait takes a new connection
                self.db._unwaiting = None
                self.conn.close()
            self.db._write_lock.release()
        return False
