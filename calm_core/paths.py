"""Where things live: the cache ($CALM_HOME), the benchmark data, and files shipped inside the package."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
BUNDLED_DIR = PACKAGE_DIR / "bundled"
BUNDLED_DATA_DIR = BUNDLED_DIR / "data"
REPO_ROOT = PACKAGE_DIR.parent


def calm_home() -> Path:
    """Cache for converted models and artifacts; `$CALM_HOME`, else `~/.cache/calm`."""
    env = os.environ.get("CALM_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "calm"


def data_dir() -> Path:
    """Benchmark JSONL root: `$CALM_DATA_DIR`, else the checkout's `../shared/data`, else the bundled subset.

    The bundled subset is small and ships with the package so that the main job runs on a fresh machine.
    """
    env = os.environ.get("CALM_DATA_DIR")
    if env:
        return Path(env).expanduser()
    shared = REPO_ROOT.parent / "shared" / "data"
    if shared.is_dir():
        return shared
    return BUNDLED_DATA_DIR
