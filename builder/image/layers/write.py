"""Writing a spooled image as one archive: `docker load`'s format plus an OCI layout, streamed."""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

from builder.errors import BuilderError
from builder.foundation.canon import atomic_writer, canonical_json
from builder.image.layers.spooled import COPY_CHUNK, MEDIA_INDEX, MEDIA_MANIFEST, Layer, SpooledImage

BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE


def _header(name: str, size: int, *, is_dir: bool, mtime: int) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    ti.mode = 0o755 if is_dir else 0o644
    ti.size = 0 if is_dir else size
    ti.mtime = mtime
    ti.uname = ti.gname = ""
    return ti.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


def archive_chunks(record: SpooledImage, *, repo_tags: Sequence[str] = (), mtime: int = 0,
                   omit: frozenset[str] = frozenset()) -> Iterator[bytes]:
    """The image's archive as a stream of chunks: ``docker load`` format plus an OCI layout.

    Sorted entries, fixed ``mtime``, owner 0/0, uncompressed layers. Memory: one chunk at a time.
    ``omit``: DiffIDs whose layer files are left out (a thin archive: manifest.json still lists them; an
    engine with the classic image store loads it when it holds those layers' chain already).
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
        if layer.diff_id in omit:
            continue
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
    record: SpooledImage,
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
