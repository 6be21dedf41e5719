"""Content hashes used in manifests: files, folders of weights, tokenizer vocabularies."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


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
