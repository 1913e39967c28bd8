"""What a build produced, recorded beside its input address.

The input address names what went in (sha256 of the closure's canonical JSON); the
ImageID (sha256 of the config) and the ordered DiffIDs name what came out. Bundles and
audits refer to these, never to tags or RepoDigests (which `docker save | load` drops).
Records live in the store under images/<input_address>.json.
"""

from __future__ import annotations

from pathlib import Path

from builder.errors import ConfigError
from builder.foundation.canon import atomic_write, pretty_json
from builder.inputs.loader import load_json
from builder.inputs.schema import Digest, Sha256, Strict

REPO = "builder"  # images are tagged builder/<name>:<input address[:32]> (tag_for)


class ImageRecord(Strict):
    """One build's outcome, stored as images/<input_address>.json."""

    format: int = 1
    name: str
    input_address: Sha256
    image_id: Digest
    diff_ids: list[Digest]
    tag: str
    lock_hash: Sha256
    platform: str
    source_date_epoch: int
    labels: dict[str, str] = {}
    # The image's OCI manifest (uncompressed layers, so its layer digests are the DiffIDs): what
    # `builder push` sends, computable without the engine. Absent in records of older builds.
    manifest_digest: Digest | None = None
    config_size: int | None = None
    layer_sizes: list[int] = []
    # registry (host:port) -> the reference pushed there, by digest (host:port/builder/NAME@sha256:...).
    # Only references: credentials are never recorded.
    pushed: dict[str, str] = {}
    # A published image (pins' `published`): the reference by digest it was pulled by. None when built.
    published: str | None = None
    # The image paths its lanes' mounts replace, and the parents of a missing one up to the nearest that
    # exists: path -> file, dir, link or missing (builder.image.mounttargets). Absent in older records.
    paths: dict[str, str] = {}


def tag_for(name: str, input_address: str) -> str:
    return f"{REPO}/{name}:{input_address[:32]}"


def record_path(store: Path, input_address: str) -> Path:
    return store / "images" / f"{input_address}.json"


def write_record(store: Path, rec: ImageRecord) -> Path:
    p = record_path(store, rec.input_address)
    atomic_write(p, pretty_json(rec.model_dump(mode="json")))
    return p


def read_record(store: Path, input_address: str) -> ImageRecord | None:
    p = record_path(store, input_address)
    if not p.exists():
        return None
    return load_json(ImageRecord, p)


def require_record(store: Path, name: str, input_address: str) -> ImageRecord:
    rec = read_record(store, input_address)
    if rec is None:
        raise ConfigError(f"images.{name}: not built for the current lock (input address "
                          f"{input_address[:16]}); run `builder image {name}`")
    return rec
