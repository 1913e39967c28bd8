"""Deterministic image assembly in pure Python (lessons.md §1 and §3).

The classic builder stamps build times into every layer and into the config, so two builds of the
same inputs differ. ``normalize_image`` takes what the engine built (the docker-archive that
``dockerio.save`` streams) and rewrites it into a canonical form:

* every layer added after the base is rewritten: entries sorted by name, parent directories
  explicit, integer mtimes clamped to SOURCE_DATE_EPOCH, uid/gid 0 with empty user and group
  names, hard links turned into regular files, devices/FIFOs/sockets dropped, no PAX records
  unless a name needs one (only ``security.capability`` xattrs are kept), written uncompressed;
* base layers are passed through byte for byte (their DiffIDs are checked);
* the config is rebuilt canonically: ``created`` and the added history entries carry the epoch,
  ``rootfs.diff_ids`` are recomputed, the caller's labels are merged in, Env/Entrypoint/Cmd/
  WorkingDir/ExposedPorts/User/Volumes/StopSignal are kept, build-host noise is dropped;
* the outer archive is sorted with a fixed mtime; it holds ``manifest.json`` for ``docker load``
  and an OCI layout (``oci-layout``, ``index.json``, ``blobs/sha256``) beside it.

The ImageID is the sha256 of the config bytes, which the classic store reports on load.
Memory stays bounded: the input archive is spooled to files in a work folder, layers are
copied entry by entry, and the output archive is produced as a stream of chunks.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from builder.canon import ChunkReader, atomic_writer, canonical_json, sha256_file
from builder.errors import BuilderError

#: Bumped whenever a change here changes the bytes produced (recorded in every image closure).
ASSEMBLY_FORMAT = 1

COPY_CHUNK = 1024 * 1024
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"

#: Keys of the image's run config that are kept; everything else is build-host noise.
KEPT_CONFIG_KEYS = (
    "User",
    "ExposedPorts",
    "Env",
    "Entrypoint",
    "Cmd",
    "Volumes",
    "WorkingDir",
    "Labels",
    "StopSignal",
    "Healthcheck",
    "Shell",
    "OnBuild",
    "ArgsEscaped",
)
#: PAX records copied from an input layer (xattrs are written only deliberately).
KEPT_PAX = ("SCHILY.xattr.security.capability",)
#: The classic builder names COPY/ADD sources by a content hash that includes file times.
_SOURCE_HASH = re.compile(r"\b(file|dir|multi):[0-9a-f]{64}\b")


@dataclass(frozen=True)
class Layer:
    """One uncompressed layer tar in the work folder."""

    diff_id: str  # "sha256:<hex>" of the uncompressed tar
    size: int
    path: Path
    rewritten: bool  # False for a base layer passed through


@dataclass(frozen=True)
class ImageRecord:
    """A normalized (or re-exported) image: everything needed to write its archive."""

    image_id: str  # "sha256:<hex>" of ``config``
    config: bytes
    layers: tuple[Layer, ...]
    skipped: tuple[str, ...] = field(default=())  # entries dropped (devices, FIFOs, sockets)

    @property
    def diff_ids(self) -> list[str]:
        return [layer.diff_id for layer in self.layers]

    @property
    def manifest(self) -> bytes:
        """The OCI image manifest (uncompressed layers): canonical JSON."""
        return canonical_json(
            {
                "schemaVersion": 2,
                "mediaType": MEDIA_MANIFEST,
                "config": {"mediaType": MEDIA_CONFIG, "digest": self.image_id, "size": len(self.config)},
                "layers": [
                    {"mediaType": MEDIA_LAYER, "digest": layer.diff_id, "size": layer.size}
                    for layer in self.layers
                ],
            }
        )

    @property
    def manifest_digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.manifest).hexdigest()

    def as_json(self) -> dict[str, Any]:
        return {
            "image_id": self.image_id,
            "diff_ids": self.diff_ids,
            "manifest_digest": self.manifest_digest,
            "skipped": list(self.skipped),
        }


# --------------------------------------------------------------------------- small helpers


def rfc3339(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


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


def _clean_name(raw: str, where: str) -> str:
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


def _sort_key(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


def _uncompressed(path: Path, scratch: Path) -> Path:
    """``path`` itself when it is a plain tar; else a decompressed copy in ``scratch``."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == b"\x1f\x8b":
        out = scratch / (path.name + ".tar")
        with gzip.open(path, "rb") as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, COPY_CHUNK)
        return out
    if magic == b"\x28\xb5\x2f\xfd":
        raise BuilderError(f"{path.name}: zstd-compressed layers are not supported")
    return path


