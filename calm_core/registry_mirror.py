"""The registry at a URL (`s3://bucket/prefix`, `gs://…`, any filesystem fsspec knows), for fleets whose machines share
no volume. Each process keeps a local folder of the versions it uses; the URL holds every version and the serving
list, and is where they are read from and written to.

A version is uploaded file by file, then its index (`<version>/calm-index.json`: every file's path and sha256) last:
object stores have no atomic rename, so the index is the commit mark, and a version without one does not exist for a
reader. A download takes every file the index lists into a folder beside the local one, checks each hash (a file
changed or cut short on the store is refused, never served), and swaps the folder in atomically. Version folders
never change once written, so a local copy is fetched once.
"""

from __future__ import annotations

import json
from pathlib import Path

from calm_core.artifact import check_version_name
from calm_core.atomic import atomic_dir
from calm_core.errors import CalmError
from calm_core.hashing import folder_index, sha256_file

INDEX_FILE = "calm-index.json"


class MirrorError(CalmError):
    """A registry URL that cannot be read or written, or a version whose copy there does not match its index."""


class RegistryMirror:
    def __init__(self, url: str):
        import fsspec  # only where a URL is configured: s3fs and its kin are optional

        try:
            # A filesystem of its own: fsspec's shared instance keeps the client (endpoint, credentials) it was first
            # made with, and a process may meet more than one store (the tests meet a new S3 endpoint per module).
            self.fs, self.base = fsspec.core.url_to_fs(url, skip_instance_cache=True)
        except (ImportError, ValueError) as e:
            raise MirrorError(f"registry URL {url!r}: {e} (s3:// needs `pip install s3fs`)") from None
        self.url = url
        self.base = self.base.rstrip("/")

    def _key(self, *parts: str) -> str:
        return "/".join([self.base, *parts])

    def _version(self, version: str) -> str:
        """A version names a folder here and on the store: one path component, never a path out of either."""
        try:
            return check_version_name(version)
        except ValueError as e:
            raise MirrorError(str(e)) from None

    def upload(self, version: str, folder: Path) -> None:
        """Every file of the version's folder, then its index; a version already there (indexed) is left alone."""
        if self.fs.exists(self._key(self._version(version), INDEX_FILE)):
            return
        index = folder_index(folder)
        for name in index:
            self.fs.put_file(str(folder / name), self._key(version, name))
        self.fs.pipe_file(self._key(version, INDEX_FILE), json.dumps({"files": index}).encode())

    def download(self, version: str, local_root: Path) -> Path | None:
        """The version's local folder, fetched and checked if it is not there yet; None when the URL has no such
        (complete) version."""
        target = local_root / self._version(version)
        if (target / INDEX_FILE).is_file() or (target / "manifest.json").is_file():
            return target  # fetched before, or registered from this folder
        try:
            index = json.loads(self.fs.cat_file(self._key(version, INDEX_FILE)))["files"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError) as e:
            raise MirrorError(f"{self.url}/{version}: unreadable index ({type(e).__name__}: {e})") from None
        with atomic_dir(target, keep_existing=True, durable=True) as tmp:
            for name, digest in index.items():
                path = tmp / name
                if ".." in Path(name).parts or Path(name).is_absolute():
                    raise MirrorError(f"{self.url}/{version}: index names a file outside the version ({name!r})")
                path.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(self._key(version, name), str(path))
                if sha256_file(path) != digest:
                    raise MirrorError(f"{self.url}/{version}/{name}: contents do not match the version's index "
                                      "(corrupt or edited on the store)")
            (tmp / INDEX_FILE).write_text(json.dumps({"files": index}))
        return target

    def write_text(self, name: str, text: str) -> None:
        """A small file at the root (one PUT: readers see the old object or the new one)."""
        self.fs.pipe_file(self._key(name), text.encode())

    def read_text(self, name: str) -> str | None:
        try:
            return self.fs.cat_file(self._key(name)).decode()
        except FileNotFoundError:
            return None
