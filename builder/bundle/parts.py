"""The part writer: a stream copied into a bundle folder, whole or in hashed parts, hashed on the way.

A file larger than the part size is stored as ``parts/<path>.partNNNN``; the manifest lists each
part's size and sha256 beside the whole file's. Every byte is read once and hashed twice (its part's
sha256 and the whole file's). Writes go through the page cache and each file is fsynced once, when
it is complete: bundles now link the model files from the store, so what streams through here is
the image archive and small files.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from builder.foundation.hashing import READ_SIZE


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
    out: IO[bytes] | None = None
    part_hash = hashlib.sha256()
    in_part = 0

    def finish_part() -> None:
        nonlocal out, in_part
        assert out is not None
        out.flush()
        os.fchmod(out.fileno(), 0o644)
        os.fsync(out.fileno())
        out.close()
        out = None
        parts[-1].update(size=in_part, sha256=part_hash.hexdigest())
        in_part = 0

    try:
        while True:
            chunk = src.read(min(READ_SIZE, part_size - in_part))
            if not chunk:
                break
            if out is None:
                parts.append({"path": f"parts/{rel}.part{len(parts):04d}", "size": 0, "sha256": ""})
                out = open(dest / parts[-1]["path"], "wb")  # noqa: SIM115 (closed by finish_part or below)
                part_hash, in_part = hashlib.sha256(), 0
            whole.update(chunk)
            part_hash.update(chunk)
            out.write(chunk)
            in_part += len(chunk)
            total += len(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
            if in_part >= part_size:
                finish_part()
        if out is not None:
            finish_part()
    finally:
        if out is not None:
            out.close()
    target = dest / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    if len(parts) <= 1:
        if parts:
            os.chmod(dest / parts[0]["path"], int(mode, 8))
            os.replace(dest / parts[0]["path"], target)
        else:
            with open(target, "wb") as f:
                os.fsync(f.fileno())
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