# --------------------------------------------------------------------------- one layer


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
        members: dict[str, tarfile.TarInfo] = {}
        sources: dict[str, tarfile.TarInfo] = {}  # name -> the regular entry holding its bytes
        for m in tf:
            name = _clean_name(m.name, where)
            if not name:
                continue
            if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
                skipped.append(name)
                continue
            members.pop(name, None)
            sources.pop(name, None)
            if m.islnk():
                target = sources.get(_clean_name(m.linkname, where))
                if target is None:
                    raise BuilderError(
                        f"{where}: hard link {name!r} -> {m.linkname!r}: target not in this layer"
                    )
                sources[name] = target
            elif m.isreg():
                sources[name] = m
            members[name] = m
        # Every parent directory, explicitly.
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

        sink = _HashingWriter(dst)
        with tarfile.open(
            fileobj=sink,  # type: ignore[arg-type]
            mode="w|",
            format=tarfile.PAX_FORMAT,
            encoding="utf-8",
            errors="surrogateescape",
        ) as out:
            for name in sorted(members, key=_sort_key):
                m = members[name]
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
    return LayerResult("sha256:" + sink.sha.hexdigest(), sink.size, tuple(skipped))


# --------------------------------------------------------------------------- whole images


@dataclass
class _Spool:
    """The input docker-archive, unpacked into regular files."""

    root: Path
    files: dict[str, Path]
    links: dict[str, str]

    def path(self, name: str, where: str) -> Path:
        seen = set()
        name = _clean_name(name, where)
        while name in self.links:
            if name in seen:
                raise BuilderError(f"{where}: link loop at {name!r}")
            seen.add(name)
            name = self.links[name]
        if name not in self.files:
            raise BuilderError(f"{where}: the archive has no {name!r}")
        return self.files[name]

    def read_json(self, name: str, where: str) -> Any:
        p = self.path(name, where)
        try:
            return json.loads(p.read_bytes())
        except ValueError as exc:
            raise BuilderError(f"{where}: {name}: not JSON: {exc}") from None


def _spool(saved: str | os.PathLike[str] | IO[bytes] | Iterable[bytes], root: Path) -> _Spool:
    """Unpack a docker-archive (path, binary file or chunk iterator) into ``root``, streaming."""
    where = "image archive"
    if isinstance(saved, (str, os.PathLike)):
        where = str(saved)
        ctx: Any = open(saved, "rb")
    elif hasattr(saved, "read"):
        ctx = contextlib.nullcontext(saved)
    else:
        ctx = contextlib.nullcontext(io.BufferedReader(ChunkReader(saved), COPY_CHUNK))  # type: ignore[arg-type]
    files: dict[str, Path] = {}
    links: dict[str, str] = {}
    root.mkdir(parents=True, exist_ok=True)
    n = 0
    with ctx as fileobj:
        try:
            with tarfile.open(fileobj=fileobj, mode="r|*") as tf:
                for m in tf:
                    name = _clean_name(m.name, where)
                    if not name or m.isdir():
                        continue
                    if m.issym() or m.islnk():
                        base = name.rpartition("/")[0] if m.issym() else ""
                        target = m.linkname if m.islnk() else "/".join(p for p in (base, m.linkname) if p)
                        links[name] = os.path.normpath(target).replace(os.sep, "/")
                        continue
                    if not m.isreg():
                        continue
                    n += 1
                    out = root / f"{n:06d}"
                    src = tf.extractfile(m)
                    assert src is not None
                    with src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst, COPY_CHUNK)
                    files[name] = out
        except tarfile.TarError as exc:
            raise BuilderError(f"{where}: not a docker archive: {exc}") from None
    return _Spool(root, files, links)


def _read_manifest(spool: _Spool, where: str) -> tuple[dict[str, Any], bytes, list[str]]:
    manifest = spool.read_json("manifest.json", where)
    if not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0], dict):
        raise BuilderError(f"{where}: manifest.json must describe exactly one image")
    entry = manifest[0]
    config_bytes = spool.path(str(entry.get("Config", "")), where).read_bytes()
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise BuilderError(f"{where}: image config is not JSON: {exc}") from None
    layer_names = [str(x) for x in entry.get("Layers") or []]
    diff_ids = list((config.get("rootfs") or {}).get("diff_ids") or [])
    if len(diff_ids) != len(layer_names):
        raise BuilderError(
            f"{where}: config lists {len(diff_ids)} diff_ids but the archive has {len(layer_names)} layers"
        )
    return config, config_bytes, layer_names


