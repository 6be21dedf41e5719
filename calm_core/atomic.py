"""Writing a folder or a file atomically: build it beside the target, then swap it in; readers never see half of it.
Durable writes also reach the disk before they count: every file and folder is fsynced before the rename that makes
them visible, and the parent folder after it (the rename is an entry of the parent), so a power loss leaves the old
version or the whole new one, never a listed name whose contents were still in the page cache."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(target: str | Path, keep_existing: bool = False, durable: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder next to `target`; on success it replaces `target` (an old one is swapped
    out, then removed), on error it is deleted and `target` is left as it was. `keep_existing` is for caches whose
    content is fixed by their name (merged weights): when another process wrote `target` meanwhile, its copy stays
    (an engine may be reading it) and this one is dropped. `durable`: fsynced (module docstring); caches, checked
    against their index when used and rebuilt when lost, skip it."""
    target = Path(target)
    make_dirs(target.parent, durable)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        _make_readable(tmp)  # mkdtemp makes it private; engines and workers may run as other users
        if durable:
            _sync_tree(tmp)
        if target.exists() and keep_existing:
            shutil.rmtree(tmp, ignore_errors=True)
        elif target.exists():
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        if durable:
            fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace a file with `text`, durably: a new file fsynced, renamed over the old one, the folder fsynced; a reader
    sees the whole old file or the whole new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def make_dirs(folder: str | Path, durable: bool = True) -> None:
    """`folder` and its missing parents; `durable`: each new one's entry fsynced in its parent, since a folder created
    on a fresh volume and lost to a power cut takes everything renamed into it along."""
    missing, p = [], Path(folder)
    while not p.exists():
        missing.append(p)
        p = p.parent
    for new in reversed(missing):
        new.mkdir(exist_ok=True)
        if durable:
            fsync_dir(new.parent)


def fsync_dir(folder: str | Path) -> None:
    """A folder's entries (names created, renamed or removed in it) to disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        elif p.is_dir():
            fsync_dir(p)
    fsync_dir(folder)


def _make_readable(folder: Path) -> None:
    folder.chmod(0o755)
    for p in folder.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
