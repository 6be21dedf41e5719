"""A throwaway PostgreSQL server for tests: Debian's binaries (scripts/test.sh installs the package), a fresh cluster
in a temporary folder, on a free loopback port, stopped afterwards. As root the server runs as the `postgres` user
(initdb refuses root)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

from tests.servers import free_port


def postgres_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


@contextmanager
def postgres_server():
    """Yields a SQLAlchemy URL (postgresql+psycopg://…) of an empty database."""
    initdb, pg_ctl = postgres_bin("initdb"), postgres_bin("pg_ctl")
    if not initdb or not pg_ctl:
        raise RuntimeError("PostgreSQL server binaries not found: scripts/test.sh installs Debian's postgresql")
    root = Path(tempfile.mkdtemp(prefix="calm-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", free_port()
    run = lambda *argv: subprocess.run([*as_user, *argv], check=True, capture_output=True, text=True)  # noqa: E731
    run(initdb, "-D", str(data), "-A", "trust", "-U", "calm", "--no-sync", "-E", "UTF8")
    run(pg_ctl, "-D", str(data), "-w", "-l", str(root / "log"), "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100", "start")
    try:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={port} user=calm dbname=postgres", autocommit=True) as conn:
            conn.execute("CREATE DATABASE calm")
        yield f"postgresql+psycopg://calm@127.0.0.1:{port}/calm"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