def _base_count(base_layers: int | Sequence[str], diff_ids: Sequence[str], where: str) -> int:
    if isinstance(base_layers, int):
        n = base_layers
    else:
        wanted = list(base_layers)
        n = len(wanted)
        if list(diff_ids[:n]) != wanted:
            raise BuilderError(f"{where}: the image does not start with the expected base layers")
    if n < 0 or n > len(diff_ids):
        raise BuilderError(f"{where}: base_layers={n} but the image has {len(diff_ids)} layers")
    return n


def _store_layer(src: Path, blobs: Path, scratch: Path, expected: str, where: str) -> Layer:
    """Pass a layer through untouched (decompressed if needed), checking its DiffID."""
    plain = _uncompressed(src, scratch)
    digest, size = sha256_file(plain)
    if "sha256:" + digest != expected:
        raise BuilderError(f"{where}: layer is sha256:{digest}, the config says {expected}")
    dest = blobs / digest
    if not dest.exists():
        try:
            os.link(plain, dest)
        except OSError:
            shutil.copyfile(plain, dest)
    return Layer("sha256:" + digest, size, dest, rewritten=False)


def canonical_config(
    original: Mapping[str, Any],
    *,
    diff_ids: Sequence[str],
    source_date_epoch: int,
    base_layers: int = 0,
    labels: Mapping[str, str] | None = None,
) -> bytes:
    """The canonical config bytes for ``original`` with new ``diff_ids`` (see module doc)."""
    when = rfc3339(int(source_date_epoch))
    run_cfg = dict(original.get("config") or {})
    cfg: dict[str, Any] = {}
    for key in KEPT_CONFIG_KEYS:
        value = run_cfg.get(key)
        if value is None or value == "" or value == {}:
            continue
        cfg[key] = value
    merged = {**(run_cfg.get("Labels") or {}), **dict(labels or {})}
    if merged:
        cfg["Labels"] = {str(k): str(v) for k, v in merged.items()}

    history: list[dict[str, Any]] = []
    consumed = 0
    for h in original.get("history") or []:
        if consumed < base_layers:
            history.append(dict(h))  # the base's own history, as it came
            if not h.get("empty_layer"):
                consumed += 1
            continue
        entry: dict[str, Any] = {"created": when}
        created_by = str(h.get("created_by", ""))
        if created_by:
            entry["created_by"] = _SOURCE_HASH.sub(r"\1:-", created_by)
        if h.get("comment"):
            entry["comment"] = str(h["comment"])
        if h.get("empty_layer"):
            entry["empty_layer"] = True
        history.append(entry)
    non_empty = sum(1 for h in history if not h.get("empty_layer"))
    if non_empty > len(diff_ids):
        raise BuilderError(f"image config: history names {non_empty} layers but there are {len(diff_ids)}")
    for _ in range(len(diff_ids) - non_empty):
        history.append({"created": when, "created_by": "builder: layer"})

    out: dict[str, Any] = {
        "architecture": original.get("architecture", "amd64"),
        "os": original.get("os", "linux"),
        "config": cfg,
        "created": when,
        "history": history,
        "rootfs": {"type": "layers", "diff_ids": list(diff_ids)},
    }
    for key in ("variant", "os.version", "os.features"):
        if original.get(key):
            out[key] = original[key]
    return canonical_json(out)


def normalize_image(
    saved: str | os.PathLike[str] | IO[bytes] | Iterable[bytes],
    workdir: str | os.PathLike[str],
    *,
    source_date_epoch: int,
    base_layers: int | Sequence[str] = 0,
    labels: Mapping[str, str] | None = None,
    keep_owners: bool = False,
) -> ImageRecord:
    """Normalize a docker-archive (from ``dockerio.save``) into ``workdir``; return its record.

    ``base_layers``: how many leading layers belong to the base image (passed through untouched),
    or the list of their DiffIDs, which must match. ``workdir`` must be empty or absent; it holds
    the layer blobs the record points to and must live until the archive is written.
    """
    return _convert(saved, workdir, normalize=True, source_date_epoch=source_date_epoch,
                    base_layers=base_layers, labels=labels, keep_owners=keep_owners)


