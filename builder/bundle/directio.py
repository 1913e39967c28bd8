"""Writing a part file with O_DIRECT where the file system takes it, buffered where it does not.

Bundle parts are written once and not read back by this process, so the page cache only costs:
direct writes skip the copy into it, the dirty-page throttling and the writeback (see
docs/benchmarks.md for the figures). The bytes on disk are the same either way; fsync still follows
(the device cache, the metadata). O_DIRECT needs the buffer, the file offset and the length aligned
to ALIGN; anything else, or a file system that refuses a direct write, switches that file to
buffered writes for the rest of it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


def open_part(path: Path) -> tuple[int, bool]:
    """(fd, direct): a new part file, opened with O_DIRECT where the file system takes it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    if O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, 0o644), True
        except OSError:
            pass  # tmpfs and some others refuse O_DIRECT
    return os.open(path, flags, 0o644), False


def to_buffered(fd: int) -> None:
    """Clear O_DIRECT on an open file: the next writes go through the page cache."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)


def write_all(fd: int, view: memoryview, offset: int, direct: bool) -> bool:
    """Write view at the file's current offset (``offset``); returns whether the fd is still O_DIRECT.

    An unaligned offset or length (a part's tail, a pipe's short read) switches the file to buffered
    writes first; a direct write the file system refuses is retried buffered.
    """
    if direct and (offset % ALIGN or len(view) % ALIGN):
        to_buffered(fd)
        direct = False
    while view:
        try:
            n = os.write(fd, view)
        except OSError:
            if not direct:
                raise
            to_buffered(fd)
            direct = False
            continue
        view = view[n:]
    return direct


def sync_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
