"""The part writer: a stream copied into a bundle folder, whole or in hashed parts, hashed on the way.

A file larger than the part size is stored as ``parts/<path>.partNNNN``; the manifest lists each
part's size and sha256 beside the whole file's. Every byte is read once and hashed twice (its part's
sha256 and the whole file's).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import mmap
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from builder.bundle.directio import open_part, sync_close, write_all
from builder.hashing import READ_SIZE


@dataclass
class WrittenFile:
    """One file written into a bundle folder: its manifest entry."""

    path: str
    size: int
    sha256: str
    mode: str
    parts: list[dict[str, Any]] = field(default_factory=list)

    def entry(self) -> dict[str, Any]:
        e: dict[str, Any] = {"path": self.path, "size": self.size, "sha256": self.sha256, "mode": self.mode}
        if self.parts:
            e["parts"] = self.parts
        return e


def _readinto_fn(src: IO[bytes]) -> Callable[[memoryview], int]:
    """``src.readinto`` when the stream has one (files, pipes, BytesIO, BufferedReader), else read+copy."""
    fn = getattr(src, "readinto", None)
    if fn is not None:
        return fn  # type: ignore[no-any-return]

    def read_copy(view: memoryview) -> int:
        data = src.read(len(view))
        view[: len(data)] = data
        return len(data)

    return read_copy


def write_stream(
    src: IO[bytes], rel: str, dest: Path, part_size: int, mode: str, on_bytes: Callable[[int], None] | None = None
) -> WrittenFile:
    """Copy a stream into dest/rel, or into dest/parts/rel.partNNNN when it is larger than part_size.

    Hashes each part and the whole file on the way; every file written is fsynced (with its final
    mode) before this returns, so the caller only has to sync the directories.
    """
    whole = hashlib.sha256()
    total = 0
    parts: list[dict[str, Any]] = []
    part_dir = dest / "parts" / Path(rel).parent
    part_dir.mkdir(parents=True, exist_ok=True)

    def part_name(i: int) -> str:
        return f"parts/{rel}.part{i:04d}"

    # This thread only reads and writes (O_DIRECT where it can: builder.bundle.directio); the two
    # hashes run on two more threads (hashlib and os.write release the GIL), so a write waiting on
    # the disk does not hold up the hashing, and the hashes use two cores. Three page-aligned buffers
    # are reused, read with readinto and written from a memoryview: no allocation or copy per chunk.
    # A buffer is read into again only once both hashes of its last chunk are done (three chunks in
    # flight at most: memory stays flat). A finished part is fsynced and closed on a fourth thread,
    # overlapping the next part.
    readinto = _readinto_fn(src)
    nbuf = 3
    bufs = [mmap.mmap(-1, READ_SIZE) for _ in range(nbuf)]  # page-aligned, as O_DIRECT needs
    views = [memoryview(b) for b in bufs]
    busy: list[list[Future[Any]]] = [[] for _ in range(nbuf)]
    which = 0
    syncs: list[Future[None]] = []
    digests: list[Future[str]] = []
    whole_ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bundle-sha256-file")
    part_ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bundle-sha256-part")
    syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bundle-fsync")
    idx = 0
    fd = -1
    cur_hash = hashlib.sha256()
    in_part = 0
    direct = False

    def finish_part() -> None:
        nonlocal fd, idx, in_part
        os.fchmod(fd, 0o644)
        parts.append({"path": part_name(idx), "size": in_part, "sha256": ""})
        digests.append(part_ex.submit(cur_hash.hexdigest))  # after this part's updates (one worker, in order)
        syncs.append(syncer.submit(sync_close, fd))
        fd = -1
        idx += 1
        in_part = 0

    try:
        while True:
            for f in busy[which]:
                f.result()  # both hashes of this buffer's last chunk are done: it may be reused
            busy[which] = []
            want = min(READ_SIZE, part_size - in_part)
            view = views[which][:want]
            n = readinto(view)
            if not n:
                break
            chunk = view[:n]
            if fd < 0:
                fd, direct = open_part(dest / part_name(idx))
                cur_hash, in_part = hashlib.sha256(), 0
            busy[which] = [whole_ex.submit(whole.update, chunk), part_ex.submit(cur_hash.update, chunk)]
            direct = write_all(fd, chunk, in_part, direct)
            in_part += n
            total += n
            if on_bytes is not None:
                on_bytes(n)
            which = (which + 1) % nbuf
            if in_part >= part_size:
                finish_part()
        if fd >= 0:
            finish_part()
        for b in busy:
            for f in b:
                f.result()
        for p, d in zip(parts, digests, strict=True):
            p["sha256"] = d.result()
        for s in syncs:
            s.result()  # an fsync error surfaces here
    finally:
        whole_ex.shutdown(wait=True)
        part_ex.shutdown(wait=True)
        syncer.shutdown(wait=True)
        if fd >= 0:
            os.close(fd)
    target = dest / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    if len(parts) <= 1:
        if parts:
            os.chmod(dest / parts[0]["path"], int(mode, 8))
            os.replace(dest / parts[0]["path"], target)
        else:
            sync_close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        os.chmod(target, int(mode, 8))
        _prune_empty(dest / "parts")
        return WrittenFile(rel, total, whole.hexdigest(), mode)
    return WrittenFile(rel, total, whole.hexdigest(), mode, parts)


def write_bytes(data: bytes, rel: str, dest: Path, part_size: int, mode: str) -> WrittenFile:
    return write_stream(io.BytesIO(data), rel, dest, part_size, mode)


def _prune_empty(d: Path) -> None:
    if not d.is_dir():
        return
    for dirpath, _dirs, _files in sorted(os.walk(d, topdown=False), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)
