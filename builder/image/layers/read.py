"""Reading a docker-archive into a work folder: normalised (image builds) or as it is (bundles)."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from builder.errors import BuilderError
from builder.foundation.canon import ChunkReader
from builder.foundation.hashing import sha256_file
from builder.image.layers.config import canonical_config
from builder.image.layers.layer import clean_name, normalize_layer
from builder.image.layers.spooled import COPY_CHUNK, Layer, SpooledImage


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


@dataclass
class _Spool:
    """The input docker-archive, unpacked into regular files."""

    root: Path
    files: dict[str, Path]
    links: dict[str, str]

    def path(self, name: str, where: str) -> Path:
        seen = set()
        name = clean_name(name, where)
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
                    name = clean_name(m.name, where)
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
    return Layer("sha256:" + digest, size, dest)


def normalize_image(
    saved: str | os.PathLike[str] | IO[bytes] | Iterable[bytes],
    workdir: str | os.PathLike[str],
    *,
    source_date_epoch: int,
    base_layers: int | Sequence[str] = 0,
    labels: Mapping[str, str] | None = None,
    keep_owners: bool = False,
) -> SpooledImage:
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
) -> SpooledImage:
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
) -> SpooledImage:
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
        layers.append(Layer(res.diff_id, res.size, dest))
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
    return SpooledImage(
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
