"""Files on the host: a file's sha256 checked to be a regular file's, writeback started behind the
writes, reads with a limit, the walk of a bundle folder. Atomic writes, temp names, fsync, the read
loop of every sha256 and the pool of hashing threads are builder.core's."""

# ruff: noqa: UP031
from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from typing import Any

from builder.core.digest import READ_SIZE, sha256_of

from .errors import InstallError


def human(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return ("%d %s" % (x, unit)) if unit == "B" else ("%.1f %s" % (x, unit))
        x /= 1024
    return "%d B" % n


#: bytes written to a file between two starts of its writeback (see Writeback)
WRITEBACK_STEP = 64 * 1024 * 1024


class Writeback:
    """Starts the disk writing a file's bytes while later ones are still being written, so the fsync
    at its end waits for the last step only: left alone, Linux holds gigabytes dirty until that fsync,
    and the disk idles while the bytes are read and hashed. posix_fadvise(DONTNEED) on the bytes
    written so far starts their writeback without waiting for it (and lets the kernel drop the pages
    once they are clean: they were hashed on the way in, nothing here reads them again). Where it
    does not exist, nothing is started early and the fsync does all of it."""

    def __init__(self, fd: int, offset: int = 0, end_only: bool = False) -> None:
        self.fd = fd
        self.end_only = end_only  # (then only start_rest, at the file's end, starts it)
        self.started = self.at = offset

    def wrote(self, n: int) -> None:
        self.at += n
        if not self.end_only and self.at - self.started >= WRITEBACK_STEP:
            self.start_rest()

    def start_rest(self) -> None:
        """Start the writeback of every byte written and not yet started (the end of a file)."""
        if self.at > self.started and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(self.fd, self.started, self.at - self.started, os.POSIX_FADV_DONTNEED)
        self.started = self.at


def write_all(fd: int, chunk: memoryview, wb: Writeback | None = None) -> None:
    """os.write until the whole chunk is written (a short write writes the rest)."""
    n = len(chunk)
    while chunk:
        chunk = chunk[os.write(fd, chunk) :]
    if wb is not None:
        wb.wrote(n)


def hash_file(path: str, on_bytes: Callable[[int], None] | None = None) -> tuple[str, int]:
    """sha256 and size of one regular file (anything else is refused)."""
    with open(path, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise InstallError("%s: not a regular file" % path)
        return sha256_of(f, READ_SIZE, on_bytes)


def read_limited(path: str, limit: int, what: str) -> bytes:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise InstallError("%s: missing" % what) from None
    if stat.S_ISLNK(st.st_mode):
        raise InstallError("%s: is a symbolic link (refused)" % what)
    if not stat.S_ISREG(st.st_mode):
        raise InstallError("%s: not a regular file (refused)" % what)
    if st.st_size > limit:
        raise InstallError("%s: too large (%s)" % (what, human(st.st_size)))
    with open(path, "rb") as f:
        return f.read(limit + 1)


def scan_tree(root: str) -> tuple[list[str], list[str]]:
    """(regular files, refused entries with why) under root, relative, '/'-separated; never follows links."""
    files: list[str] = []
    refused: list[str] = []

    def walk(d: str, rel: str) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            refused.append("%s (cannot list: %s)" % (rel or ".", e.strerror))
            return
        for ent in entries:
            r = rel + "/" + ent.name if rel else ent.name
            if ent.is_symlink():
                refused.append("%s (symbolic link)" % r)
            elif ent.is_dir(follow_symlinks=False):
                walk(ent.path, r)
            elif ent.is_file(follow_symlinks=False):
                files.append(r)
            else:
                refused.append("%s (not a regular file)" % r)

    walk(root, "")
    return files, refused


def inventory(d: str) -> dict[str, list[Any]]:
    """path -> [size, sha256] for every regular file under d (links and odd files are left out)."""
    if not os.path.isdir(d):
        return {}
    files, _ = scan_tree(d)
    out: dict[str, list[Any]] = {}
    for rel in files:
        digest, size = hash_file(os.path.join(d, rel))
        out[rel] = [size, digest]
    return out
