"""The artifact registry: every artifact an immutable version in a folder (`<root>/<artifact_version>/`), its metadata
(lineage, metrics, status) and which version serves which domain in the database the gateway already uses.

Statuses: `candidate` (registered, not serving), `active` (serving at least one domain), `rejected` (failed its gate;
kept with the reason), `retired` (served once, replaced). One version is active per domain; a domain without one is
served by the global default (domain `*`). Every activation is kept in a history, so a rollback returns a domain to
the version it had before, and an operator can see who switched what when.

A version's folder is copied in atomically and durably (fsynced before its row is written): a reader never finds a row
without a complete folder, and a crash between the two leaves only an unlisted folder that the next registration of
that version reuses if it checks out, else copies again. Every file of a version is checked against the hashes its
manifest records whenever it is loaded (calm_core/artifact.py); an artifact written before the adapter's hashes were
recorded gets them recorded on the registry's copy.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from sqlalchemy import Column, Float, Integer, MetaData, String, Table, Text, delete, select, update

from calm_core.artifact import load_artifact, record_files
from calm_core.atomic import atomic_dir, atomic_write_text, make_dirs
from calm_core.db import Database
from calm_core.errors import ArtifactError, CalmError
from calm_core.registry_mirror import RegistryMirror

GLOBAL = "*"
# In the registry folder: the versions the gateways serve now, for engines that restart to load before taking traffic
# (adapters/vllm_plugins/warm.py); the database stays the truth, this is its copy where engines can read it.
SERVED_FILE = "serving.json"
STATUSES = ("candidate", "active", "rejected", "retired")
TRIGGERS = ("alert", "operator", "schedule", "import")

META = MetaData()
VERSIONS = Table("artifact_versions", META,
                 Column("version", String(128), primary_key=True),
                 Column("path", Text, nullable=False),
                 Column("status", String(16), nullable=False),
                 Column("domain", String(64)),  # the domain it was trained for (None: any)
                 Column("parent", String(128)),
                 Column("trigger", String(16), nullable=False),
                 Column("job_id", String(32)),
                 Column("training_sha256", String(64), nullable=False),
                 Column("calibration_sha256", String(64)),
                 Column("metrics", Text, nullable=False),
                 Column("reason", Text),
                 Column("created_at", Float, nullable=False))
ACTIVE = Table("active_versions", META,
               Column("domain", String(64), primary_key=True),
               Column("version", String(128), nullable=False),
               Column("since", Float, nullable=False))
ACTIVATIONS = Table("artifact_activations", META,
                    Column("seq", Integer, primary_key=True, autoincrement=True),
                    Column("domain", String(64), nullable=False, index=True),
                    Column("version", String(128)),  # None: the domain's own version was removed (default serves)
                    Column("previous", String(128)),
                    Column("action", String(16), nullable=False),  # promote | rollback
                    Column("actor", String(64), nullable=False),
                    Column("at", Float, nullable=False))


class RegistryError(CalmError):
    """An operation the registry refuses (unknown version, a rejected one promoted, nothing to roll back to)."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class VersionRecord:
    version: str
    path: str
    status: str
    domain: str | None
    parent: str | None
    trigger: str
    job_id: str | None
    training_sha256: str
    calibration_sha256: str | None
    metrics: dict
    reason: str | None
    created_at: float
    active_for: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {**asdict(self), "active_for": list(self.active_for)}


def training_data_sha256(manifest) -> str:
    """One hash over the manifest's training and calibration data references (names and content hashes)."""
    text = json.dumps(sorted((d.name, d.sha256) for d in manifest.training_data))
    return hashlib.sha256(text.encode()).hexdigest()


def read_served(root: str | Path) -> list[str]:
    """The versions of the registry folder's serving list ([] when there is none or it cannot be read)."""
    try:
        return served_versions((Path(root) / SERVED_FILE).read_text())
    except OSError:
        return []


def served_versions(text: str | None) -> list[str]:
    """The versions of a serving list's text ([] for none, or for text that is not one)."""
    try:
        versions = json.loads(text or "{}").get("versions", [])
    except (ValueError, AttributeError):
        return []
    return [v for v in versions if isinstance(v, str)]


