"""Content hashes used in manifests: files, folders of weights, tokenizer vocabularies, and the index of a folder whose
files are checked before use (a registered version's, a cached copy of weights)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

_CHUNK = 1 << 20
# Files hashed by this process: (path, inode, size, mtime) -> sha256. Checked files are never edited in place (a new
# version or cache is a new folder swapped in, so a new inode), and a gateway loads a version's files on every switch.
_HASHED: dict[tuple, str] = {}


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_file_once(path: str | Path) -> str:
    """sha256_file, computed once per process for a file that has not changed since (same inode, size and mtime)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        _HASHED[key] = sha256_file(path)
    return _HASHED[key]


def folder_index(folder: str | Path) -> dict[str, str]:
    """Every file under `folder`: its path there (with '/') -> sha256."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def index_mismatch(folder: str | Path, index: Mapping[str, str]) -> str | None:
    """The first file of `index` that `folder` does not hold as recorded ("NAME (missing)", "NAME (contents differ)",
    "NAME (outside the folder)"); None when every one matches. Each file hashed once per process (sha256_file_once)."""
    for name, digest in index.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{name} (outside the folder)"
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} (missing)"
        if sha256_file_once(path) != digest:
            return f"{name} (contents differ)"
    return None


def sha256_files(paths: Iterable[Path]) -> str:
    """One hash over several files, independent of where they lie: names (not folders) and contents, sorted."""
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: p.name):
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def weights_sha256(model_dir: str | Path) -> str:
    """Hash of a model folder's weight files (safetensors, else bin)."""
    folder = Path(model_dir)
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    return sha256_files(files)


def vocab_sha256(vocab: Mapping[str, int]) -> str:
    """Hash of a tokenizer's token->id map; stable across tokenizer file formats."""
    canonical = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()
