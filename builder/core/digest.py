"""A file's sha256 at the machine's limit, and the one pool of hashing threads.

Every file builder hashes, on a host or on the operator's machine, goes through :func:`sha256_of`'s
read loop; every pool of hashing threads is :func:`in_parallel`. hashlib hands large updates to
OpenSSL with the GIL released, so N threads use N cores.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: Read size for hashing. Large reads keep OpenSSL in its multi-block path and cut syscalls; 4 MiB
#: keeps a thread's buffer small enough that a full pool stays far under the memory target.
READ_SIZE = 4 * 1024 * 1024


def sha256_of(
    f: io.FileIO, read_size: int = READ_SIZE, on_bytes: Callable[[int], None] | None = None
) -> tuple[str, int]:
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


def sha256_file(
    path: str | os.PathLike[str], read_size: int = READ_SIZE, on_bytes: Callable[[int], None] | None = None
) -> tuple[str, int]:
    """(sha256 hex, size) of one file, told to the kernel as read front to back."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        # Tell the kernel we read front to back: it doubles readahead on a cold cache; no cost warm.
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with open(fd, "rb", buffering=0, closefd=False) as f:
            return sha256_of(f, read_size, on_bytes)
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
