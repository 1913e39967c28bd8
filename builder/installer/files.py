"""Files on the host: atomic writes, fsync, sha256 of a file, writeback started behind the writes,
and the one pool of hashing threads (builder.foundation.hashing and builder.foundation.canon use these
same functions)."""

# ruff: noqa: UP031
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, TypeVar

from .errors import InstallError

T = TypeVar("T")
R = TypeVar("R")

#: Read size for hashing. Large reads keep OpenSSL in its multi-block path and cut syscalls; 4 MiB
#: keeps a thread's buffer small enough that a full pool stays far under the memory target.
READ_SIZE = 4 * 1024 * 1024
#: how every temp name on a host's root starts (Root.clean_temps removes what a killed run left)
TMP_PREFIX = ".tmp-"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder (its entries); a file system that cannot is let be."""
    with contextlib.suppress(OSError):
        fsync_file(path)


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_stem(path: str) -> str:
    """Start of the temp names atomic_write uses beside path (.tmp-builder-NAME.)."""
    return "%sbuilder-%s." % (TMP_PREFIX, os.path.basename(path))


def atomic_write(path: str | os.PathLike[str], data: bytes | Iterable[bytes | memoryview], mode: int = 0o644) -> None:
    """Write data (bytes, or an iterable of chunks) to path via a temp name beside it, then rename."""
    with atomic_writer(path, mode) as f:
        for chunk in [data] if isinstance(data, bytes) else data:
            f.write(chunk)


@contextlib.contextmanager
def atomic_writer(
    path: str | os.PathLike[str], mode: int = 0o644, *, prefix: str | None = None, suffix: str = ""
) -> Iterator[IO[bytes]]:
    """A file to stream into: a temp name beside ``path`` (``prefix`` and ``suffix`` around its
    process id and a random part; tmp_stem(path) by default), fsynced and renamed over ``path`` on
    success. On any exception the temp is removed and ``path`` keeps its old bytes."""
    path = os.fspath(path)
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    start = tmp_stem(path) if prefix is None else prefix
    tmp = os.path.join(d, "%s%d.%s%s" % (start, os.getpid(), secrets.token_hex(4), suffix))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(d)


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


def _sha256_of(f: io.FileIO, read_size: int, on_bytes: Callable[[int], None] | None) -> tuple[str, int]:
    """(sha256 hex, size) of what is left to read of f: readinto one reusable buffer (no allocation
    per read), hashed through a memoryview; ``on_bytes`` (progress) is told each read's size."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(read_size)
    view = memoryview(buf)
    while True:
        n = f.readinto(buf)
        if not n:
            break
        # hashlib releases the GIL for updates over 2 KiB: other threads hash meanwhile.
        h.update(view[:n])
        size += n
        if on_bytes is not None:
            on_bytes(n)
    return h.hexdigest(), size


def hash_file(path: str, on_bytes: Callable[[int], None] | None = None) -> tuple[str, int]:
    """sha256 and size of one regular file (anything else is refused)."""
    with open(path, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise InstallError("%s: not a regular file" % path)
        return _sha256_of(f, READ_SIZE, on_bytes)


def sha256_file(
    path: str | os.PathLike[str], read_size: int = READ_SIZE, on_bytes: Callable[[int], None] | None = None
) -> tuple[str, int]:
    """(sha256 hex, size) of one file, told to the kernel as read front to back (builder.foundation.hashing's:
    the operator's stores and bundles)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        # Tell the kernel we read front to back: it doubles readahead on a cold cache; no cost warm.
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with open(fd, "rb", buffering=0, closefd=False) as f:
            return _sha256_of(f, read_size, on_bytes)
    finally:
        os.close(fd)


def default_workers() -> int:
    """One thread per usable core (at least 1, at most 16: past that the disk, not the CPU, limits)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(16, n))


def in_parallel(
    fn: Callable[[T], R], items: Sequence[T], *, size: Callable[[T], int] | None = None, workers: int | None = None
) -> list[R]:
    """``fn`` over ``items`` on one pool of hashing threads; the results in the items' order.

    At most :func:`default_workers` threads, never more than items (one item: no thread at all).
    With ``size``, the largest items start first, so one big file started last does not leave the
    other threads idle at the end. hashlib releases the GIL for large updates: N threads use N cores.
    An exception from ``fn`` propagates (the first in the order the items started); callers that
    must name the first bad item in their own order return problems as values instead.
    """
    n = min(workers or default_workers(), len(items))
    order = sorted(range(len(items)), key=lambda i: size(items[i]), reverse=True) if size else range(len(items))
    if n <= 1:
        done = {i: fn(items[i]) for i in order}
    else:
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="sha256") as ex:
            done = dict(ex.map(lambda i: (i, fn(items[i])), order))
    return [done[i] for i in range(len(items))]


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
