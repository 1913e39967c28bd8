"""Deterministic image assembly in pure Python.

The classic builder stamps build times into every layer and into the config, so two builds of the
same inputs differ. ``normalize_image`` takes what the engine built (the docker-archive that
``dockerio.save`` streams) and rewrites it into a canonical form:

* every layer added after the base is rewritten (``layer``): entries sorted by name, parent
  directories explicit, integer mtimes clamped to SOURCE_DATE_EPOCH, uid/gid 0 with empty user and
  group names, hard links turned into regular files, devices/FIFOs/sockets dropped, no PAX records
  unless a name needs one (only ``security.capability`` xattrs are kept), written uncompressed;
* base layers are passed through byte for byte (their DiffIDs are checked);
* the config is rebuilt canonically (``config``): ``created`` and the added history entries carry
  the epoch, ``rootfs.diff_ids`` are recomputed, the caller's labels are merged in, Env/Entrypoint/
  Cmd/WorkingDir/ExposedPorts/User/Volumes/StopSignal are kept, build-host noise is dropped;
* the outer archive is sorted with a fixed mtime (``write``); it holds ``manifest.json`` for
  ``docker load`` and an OCI layout (``oci-layout``, ``index.json``, ``blobs/sha256``) beside it.

The ImageID is the sha256 of the config bytes, which the classic store reports on load. Memory stays
bounded: the input archive is spooled to files in a work folder (``read``, giving a ``SpooledImage``),
layers are copied entry by entry, and the output archive is produced as a stream of chunks.
``engine`` holds the two steps that talk to the Docker Engine.
"""

from builder.image.layers.config import canonical_config, rfc3339
from builder.image.layers.dockerload import normalize_and_load, save_archive
from builder.image.layers.layer import LayerResult, normalize_layer
from builder.image.layers.read import normalize_image, read_image
from builder.image.layers.spooled import Layer, SpooledImage
from builder.image.layers.write import archive_chunks, write_archive

__all__ = [
    "Layer",
    "LayerResult",
    "SpooledImage",
    "archive_chunks",
    "canonical_config",
    "normalize_and_load",
    "normalize_image",
    "normalize_layer",
    "read_image",
    "rfc3339",
    "save_archive",
    "write_archive",
]
