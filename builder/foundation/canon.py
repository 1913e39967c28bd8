"""Canonical JSON, content addresses and atomic writes: the primitives every stage shares.

File hashing is builder.foundation.hashing's (``sha256_file``, and the pool every parallel hash uses).
``canonical_json`` and ``fsync_dir`` are builder.installer's (the host side is the bottom layer, and
writes the same JSON and syncs the same way).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from builder.foundation.hashing import sha256_file
from builder.installer.files import atomic_writer as host_atomic_writer
from builder.installer.files import fsync_dir as fsync_dir
from builder.installer.manifest import canonical_json as canonical_json


def pretty_json(obj: Any) -> bytes:
    """Stable, human-readable JSON (sorted, 2-space indent, trailing newline) for files people read."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def address(obj: Any) -> str:
    """Content address of a JSON-able object: sha256 of its canonical JSON."""
    return sha256_bytes(canonical_json(obj))


def sha256_tree(root: Path) -> str:
    """Hash of a directory tree: relative paths, modes (exec bit), link targets and file hashes.

    Independent of mtimes, owners and the filesystem's listing order.
    """
    entries: list[list[str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            full = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/")
            if os.path.islink(full):
                entries.append([rel, "link", os.readlink(full)])
            else:
                digest, _ = sha256_file(full)
                mode = "755" if os.access(full, os.X_OK) else "644"
                entries.append([rel, mode, digest])
    return address(sorted(entries))


def atomic_write(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Write a file so that readers see either the old bytes or the new, never a part."""
    with atomic_writer(path, mode) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: int = 0o644) -> Iterator[IO[bytes]]:
    """A file to stream into: a temp file beside `path` (``.NAME.*.tmp``, see clean_stale_tmp),
    fsynced and renamed over it on success (builder.installer.files.atomic_writer, the one copy).

    On any exception the temp file is removed and `path` keeps its old bytes.
    """
    with host_atomic_writer(path, mode, prefix=f".{Path(path).name}.", suffix=".tmp") as f:
        yield f


class ChunkReader(io.RawIOBase):
    """A readable raw file over an iterable of byte chunks (wrap in io.BufferedReader)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not len(self._buf):
            try:
                self._buf = memoryview(next(self._it))
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def clean_stale_tmp(path: str | os.PathLike[str]) -> int:
    """Remove `.NAME.*.tmp` files a killed atomic_write left beside `path`.

    Call it only while holding the lock that serialises writers of `path`.
    """
    p = Path(path)
    n = 0
    if p.parent.is_dir():
        for t in p.parent.glob(f".{p.name}.*.tmp"):
            with contextlib.suppress(OSError):
                t.unlink()
                n += 1
    return n


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive advisory lock (flock) held for the block; released if the process dies."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def attrs(obj: object, *names: str) -> dict[str, Any]:
    """``{name: obj.name}`` for the named attributes: the plain part of a report's JSON, in order."""
    return {n: getattr(obj, n) for n in names}
