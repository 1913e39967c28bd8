"""Verify a folder of files against expected (path, size, sha256), at the machine's limit.

Two modes:

``full``
    Every file's size is compared first (a mismatch is reported without reading a byte); then the
    files that remain are hashed with sha256, several files at once on a thread pool. hashlib hands
    large updates to OpenSSL with the GIL released, so N threads use N cores. Each file is read with
    ``readinto`` into one reusable buffer per thread (no allocation per read, no copy into a bytes
    object), in large reads (:data:`READ_SIZE`) rather than the 8 KiB BIO chunks of ``openssl dgst``
    (docs/benchmarks.md has the figures).

``fast``
    Size, mtime (ns) and inode of each file against the record an install wrote when it last
    verified the file in full (the apply record's ``models`` list), by the host side's one rule
    (``builder.installer.record.fast_mode_drift``). Nothing is read. **This trusts the file system**: a file
    replaced by a copy (new inode), truncated, or rewritten without care for its mtime is caught; an
    in-place edit of the same size whose mtime was put back (``touch -d``, a tool that preserves
    times, bit rot, a raw write to the block device) is NOT. Full mode is what catches those; run it
    after anything you do not trust.

Every pool of hashing threads in builder is :func:`in_parallel`, and every file is hashed by
:func:`sha256_file`'s read loop (builder.installer.files's, the one copy of each: the host side runs
them too).

Entries may be :class:`Entry` objects, ``(path, size, sha256)`` tuples or dicts with those keys
(the lock's and the manifest's shapes). Paths are relative to ``root`` unless absolute.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from builder.errors import ConfigError, ResolveError
from builder.installer.files import READ_SIZE as READ_SIZE
from builder.installer.files import default_workers as default_workers
from builder.installer.files import in_parallel
from builder.installer.files import sha256_file as sha256_file
from builder.installer.record import fast_mode_drift

Mode = Literal["full", "fast"]


@dataclass(frozen=True)
class Entry:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Problem:
    """One file that does not match. ``kind``: missing, not-a-file, size, sha256, unreadable,
    replaced (inode), modified (mtime), no-record."""

    path: str
    kind: str
    expected: str
    found: str

    def __str__(self) -> str:
        return f"{self.path}: {self.kind}: expected {self.expected}, found {self.found}"


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


def hash_files(
    paths: Iterable[str | os.PathLike[str]], workers: int | None = None
) -> dict[str, tuple[str, int]]:
    """{path: (sha256 hex, size)} for many files, hashed in parallel. OSError propagates."""
    items = [os.fspath(p) for p in paths]
    return dict(zip(items, in_parallel(sha256_file, items, size=size_or_zero, workers=workers), strict=True))


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


def _entry(e: Entry | Sequence[Any] | Mapping[str, Any]) -> Entry:
    if isinstance(e, Entry):
        return e
    if isinstance(e, Mapping):
        return Entry(str(e["path"]), int(e["size"]), str(e["sha256"]))
    path, size, digest = e
    return Entry(str(path), int(size), str(digest))


def _full_path(root: str | os.PathLike[str] | None, path: str) -> str:
    if root is None or os.path.isabs(path):
        return path
    return os.path.join(os.fspath(root), path)


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


def _record_map(record: Any) -> dict[str, Mapping[str, Any]]:
    """Accept an apply record (dict with "models"), a list of {path, sha256, size, mtime, inode}, or a
    mapping path -> {sha256, size, mtime, inode}."""
    if record is None:
        return {}
    if isinstance(record, Mapping) and isinstance(record.get("models"), list):
        record = record["models"]
    if isinstance(record, Mapping):
        return {str(k): v for k, v in record.items() if isinstance(v, Mapping)}
    out: dict[str, Mapping[str, Any]] = {}
    for r in record:
        if isinstance(r, Mapping) and "path" in r:
            out[str(r["path"])] = r
    return out


def verify_files(
    entries: Iterable[Entry | Sequence[Any] | Mapping[str, Any]],
    root: str | os.PathLike[str] | None = None,
    mode: Mode = "full",
    record: Any = None,
    workers: int | None = None,
) -> list[Problem]:
    """Check files against their expected size and sha256; return the problems (empty when all match).

    ``mode="full"`` hashes every file whose size matches (in parallel); ``mode="fast"`` compares
    size, mtime and inode with ``record`` (see the module docstring: it trusts the file system) and
    reads nothing. In fast mode, a file with no record entry, or whose record names another sha256,
    is a problem (``no-record``): fast mode never vouches for bytes nobody hashed.
    Problems come back in the entries' order.
    """
    if mode not in ("full", "fast"):
        raise ValueError(f"mode must be 'full' or 'fast', not {mode!r}")
    items = [_entry(e) for e in entries]
    problems: dict[int, Problem] = {}
    to_hash: list[tuple[int, str]] = []
    rec = _record_map(record) if mode == "fast" else {}
    for i, e in enumerate(items):
        full = _full_path(root, e.path)
        try:
            st = os.stat(full)
        except FileNotFoundError:
            problems[i] = Problem(e.path, "missing", f"{e.size} bytes", "no such file")
            continue
        except OSError as err:
            problems[i] = Problem(e.path, "unreadable", f"{e.size} bytes", err.strerror or str(err))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems[i] = Problem(e.path, "not-a-file", "a regular file", "something else")
            continue
        if st.st_size != e.size:  # size first: no byte is read to report this
            problems[i] = Problem(e.path, "size", f"{e.size} bytes", f"{st.st_size} bytes")
            continue
        if mode == "full":
            to_hash.append((i, full))
            continue
        r = rec.get(e.path) or rec.get(full) or rec.get(os.path.abspath(full))
        drift = fast_mode_drift(dict(r) if r is not None else None, e.sha256, e.size, st.st_size,
                                st.st_mtime_ns, st.st_ino)
        if drift is not None:
            problems[i] = _drift_problem(e.path, drift, r, st)
    if to_hash:
        problems.update(_hash_and_compare(items, to_hash, workers))
    return [problems[i] for i in sorted(problems)]


def _hash_and_compare(
    items: list[Entry], to_hash: list[tuple[int, str]], workers: int | None
) -> dict[int, Problem]:
    def one(job: tuple[int, str]) -> tuple[int, Problem | None]:
        i, full = job
        e = items[i]
        try:
            digest, size = sha256_file(full)
        except OSError as err:
            return i, Problem(e.path, "unreadable", f"{e.size} bytes", err.strerror or str(err))
        if size != e.size:  # changed while we read it
            return i, Problem(e.path, "size", f"{e.size} bytes", f"{size} bytes")
        if digest != e.sha256:
            return i, Problem(e.path, "sha256", e.sha256, digest)
        return i, None

    results = in_parallel(one, to_hash, size=lambda j: items[j[0]].size, workers=workers)
    return {i: p for i, p in results if p is not None}


def _drift_problem(path: str, drift: str, r: Mapping[str, Any] | None, st: os.stat_result) -> Problem:
    if drift == "size" and r is not None:
        return Problem(path, "size", f"{r.get('size')} bytes (record)", f"{st.st_size} bytes")
    if drift == "replaced" and r is not None:
        return Problem(path, "replaced", f"inode {r.get('inode')}", f"inode {st.st_ino}")
    if drift == "modified" and r is not None:
        return Problem(path, "modified", f"mtime {r.get('mtime')} ns", f"mtime {st.st_mtime_ns} ns")
    return Problem(path, "no-record", "an apply record entry for this sha256", "none")


def record_for(
    entries: Iterable[Entry | Sequence[Any] | Mapping[str, Any]], root: str | os.PathLike[str] | None = None
) -> list[dict[str, Any]]:
    """Fast mode's record for files just verified in full: [{path, size, sha256, mtime, inode}].

    Call it only right after :func:`verify_files` in full mode returned no problem for these files.
    """
    out = []
    for e in (_entry(x) for x in entries):
        s = stamp(_full_path(root, e.path))
        out.append({"path": e.path, "sha256": e.sha256, **s})
    return out
