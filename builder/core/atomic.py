"""Files and folders changed whole: atomic writes, the move of a finished folder into place, fsync, and
the one temp-naming scheme with its one cleaner.

Temp names: whatever stands in for a path beside it (a file being written, a folder being filled, the
old folder moved aside) is named :func:`tmp_stem` (``.tmp-builder-NAME.``), then a tag, this process's
id and a random part (:func:`tmp_name`). The leading ``.tmp-`` keeps it hidden and lets one sweep of a
folder find every temp there (:func:`remove_temps`: the installer's root); the path's name after it
lets the temps of one path be found alone (:func:`clean_stale_tmp`), so a folder shared with other
files is cleaned of nothing else. A killed run leaves only such names, never a part under the path.
builder.hostscripts.derive, sent to hosts as one source text, cannot import this module and names
its temps by the same rule itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from typing import IO

#: how every temp name starts (a folder's sweep removes what starts so)
TMP_PREFIX = ".tmp-"
#: how many times replace_folder moves another process's folder aside before it gives up
_REPLACE_TRIES = 50


def tmp_stem(path: str | os.PathLike[str]) -> str:
    """The start of every temp name that stands in for ``path`` beside it: ``.tmp-builder-NAME.``."""
    return f"{TMP_PREFIX}builder-{os.path.basename(os.fspath(path))}."


def tmp_name(path: str | os.PathLike[str], tag: str = "") -> str:
    """A fresh temp path beside ``path``: its stem, ``tag`` (what it is for: ``old-`` for a folder
    moved aside), this process's id and a random part, so no two writers ever share one."""
    path = os.fspath(path)
    return os.path.join(os.path.dirname(path), f"{tmp_stem(path)}{tag}{os.getpid()}.{secrets.token_hex(4)}")


def remove_temps(folder: str | os.PathLike[str], start: str = TMP_PREFIX, keep: str | None = None) -> int:
    """Remove what killed runs left in ``folder``: each entry whose name starts with ``start`` (every
    temp name by default), files, links and folders alike, except the one named ``keep``; how many.
    Call it only where no live writer can be using such a name (under the lock of what they stand in
    for), since a temp being written looks the same as one left behind."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    n = 0
    for name in names:
        if not name.startswith(start) or name == keep:
            continue
        p = os.path.join(folder, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(p)
        n += 1
    return n


def clean_stale_tmp(path: str | os.PathLike[str], keep: str | None = None) -> int:
    """Remove the temps a killed run left for ``path`` beside it (those of :func:`tmp_stem`), except
    the one named ``keep``; how many. Only while holding what serialises the writers of ``path``."""
    path = os.fspath(path)
    return remove_temps(os.path.dirname(path) or ".", tmp_stem(path), keep)


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a folder (its entries); a file system that cannot is let be."""
    with contextlib.suppress(OSError):
        fsync_file(path)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: int = 0o644) -> Iterator[IO[bytes]]:
    """A file to stream into: a temp name beside ``path`` (:func:`tmp_name`), fsynced and renamed over
    ``path`` on success. On any exception the temp is removed and ``path`` keeps its old bytes."""
    path = os.fspath(path)
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    tmp = tmp_name(path)
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


def atomic_write(path: str | os.PathLike[str], data: bytes | Iterable[bytes | memoryview], mode: int = 0o644) -> None:
    """Write ``data`` (bytes, or an iterable of chunks) so that readers see either the old bytes or the
    new, never a part: through :func:`atomic_writer`."""
    with atomic_writer(path, mode) as f:
        for chunk in [data] if isinstance(data, bytes) else data:
            f.write(chunk)


def replace_folder(new: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """Put the finished folder ``new`` at ``dest`` (on one filesystem), the one way builder does it.

    What is at ``dest`` (a folder, a file or a link) is renamed aside and kept until ``new`` is in place,
    then removed; if ``new`` cannot go in, the old one is put back and the error raised. Two processes
    may do this to one ``dest`` at once: one whose rename meets the other's folder arriving in between
    (ENOTEMPTY, EEXIST) moves that aside too and tries again, so each ends with a whole folder at
    ``dest``, the last one's. ``dest`` lacks a folder only between two renames. The aside is a temp
    name of ``dest`` (:func:`tmp_name`, tag ``old-``): what a killed run leaves, removed by whoever
    cleans the temps of ``dest``.
    """
    new, dest = os.fspath(new), os.fspath(dest)
    asides: list[str] = []
    try:
        for _ in range(_REPLACE_TRIES):
            if os.path.lexists(dest):
                aside = tmp_name(dest, "old-")
                try:
                    os.rename(dest, aside)
                    asides.append(aside)
                except FileNotFoundError:
                    pass  # another process moved it aside first
            try:
                os.rename(new, dest)
                break
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        else:
            raise OSError(errno.ENOTEMPTY, f"other processes kept putting a folder at {dest}")
        fsync_dir(os.path.dirname(dest) or ".")
    except BaseException:
        if asides and not os.path.lexists(dest):  # the newest old one back: never lost for a failed rename
            with contextlib.suppress(OSError):
                os.rename(asides[-1], dest)
                asides.pop()
        raise
    finally:
        for a in asides:
            if os.path.isdir(a) and not os.path.islink(a):
                shutil.rmtree(a, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(a)
