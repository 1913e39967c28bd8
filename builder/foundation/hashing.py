"""Hashing files at the machine's limit: one file's sha256, many files' at once, a recipe folder's.

Several files are hashed at once on a thread pool. hashlib hands large updates to OpenSSL with the GIL
released, so N threads use N cores. Each file is read with ``readinto`` into one reusable buffer per
thread (no allocation per read, no copy into a bytes object), in large reads (:data:`READ_SIZE`)
rather than the 8 KiB BIO chunks of ``openssl dgst`` (docs/benchmarks.md has the figures).

:func:`stamp` is what fast mode compares instead of reading a file: its size, mtime (ns) and inode, as
recorded when its bytes were last hashed in full; whether a stamp still vouches for the bytes is
fast mode's one rule (``builder.core.fastmode.fast_mode_drift``, which hosts run too).

Every pool of hashing threads in builder is :func:`in_parallel`, and every file is hashed by
:func:`sha256_file`'s read loop (builder.core.digest's, the one copy of each: the installer runs
them too, and they are re-exported here).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from builder.core.digest import READ_SIZE as READ_SIZE
from builder.core.digest import default_workers as default_workers
from builder.core.digest import in_parallel as in_parallel
from builder.core.digest import sha256_file as sha256_file
from builder.errors import ConfigError, ResolveError


def size_or_zero(path: str | os.PathLike[str]) -> int:
    """A file's size for ordering work (0 when it cannot be stat'ed: the hash will say why)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def copy_hashed(src: IO[bytes], out: IO[bytes], read_size: int = READ_SIZE) -> tuple[str, int]:
    """Copy ``src`` to its end into ``out``, hashing on the way; ``out`` is flushed and fsynced.
    Returns (sha256 hex, size) of what was written."""
    h = hashlib.sha256()
    size = 0
    while chunk := src.read(read_size):
        h.update(chunk)
        out.write(chunk)
        size += len(chunk)
    out.flush()
    os.fsync(out.fileno())
    return h.hexdigest(), size


#: a progress callback for hashing a pin's local files (a model's, a kit's): (its name in the pins,
#: its bytes in all, bytes just hashed); called once with 0 bytes before the first, from the caller's
#: thread, then from the hashers'
HashProgress = Callable[[str, int, int], None]


def hash_folder_files(folder: Path, paths: list[str], *, where: str, workers: int | None = None,
                      progress: HashProgress | None = None) -> list[tuple[str, str, int]]:
    """(path, sha256, size) for each path, hashed in parallel (hashlib releases the GIL)."""
    on_bytes: Callable[[int], None] | None = None
    if progress is not None:
        total = sum(size_or_zero(folder / rel) for rel in paths)
        progress(where, total, 0)

        def on_bytes(n: int) -> None:
            progress(where, total, n)

    def one(rel: str) -> tuple[str, str, int]:
        try:
            digest, size = sha256_file(folder / rel, on_bytes=on_bytes)
        except FileNotFoundError:
            raise ResolveError(f"{where}: file vanished: {rel} (in {folder})") from None
        except OSError as e:
            raise ResolveError(f"{where}: cannot read {rel} (in {folder}): {e.strerror}") from None
        return rel, digest, size

    return in_parallel(one, paths, size=lambda rel: size_or_zero(folder / rel), workers=workers)


def recipe_files(root: Path, recipe: str) -> dict[str, str]:
    """sha256 of every file in a recipe folder, by path relative to the project."""
    base = root / recipe
    if not base.is_dir():
        raise ConfigError(f"{recipe}: recipe folder not found")
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames.sort()
        for fn in sorted(filenames):
            full = Path(dirpath) / fn
            rel = full.relative_to(root).as_posix()
            out[rel] = sha256_file(full)[0]
    return out


def stamp(path: str | os.PathLike[str]) -> dict[str, int]:
    """What fast mode compares: {size, mtime (ns), inode}, the apply record's keys for a model file."""
    st = os.stat(path)
    return {"size": st.st_size, "mtime": st.st_mtime_ns, "inode": st.st_ino}
