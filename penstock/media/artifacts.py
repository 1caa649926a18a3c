"""Generated files, kept in a folder or behind any fsspec URL (``s3://``, ``memory://``...).

Calls block (they may go over the network): async callers run them in a thread.
"""

from __future__ import annotations

import posixpath
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from penstock.destinations import local_path
from penstock.errors import MediaStoreError

if TYPE_CHECKING:
    import fsspec

_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")


def _url_to_fs(location: str) -> tuple[fsspec.AbstractFileSystem, str]:
    # fsspec costs ~15 MB of memory: imported only by servers that keep media.
    import fsspec

    return fsspec.core.url_to_fs(location)


def _check_key(key: str) -> str:
    if not _KEY_RE.match(key) or ".." in key.split("/"):
        raise ValueError(f"invalid artifact key {key!r}")
    return key


def local_folder(location: str) -> Path | None:
    """The folder ``location`` names on this machine; None for a remote or in-memory store."""
    fs, root = _url_to_fs(local_path(location))
    return Path(root) if _is_local(fs) else None


def in_memory(location: str) -> bool:
    """Whether ``location`` names fsspec's in-memory store (gone when the process ends)."""
    fs, _ = _url_to_fs(location)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "memory" in protocols


def check_location(location: str) -> None:
    """Create a local store folder now, so a bad ``--media-store`` fails before a model
    loads, in one line; raises :class:`MediaStoreError` saying what is wrong."""
    try:
        folder = local_folder(location)
    except ImportError as exc:
        # fsspec names the package its protocol needs ("Install s3fs to access S3").
        raise MediaStoreError(f"--media-store {location}: {exc}") from exc
    except ValueError as exc:
        raise MediaStoreError(f"--media-store {location}: {exc}") from exc
    if folder is None:
        return
    if folder.exists() and not folder.is_dir():
        raise MediaStoreError(
            f"--media-store {location} is a file; name a folder (created if missing) "
            "or an fsspec URL"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MediaStoreError(
            f"--media-store {location}: cannot create the folder: {exc.strerror or exc}"
        ) from exc


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "file" in protocols


class ArtifactStore:
    """Bytes under keys like ``videos/<id>.mp4``, relative to ``location``."""

    def __init__(self, location: str) -> None:
        # fsspec keeps a file URL's escapes ('%20'); the folder is the decoded path.
        self.fs, self.root = _url_to_fs(local_path(location))
        self.fs.makedirs(self.root, exist_ok=True)

    @property
    def is_local(self) -> bool:
        return _is_local(self.fs)

    def _path(self, key: str) -> str:
        return posixpath.join(self.root, _check_key(key))

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` whole: readers see the old file, no file, or the new one."""
        path = self._path(key)
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        if not self.is_local:
            self.fs.pipe_file(path, data)
            return
        partial = f"{path}.{uuid.uuid4().hex}.partial"
        self.fs.pipe_file(partial, data)
        self.fs.mv(partial, path)

    def size(self, key: str) -> int | None:
        path = self._path(key)
        try:
            return int(self.fs.size(path))
        except FileNotFoundError:
            return None

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the artifact."""
        return bytes(self.fs.cat_file(self._path(key), start=start, end=end))

    def delete(self, key: str) -> None:
        path = self._path(key)
        if self.fs.exists(path):
            self.fs.rm_file(path)
