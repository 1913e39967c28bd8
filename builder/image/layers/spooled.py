"""An image spooled to a work folder: its config bytes and its uncompressed layer files.

What normalising (or re-reading) a docker-archive gives, and what an archive is written from. The
ImageID is the sha256 of the config bytes; the manifest is the OCI image manifest of the layers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.foundation.canon import canonical_json

#: bytes per read or write while copying layers
COPY_CHUNK = 1024 * 1024

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True)
class Layer:
    """One uncompressed layer tar in the work folder."""

    diff_id: str  # "sha256:<hex>" of the uncompressed tar
    size: int
    path: Path


@dataclass(frozen=True)
class SpooledImage:
    """A normalized (or re-read) image in a work folder: everything needed to write its archive."""

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
