"""Canonical JSON, content addresses and atomic writes: the primitives every stage shares.

File hashing is builder.foundation.hashing's (``sha256_file``, and the pool every parallel hash uses).
Canonical JSON, atomic writes, the move of a finished folder into place, fsync and the temps' cleaner
are builder.core's, re-exported here: the installer runs the same functions on hosts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from builder.core.atomic import atomic_write as atomic_write
from builder.core.atomic import atomic_writer as atomic_writer
from builder.core.atomic import clean_stale_tmp as clean_stale_tmp
from builder.core.atomic import fsync_dir as fsync_dir
from builder.core.atomic import replace_folder as replace_folder
from builder.core.canonjson import canonical_json as canonical_json
from builder.foundation.hashing import sha256_file


def pretty_json(obj: Any) -> bytes:
    """Stable, human-readable JSON (sorted, 2-space indent, trailing newline) for files people read."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def address(obj: Any) -> str:
    """Content address of a JSON-able object: sha256 of its canonical JSON."""
    return sha256_bytes(canonical_json(obj))


def sha256_tree(root: Path) -> str:
    """Hash of a directory tree: relative paths, modes (exec bit: any of the file's x bits), link targets
    and file hashes.

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
                # the file's own mode bits, any x bit: os.access would answer for this user and this
                # mount (root, or noexec), and the same tree would hash otherwise elsewhere
                mode = "755" if os.lstat(full).st_mode & 0o111 else "644"
                entries.append([rel, mode, digest])
    return address(sorted(entries))


@contextlib.contextmanager
def run_folder(prefix: str, parent: Path | None = None) -> Iterator[Path]:
    """A temporary folder of this run, ``PREFIX<pid>-…`` in ``parent`` (the system's temporary folder by
    default), removed when the block ends, however it ends. Its name carries the pid so that what a
    killed run left is known: those of this prefix whose process is gone are removed first."""
    base = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    remove_dead_runs(prefix, base)
    d = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def remove_dead_runs(prefix: str, base: Path) -> list[Path]:
    """Remove the ``PREFIX<pid>-…`` folders in ``base`` (this user's) whose process is gone; return them."""
    gone: list[Path] = []
    with contextlib.suppress(OSError):
        for p in base.glob(f"{prefix}*"):
            pid = p.name[len(prefix):].split("-", 1)[0]
            if not pid.isdigit() or pid_alive(int(pid)):
                continue
            with contextlib.suppress(OSError):
                st = p.lstat()
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                    shutil.rmtree(p, ignore_errors=True)
                    gone.append(p)
    return gone


def pid_alive(pid: int) -> bool:
    """Whether a process of that pid exists (one of another user's counts: it may be the writer)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive advisory lock (flock) held for the block; released if the process dies.

    The lock held is always the one on the file at ``path``: a file removed while this waited for it
    (`builder gc` removes a push lock nobody holds, holding it itself meanwhile) is let go and ``path``
    opened again, so two processes never each hold a different file of one name.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:
            # another user's lock in a shared folder (flock needs no write access); a sticky folder
            # refuses O_CREAT on it even where its mode allows writing (fs.protected_regular)
            fd = os.open(p, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                now = os.stat(p)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            break
        os.close(fd)  # (removed or replaced while we waited: not the lock any more)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def attrs(obj: object, *names: str) -> dict[str, Any]:
    """``{name: obj.name}`` for the named attributes: the plain part of a report's JSON, in order."""
    return {n: getattr(obj, n) for n in names}