def read_image(
    saved: str | os.PathLike[str] | IO[bytes] | Iterable[bytes],
    workdir: str | os.PathLike[str],
) -> ImageRecord:
    """Read a docker-archive as it is: config bytes and layers untouched, every DiffID checked.

    With ``write_archive`` this is a deterministic ``docker save`` for an image already loaded
    (for bundles): the same image gives the same archive bytes on any engine with a classic store.
    """
    return _convert(saved, workdir, normalize=False)


def _convert(
    saved: str | os.PathLike[str] | IO[bytes] | Iterable[bytes],
    workdir: str | os.PathLike[str],
    *,
    normalize: bool,
    source_date_epoch: int = 0,
    base_layers: int | Sequence[str] = 0,
    labels: Mapping[str, str] | None = None,
    keep_owners: bool = False,
) -> ImageRecord:
    """The shared body of ``normalize_image`` (``normalize``) and ``read_image`` (every layer and the
    config passed through)."""
    work = Path(workdir)
    where = str(saved) if isinstance(saved, (str, os.PathLike)) else "image archive"
    blobs, scratch = _prepare_workdir(work)
    spool = _spool(saved, scratch / "in")
    config, config_bytes, layer_names = _read_manifest(spool, where)
    old_ids = list(config["rootfs"]["diff_ids"])
    n_base = _base_count(base_layers, old_ids, where) if normalize else len(layer_names)
    layers: list[Layer] = []
    skipped: list[str] = []
    for i, name in enumerate(layer_names):
        lw = f"{where}: layer {i + 1}"
        src = spool.path(name, lw)
        if i < n_base:
            layers.append(_store_layer(src, blobs, scratch, old_ids[i], lw))
            continue
        plain = _uncompressed(src, scratch)
        fd, tmp = tempfile.mkstemp(dir=scratch, suffix=".layer")
        with os.fdopen(fd, "wb") as dst:
            res = normalize_layer(
                plain, dst, source_date_epoch=source_date_epoch, keep_owners=keep_owners, where=lw
            )
        dest = blobs / res.diff_id.removeprefix("sha256:")
        os.replace(tmp, dest)
        layers.append(Layer(res.diff_id, res.size, dest, rewritten=True))
        skipped.extend(f"layer {i + 1}: {s}" for s in res.skipped)
    if normalize:
        config_bytes = canonical_config(
            config,
            diff_ids=[layer.diff_id for layer in layers],
            source_date_epoch=source_date_epoch,
            base_layers=n_base,
            labels=labels,
        )
    shutil.rmtree(scratch, ignore_errors=True)
    return ImageRecord(
        "sha256:" + hashlib.sha256(config_bytes).hexdigest(), config_bytes, tuple(layers), tuple(skipped)
    )


def _prepare_workdir(work: Path) -> tuple[Path, Path]:
    if work.exists() and any(work.iterdir()):
        raise BuilderError(f"{work}: work folder is not empty")
    blobs = work / "blobs"
    scratch = work / "scratch"
    blobs.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    return blobs, scratch


# --------------------------------------------------------------------------- the outer archive


def _header(name: str, size: int, *, is_dir: bool, mtime: int) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    ti.mode = 0o755 if is_dir else 0o644
    ti.size = 0 if is_dir else size
    ti.mtime = mtime
    ti.uname = ti.gname = ""
    return ti.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


