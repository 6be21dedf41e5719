"""Starting real servers for end-to-end tests: subprocesses on free loopback ports, logs kept for failures."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(argv: list[str], health_url: str, log_path: Path, env: dict | None = None, timeout: float = 240.0):
    """Start a process, wait until `health_url` answers 200, yield it, then stop it (SIGTERM, then SIGKILL)."""
    with background(argv, log_path, env) as proc:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[:3]} exited with {proc.returncode}; log:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{health_url} not healthy after {timeout}s; log:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield proc


def calm_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "calm_cli", *args]


@contextmanager
def background(argv: list[str], log_path: Path, env: dict | None = None):
    """Start a process, yield it, then stop it with its whole process group (SIGTERM, then SIGKILL after 30 s)."""
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
