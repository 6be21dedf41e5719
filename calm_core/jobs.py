"""Retraining jobs, persisted: queued by a drift alert, an operator or a schedule, claimed by a worker, and visible
with status, progress and a log tail to `calm jobs` and the admin API.

One open job per domain: `open_domain` holds the domain while a job is queued or running and is unique, so a second
alert for the same domain (Alertmanager repeats them) finds the open job instead of queueing another, on SQLite and
PostgreSQL alike. A worker renews `heartbeat` while it runs a job; a running job whose heartbeat is older than the
lease was left by a dead worker and is claimed again (resumed from its checkpoint), up to `max_attempts` tries, then
marked failed. A job is never deleted.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text, or_, select, update
from sqlalchemy.exc import IntegrityError

from calm_core.db import Database

OPEN = ("queued", "running")
# promoted: passed the gate and serves; awaiting_operator: passed a label-free gate, promotion is the operator's call;
# rejected: failed the gate (the candidate stays in the registry with the reason); failed: an error, see the log.
FINISHED = ("promoted", "awaiting_operator", "rejected", "failed")
LOG_LINES = 50

META = MetaData()
JOBS = Table("retrain_jobs", META,
             Column("id", String(32), primary_key=True),
             Column("domain", String(64), nullable=False, index=True),
             Column("open_domain", String(64), unique=True),
             Column("status", String(24), nullable=False),
             Column("trigger", String(16), nullable=False),
             Column("detail", Text, nullable=False),
             Column("created_at", Float, nullable=False),
             Column("updated_at", Float, nullable=False),
             Column("started_at", Float),
             Column("finished_at", Float),
             Column("worker", String(64)),
             Column("heartbeat", Float),
             Column("attempts", Integer, nullable=False),
             Column("progress", Float, nullable=False),
             Column("candidate", String(128)),
             Column("result", Text),
             Column("log", Text, nullable=False))


@dataclass(frozen=True)
class Job:
    id: str
    domain: str
    status: str
    trigger: str
    detail: dict
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None
    worker: str | None
    attempts: int
    progress: float
    candidate: str | None
    result: dict | None
    log: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


def _job(row) -> Job:
    return Job(id=row["id"], domain=row["domain"], status=row["status"], trigger=row["trigger"],
               detail=json.loads(row["detail"]), created_at=row["created_at"], updated_at=row["updated_at"],
               started_at=row["started_at"], finished_at=row["finished_at"], worker=row["worker"],
               attempts=row["attempts"], progress=row["progress"], candidate=row["candidate"],
               result=json.loads(row["result"]) if row["result"] else None, log=json.loads(row["log"]))


class JobQueue:
    def __init__(self, db: Database, lease_s: float = 60.0, max_attempts: int = 3, clock=time.time):
        self.db, self.lease_s, self.max_attempts, self.clock = db, lease_s, max_attempts, clock
        db.create_tables(META)

    def enqueue(self, domain: str, trigger: str, detail: dict | None = None) -> tuple[Job, bool]:
        """(the domain's open job, True if this call created it)."""
        now = self.clock()
        row = dict(id=uuid.uuid4().hex[:16], domain=domain, open_domain=domain, status="queued", trigger=trigger,
                   detail=json.dumps(detail or {}), created_at=now, updated_at=now, attempts=0, progress=0.0,
                   log=json.dumps([]))
        try:
            with self.db._write() as c:
                c.execute(JOBS.insert().values(**row))
            return self.get(row["id"]), True
        except IntegrityError:
            return self.open_job(domain), False

    def open_job(self, domain: str) -> Job | None:
        with self.db.engine.connect() as c:
            row = c.execute(select(JOBS).where(JOBS.c.open_domain == domain)).mappings().first()
        return _job(row) if row else None

    def get(self, job_id: str) -> Job | None:
        with self.db.engine.connect() as c:
            row = c.execute(select(JOBS).where(JOBS.c.id == job_id)).mappings().first()
        return _job(row) if row else None

    def list(self, domain: str | None = None, status: str | None = None, limit: int = 100) -> list[Job]:
        query = select(JOBS).order_by(JOBS.c.created_at.desc()).limit(limit)
        if domain is not None:
            query = query.where(JOBS.c.domain == domain)
        if status is not None:
            query = query.where(JOBS.c.status == status)
        with self.db.engine.connect() as c:
            return [_job(r) for r in c.execute(query).mappings().all()]

    def claim(self, worker: str) -> Job | None:
        """The oldest queued job, or a running one whose worker stopped renewing its lease; None if there is none.
        A job that has used up its attempts is marked failed instead of being handed out again."""
        while True:
            now = self.clock()
            with self.db._write() as c:
                row = c.execute(select(JOBS).where(or_(JOBS.c.status == "queued",
                                                       (JOBS.c.status == "running") & (JOBS.c.heartbeat < now - self.lease_s)))
                                .order_by(JOBS.c.created_at).limit(1).with_for_update()).mappings().first()
                if row is None:
                    return None
                lines = json.loads(row["log"])
                if row["attempts"] >= self.max_attempts:
                    lines.append(f"{_stamp(now)} gave up after {row['attempts']} attempts (worker lost each time)")
                    c.execute(update(JOBS).where(JOBS.c.id == row["id"]).values(
                        status="failed", open_domain=None, finished_at=now, updated_at=now, log=json.dumps(lines[-LOG_LINES:])))
                    continue
                resumed = row["status"] == "running"
                lines.append(f"{_stamp(now)} {'resumed' if resumed else 'started'} by {worker}"
                             + (f" (worker {row['worker']} stopped)" if resumed else ""))
                c.execute(update(JOBS).where(JOBS.c.id == row["id"]).values(
                    status="running", worker=worker, heartbeat=now, updated_at=now, attempts=row["attempts"] + 1,
                    started_at=row["started_at"] or now, log=json.dumps(lines[-LOG_LINES:])))
            return self.get(row["id"])

    def heartbeat(self, job_id: str, worker: str, progress: float | None = None, line: str | None = None) -> bool:
        """Renew the lease (and record progress / a log line); False if the job is no longer this worker's."""
        now = self.clock()
        with self.db._write() as c:
            row = c.execute(select(JOBS.c.worker, JOBS.c.status, JOBS.c.log).where(JOBS.c.id == job_id)).first()
            if row is None or row[0] != worker or row[1] != "running":
                return False
            values = dict(heartbeat=now, updated_at=now)
            if progress is not None:
                values["progress"] = float(progress)
            if line is not None:
                values["log"] = json.dumps((json.loads(row[2]) + [f"{_stamp(now)} {line}"])[-LOG_LINES:])
            c.execute(update(JOBS).where(JOBS.c.id == job_id).values(**values))
        return True

    def set_candidate(self, job_id: str, version: str) -> None:
        """The job's candidate is in the registry: a resumed job judges it instead of training another."""
        with self.db._write() as c:
            c.execute(update(JOBS).where(JOBS.c.id == job_id).values(candidate=version, updated_at=self.clock()))

    def finish(self, job_id: str, status: str, *, candidate: str | None = None, result: dict | None = None,
               line: str | None = None) -> Job:
        if status not in FINISHED:
            raise ValueError(f"a finished job's status is one of {FINISHED}")
        now = self.clock()
        with self.db._write() as c:
            lines = json.loads(c.execute(select(JOBS.c.log).where(JOBS.c.id == job_id)).scalar() or "[]")
            if line:
                lines.append(f"{_stamp(now)} {line}")
            values = dict(status=status, open_domain=None, finished_at=now, updated_at=now, candidate=candidate,
                          result=json.dumps(result) if result is not None else None, log=json.dumps(lines[-LOG_LINES:]))
            if status != "failed":
                values["progress"] = 1.0
            c.execute(update(JOBS).where(JOBS.c.id == job_id).values(**values))
        return self.get(job_id)


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