def archive_chunks(record: ImageRecord, *, repo_tags: Sequence[str] = (), mtime: int = 0) -> Iterator[bytes]:
    """The image's archive as a stream of chunks: ``docker load`` format plus an OCI layout.

    Sorted entries, fixed ``mtime``, owner 0/0, uncompressed layers. Memory: one chunk at a time.
    """
    manifest = record.manifest
    manifest_hex = record.manifest_digest.removeprefix("sha256:")
    config_hex = record.image_id.removeprefix("sha256:")
    index_entry: dict[str, Any] = {
        "mediaType": MEDIA_MANIFEST,
        "digest": record.manifest_digest,
        "size": len(manifest),
    }
    if repo_tags:
        index_entry["annotations"] = {
            "io.containerd.image.name": repo_tags[0],
            "org.opencontainers.image.ref.name": repo_tags[0].rpartition(":")[2],
        }
    small: dict[str, bytes] = {
        f"blobs/sha256/{config_hex}": record.config,
        f"blobs/sha256/{manifest_hex}": manifest,
        "index.json": canonical_json(
            {"schemaVersion": 2, "mediaType": MEDIA_INDEX, "manifests": [index_entry]}
        ),
        "manifest.json": canonical_json(
            [
                {
                    "Config": f"blobs/sha256/{config_hex}",
                    "RepoTags": list(repo_tags),
                    "Layers": [
                        f"blobs/sha256/{layer.diff_id.removeprefix('sha256:')}" for layer in record.layers
                    ],
                }
            ]
        ),
        "oci-layout": canonical_json({"imageLayoutVersion": "1.0.0"}),
    }
    big: dict[str, Layer] = {}
    for layer in record.layers:
        big.setdefault(f"blobs/sha256/{layer.diff_id.removeprefix('sha256:')}", layer)
    names = sorted(["blobs", "blobs/sha256", *small, *[n for n in big if n not in small]])
    total = 0
    for name in names:
        if name in ("blobs", "blobs/sha256"):
            chunk = _header(name, 0, is_dir=True, mtime=mtime)
            total += len(chunk)
            yield chunk
            continue
        if name in small:
            data = small[name]
            chunk = _header(name, len(data), is_dir=False, mtime=mtime) + data + _pad(len(data))
            total += len(chunk)
            yield chunk
            continue
        layer = big[name]
        header = _header(name, layer.size, is_dir=False, mtime=mtime)
        total += len(header)
        yield header
        written = 0
        with open(layer.path, "rb") as f:
            while chunk := f.read(COPY_CHUNK):
                written += len(chunk)
                total += len(chunk)
                yield chunk
        if written != layer.size:
            raise BuilderError(f"{layer.path}: layer changed while writing the archive")
        total += len(_pad(layer.size))
        yield _pad(layer.size)
    end = b"\0" * (2 * BLOCK)
    total += len(end)
    rest = (-total) % RECORD
    yield end + b"\0" * rest


def _pad(size: int) -> bytes:
    return b"\0" * ((-size) % BLOCK)


def write_archive(
    record: ImageRecord,
    dest: str | os.PathLike[str],
    *,
    repo_tags: Sequence[str] = (),
    mtime: int = 0,
) -> str:
    """Write the archive atomically to ``dest``; return its sha256 hex."""
    h = hashlib.sha256()
    with atomic_writer(dest) as f:
        for chunk in archive_chunks(record, repo_tags=repo_tags, mtime=mtime):
            h.update(chunk)
            f.write(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- with the engine


def normalize_and_load(
    ref: str,
    *,
    source_date_epoch: int,
    base_layers: int | Sequence[str] = 0,
    labels: Mapping[str, str] | None = None,
    repo_tags: Sequence[str] = (),
    workdir: str | os.PathLike[str] | None = None,
) -> ImageRecord:
    """Save ``ref`` from the engine, normalize it, load the result and check the engine's ID.

    Raises BuilderError if the engine reports a different image ID than the one computed.
    """
    from builder import dockerio

    with _workdir(workdir) as work:
        record = normalize_image(
            dockerio.save(ref),
            work,
            source_date_epoch=source_date_epoch,
            base_layers=base_layers,
            labels=labels,
        )
        loaded = dockerio.load(archive_chunks(record, repo_tags=repo_tags, mtime=source_date_epoch))
    if loaded != record.image_id:
        raise BuilderError(f"docker load of {ref}: engine reports {loaded}, computed {record.image_id}")
    return record


def save_archive(
    ref: str,
    dest: str | os.PathLike[str],
    *,
    repo_tags: Sequence[str] = (),
    mtime: int = 0,
    workdir: str | os.PathLike[str] | None = None,
) -> tuple[ImageRecord, str]:
    """A deterministic ``docker save``: (record, archive sha256 hex) for an image in the engine."""
    from builder import dockerio

    with _workdir(workdir) as work:
        record = read_image(dockerio.save(ref), work)
        digest = write_archive(record, dest, repo_tags=repo_tags, mtime=mtime)
    return record, digest


@contextlib.contextmanager
def _workdir(workdir: str | os.PathLike[str] | None) -> Iterator[Path]:
    if workdir is not None:
        yield Path(workdir)
        return
    with tempfile.TemporaryDirectory(prefix="builder-layers-") as tmp:
        yield Path(tmp)
