"""One layer tar rewritten canonically: sorted entries, explicit parents, clamped mtimes, no owners."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from typing import IO, Any

from builder.errors import BuilderError

#: PAX records copied from an input layer (xattrs are written only deliberately).
KEPT_PAX = ("SCHILY.xattr.security.capability",)


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes and counts what passes through to ``sink``."""

    def __init__(self, sink: IO[bytes]) -> None:
        self.sink = sink
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.sha.update(data)
        self.size += len(data)
        self.sink.write(data)
        return len(data)


def clean_name(raw: str, where: str) -> str:
    """A layer member's path, relative and normalized; BuilderError for absolute or ``..`` paths."""
    name = raw
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/")
    if name in ("", "."):
        return ""
    if name.startswith("/"):
        raise BuilderError(f"{where}: absolute path in layer: {raw!r}")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise BuilderError(f"{where}: path escapes the layer: {raw!r}")
    return "/".join(parts)


def sort_key(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


@dataclass(frozen=True)
class LayerResult:
    diff_id: str
    size: int
    skipped: tuple[str, ...]


def normalize_layer(
    src: str | os.PathLike[str],
    dst: IO[bytes],
    *,
    source_date_epoch: int,
    keep_owners: bool = False,
    where: str = "layer",
) -> LayerResult:
    """Rewrite the uncompressed layer tar at ``src`` canonically into ``dst``; return its DiffID.

    Entries are sorted by name, later duplicates win, missing parent directories are added
    (0755), mtimes become ``min(int(mtime), source_date_epoch)``, owners become 0/0 with empty
    names (unless ``keep_owners``), hard links become regular files, and devices, FIFOs and
    other special files are dropped (listed in ``skipped``). Absolute or ``..`` paths are refused.
    """
    epoch = int(source_date_epoch)
    skipped: list[str] = []
    with tarfile.open(src, "r:", encoding="utf-8", errors="surrogateescape") as tf:
        members, sources = _read_members(tf, skipped, where)
        _add_parents(members, epoch, where)
        sink = _HashingWriter(dst)
        with tarfile.open(
            fileobj=sink,  # type: ignore[arg-type]
            mode="w|",
            format=tarfile.PAX_FORMAT,
            encoding="utf-8",
            errors="surrogateescape",
        ) as out:
            for name in sorted(members, key=sort_key):
                _write_member(tf, out, name, members[name], sources, epoch, keep_owners, where)
    return LayerResult("sha256:" + sink.sha.hexdigest(), sink.size, tuple(skipped))


def _read_members(
    tf: tarfile.TarFile, skipped: list[str], where: str
) -> tuple[dict[str, tarfile.TarInfo], dict[str, tarfile.TarInfo]]:
    """The layer's entries by clean name (later duplicates win; special files appended to ``skipped``),
    and for each regular file or hard link the regular entry holding its bytes."""
    members: dict[str, tarfile.TarInfo] = {}
    sources: dict[str, tarfile.TarInfo] = {}  # name -> the regular entry holding its bytes
    for m in tf:
        name = clean_name(m.name, where)
        if not name:
            continue
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            skipped.append(name)
            continue
        members.pop(name, None)
        sources.pop(name, None)
        if m.islnk():
            target = sources.get(clean_name(m.linkname, where))
            if target is None:
                raise BuilderError(
                    f"{where}: hard link {name!r} -> {m.linkname!r}: target not in this layer"
                )
            sources[name] = target
        elif m.isreg():
            sources[name] = m
        members[name] = m
    return members, sources


def _add_parents(members: dict[str, tarfile.TarInfo], epoch: int, where: str) -> None:
    """Every parent directory, explicitly (0755, mtime ``epoch``); BuilderError for an entry under a
    parent that is not a directory."""
    for name in list(members):
        parent = name.rpartition("/")[0]
        while parent and parent not in members:
            d = tarfile.TarInfo(parent)
            d.type = tarfile.DIRTYPE
            d.mode = 0o755
            d.mtime = epoch
            members[parent] = d
            parent = parent.rpartition("/")[0]
        if parent and not members[parent].isdir():
            raise BuilderError(f"{where}: {name!r} lies under {parent!r}, which is not a directory")


def _write_member(
    tf: tarfile.TarFile, out: tarfile.TarFile, name: str, m: tarfile.TarInfo,
    sources: dict[str, tarfile.TarInfo], epoch: int, keep_owners: bool, where: str,
) -> None:
    """One entry, canonically: mode bits only, clamped mtime, no owner names (owners 0/0 unless
    ``keep_owners``), only the kept PAX records; a hard link as a regular file with its target's bytes."""
    ti = tarfile.TarInfo(name)
    ti.mode = m.mode & 0o7777
    ti.mtime = max(0, min(int(m.mtime), epoch))
    if keep_owners:
        ti.uid, ti.gid = m.uid, m.gid
    ti.uname = ti.gname = ""
    ti.pax_headers = {k: v for k, v in m.pax_headers.items() if k in KEPT_PAX}
    if m.isdir():
        ti.type = tarfile.DIRTYPE
        out.addfile(ti)
    elif m.issym():
        ti.type = tarfile.SYMTYPE
        ti.linkname = m.linkname
        out.addfile(ti)
    else:
        source = sources[name]
        ti.type = tarfile.REGTYPE
        ti.size = source.size
        if m.islnk():
            ti.mode = source.mode & 0o7777
        data = tf.extractfile(source)
        if data is None:
            raise BuilderError(f"{where}: cannot read {name!r}")
        with data:
            out.addfile(ti, data)