class Registry:
    """`root`: this process's registry folder. `url`: where the registry lives when the fleet's machines share no
    volume (calm_core/registry_mirror.py): versions are uploaded there when added and fetched from there into `root`
    when first used, and the serving list is kept there too."""

    def __init__(self, db: Database, root: str | Path, url: str | None = None):
        self.db, self.root = db, Path(root)
        self.mirror = RegistryMirror(url) if url else None
        db.create_tables(META)

    def publish_served(self, versions: Iterable[str]) -> None:
        """Write the serving list: a new file renamed over the old one, so a reader sees one whole list or the other,
        fsynced, so that an engine restarting after a power loss loads what the gateways serve."""
        make_dirs(self.root)
        text = json.dumps({"versions": sorted(set(versions)), "at": time.time()})
        atomic_write_text(self.root / SERVED_FILE, text)
        if self.mirror is not None:
            self.mirror.write_text(SERVED_FILE, text)

    # -- reading --------------------------------------------------------------------------------------------------
    def active(self) -> dict[str, str]:
        """domain -> version, the global default under `*`."""
        with self.db.engine.connect() as c:
            return dict(c.execute(select(ACTIVE.c.domain, ACTIVE.c.version)).all())

    def serving(self, domain: str) -> str | None:
        active = self.active()
        return active.get(domain) or active.get(GLOBAL)

    def get(self, version: str) -> VersionRecord | None:
        found = self.list(version=version)
        return found[0] if found else None

    def list(self, domain: str | None = None, status: str | None = None, version: str | None = None) -> list[VersionRecord]:
        query = select(VERSIONS).order_by(VERSIONS.c.created_at.desc())
        if domain is not None:
            query = query.where(VERSIONS.c.domain == domain)
        if status is not None:
            query = query.where(VERSIONS.c.status == status)
        if version is not None:
            query = query.where(VERSIONS.c.version == version)
        with self.db.engine.connect() as c:
            rows = c.execute(query).mappings().all()
        serving: dict[str, list[str]] = {}
        for d, v in self.active().items():
            serving.setdefault(v, []).append(d)
        return [VersionRecord(**{**r, "metrics": json.loads(r["metrics"])}, active_for=tuple(sorted(serving.get(r["version"], []))))
                for r in rows]

    def history(self, domain: str | None = None, limit: int = 100) -> list[dict]:
        query = select(ACTIVATIONS).order_by(ACTIVATIONS.c.seq.desc()).limit(limit)
        if domain is not None:
            query = query.where(ACTIVATIONS.c.domain == domain)
        with self.db.engine.connect() as c:
            return [dict(r) for r in c.execute(query).mappings().all()]

    def path_of(self, version: str) -> Path:
        """The version's folder on this machine (fetched from the registry URL the first time, where there is one)."""
        record = self.get(version)
        if record is None:
            raise RegistryError(f"no artifact version {version!r} in the registry", 404)
        if self.mirror is None:
            return Path(record.path)
        fetched = self.mirror.download(version, self.root)  # this process's folder: the registering one's may not exist here
        if fetched is None:
            raise RegistryError(f"artifact version {version!r} is registered but missing at {self.mirror.url}", 404)
        return fetched

    # -- writing --------------------------------------------------------------------------------------------------
    def add(self, artifact_dir: str | Path, *, trigger: str, domain: str | None = None, parent: str | None = None,
            job_id: str | None = None, calibration_sha256: str | None = None, metrics: dict | None = None) -> VersionRecord:
        """Register an artifact as a candidate: verified, copied into the registry folder, then recorded. Registering
        the same version twice returns the existing record (idempotent, so a resumed job can repeat it)."""
        if trigger not in TRIGGERS:
            raise ValueError(f"trigger must be one of {TRIGGERS}")
        manifest = load_artifact(artifact_dir).manifest
        version = manifest.artifact_version
        existing = self.get(version)
        if existing is not None:
            return existing
        target = self.root / version  # one path component: the manifest's version name is checked on load
        try:
            load_artifact(target)  # an earlier registration's copy, its row never written
        except ArtifactError:
            with atomic_dir(target, durable=True) as tmp:
                shutil.copytree(artifact_dir, tmp, dirs_exist_ok=True)
                record_files(tmp)
            load_artifact(target)  # the copy verifies like the original
        if self.mirror is not None:  # before the row: a registered version is always there to fetch
            self.mirror.upload(version, target)
        row = dict(version=version, path=str(target.resolve()), status="candidate", domain=domain, parent=parent,
                   trigger=trigger, job_id=job_id, training_sha256=training_data_sha256(manifest),
                   calibration_sha256=calibration_sha256, metrics=json.dumps(metrics or {}), reason=None,
                   created_at=time.time())
        with self.db._write() as c:
            if c.execute(select(VERSIONS.c.version).where(VERSIONS.c.version == version)).first() is None:
                c.execute(VERSIONS.insert().values(**row))
        return self.get(version)

    def set_metrics(self, version: str, metrics: dict) -> None:
        with self.db._write() as c:
            c.execute(update(VERSIONS).where(VERSIONS.c.version == version).values(metrics=json.dumps(metrics)))

    def reject(self, version: str, reason: str) -> None:
        with self.db._write() as c:
            status = c.execute(select(VERSIONS.c.status).where(VERSIONS.c.version == version)).scalar()
            if status is None:
                raise RegistryError(f"no artifact version {version!r} in the registry", 404)
            if status == "active":
                raise RegistryError(f"version {version} is serving; roll it back before rejecting it")
            c.execute(update(VERSIONS).where(VERSIONS.c.version == version).values(status="rejected", reason=reason))

    def promote(self, version: str, domain: str = GLOBAL, actor: str = "operator") -> str | None:
        """Make `version` the one serving `domain`; returns the version it replaces there (None if none)."""
        with self.db._write() as c:
            status = c.execute(select(VERSIONS.c.status).where(VERSIONS.c.version == version).with_for_update()).scalar()
            if status is None:
                raise RegistryError(f"no artifact version {version!r} in the registry", 404)
            if status == "rejected":
                raise RegistryError(f"version {version} was rejected by its gate; it cannot be promoted")
            previous = c.execute(select(ACTIVE.c.version).where(ACTIVE.c.domain == domain).with_for_update()).scalar()
            if previous == version:
                return previous
            self._activate(c, domain, version, previous, "promote", actor)
            return previous

    def rollback(self, domain: str = GLOBAL, actor: str = "operator") -> str | None:
        """Return `domain` to the version it had before its current one (None: back to the global default)."""
        with self.db._write() as c:
            current = c.execute(select(ACTIVE.c.version).where(ACTIVE.c.domain == domain).with_for_update()).scalar()
            if current is None:
                raise RegistryError(f"domain {domain!r} has no version of its own to roll back", 404)
            last = c.execute(select(ACTIVATIONS.c.previous).where(ACTIVATIONS.c.domain == domain,
                                                                   ACTIVATIONS.c.version == current,
                                                                   ACTIVATIONS.c.action == "promote")
                             .order_by(ACTIVATIONS.c.seq.desc()).limit(1)).first()
            target = last[0] if last else None
            if target is None and domain == GLOBAL:
                raise RegistryError("the global default has no earlier version to roll back to")
            self._activate(c, domain, target, current, "rollback", actor)
            return target

    @staticmethod
    def _activate(c, domain: str, version: str | None, previous: str | None, action: str, actor: str) -> None:
        now = time.time()
        c.execute(delete(ACTIVE).where(ACTIVE.c.domain == domain))
        if version is not None:
            c.execute(ACTIVE.insert().values(domain=domain, version=version, since=now))
            c.execute(update(VERSIONS).where(VERSIONS.c.version == version).values(status="active"))
        if previous is not None and previous != version:
            still = c.execute(select(ACTIVE.c.domain).where(ACTIVE.c.version == previous)).first()
            if still is None:
                c.execute(update(VERSIONS).where(VERSIONS.c.version == previous).values(status="retired"))
        c.execute(ACTIVATIONS.insert().values(domain=domain, version=version, previous=previous, action=action,
                                              actor=actor, at=now))

    def ensure_default(self, artifact_dir: str | Path) -> str:
        """The configured artifact becomes the global default the first time it is seen (a new CALM_ARTIFACT takes
        over); after that the registry's activations stand, so a rollback or promotion survives restarts."""
        manifest = load_artifact(artifact_dir).manifest
        record = self.get(manifest.artifact_version)
        if record is None:
            self.add(artifact_dir, trigger="import")
        seen = any(h["version"] == manifest.artifact_version and h["domain"] == GLOBAL for h in self.history(GLOBAL, 1000))
        if not seen:
            self.promote(manifest.artifact_version, GLOBAL, "import")
        return self.active()[GLOBAL]
