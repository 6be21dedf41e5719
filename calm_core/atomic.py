"""Writing a folder atomically: build it beside the target, then swap it in; readers never see half of it."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(target: str | Path, keep_existing: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder next to `target`; on success it replaces `target` (an old one is swapped
    out, then removed), on error it is deleted and `target` is left as it was. `keep_existing` is for caches whose
    content is fixed by their name (merged weights): when another process wrote `target` meanwhile, its copy stays
    (an engine may be reading it) and this one is dropped."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        _make_readable(tmp)  # mkdtemp makes it private; engines and workers may run as other users
        if target.exists() and keep_existing:
            shutil.rmtree(tmp, ignore_errors=True)
        elif target.exists():
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _make_readable(folder: Path) -> None:
    folder.chmod(0o755)
    for p in folder.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
