"""Published images (run as they are): a pin by digest resolved through the registry (manifest and
config hashed against the digests that name them) or, offline, from the engine's copy."""

from __future__ import annotations

import http.client
import re
import urllib.error
from typing import Any

from builder.errors import ConfigError, ResolveError
from builder.foundation.distribution import (
    INDEX_TYPES,
    MANIFEST_TYPES,
    ImageRef,
    RegistryClient,
    network_reason,
    parse_ref,
)
from builder.inputs.pins import PublishedImage
from builder.lock.lockfile import LockedPublishedImage
from builder.lock.oci import local_image, platform_matches


def _diff_ids(where: str, config: dict[str, Any], layers: int | None) -> list[str]:
    diff_ids = [str(x) for x in ((config.get("rootfs") or {}).get("diff_ids") or [])]
    if not diff_ids or not all(re.fullmatch(r"sha256:[0-9a-f]{64}", d) for d in diff_ids):
        raise ResolveError(f"{where}: the image config has no DiffIDs")
    if layers is not None and layers != len(diff_ids):
        raise ResolveError(f"{where}: the manifest has {layers} layers, its config {len(diff_ids)} DiffIDs")
    return diff_ids


def resolve_published(name: str, spec: PublishedImage, *, offline: bool, spec_hash: str) -> LockedPublishedImage:
    """A published image by digest: the registry's manifest (its bytes hash to the pinned digest) and
    config (its bytes hash to the digest the manifest names: the ImageID), or offline the engine's copy
    pulled by that digest."""
    where = f"images.{name}"
    try:
        ref = parse_ref(spec.published)
    except ConfigError as e:
        raise ConfigError(f"{where}.published: {e}") from None
    assert ref.digest is not None  # PublishedImage takes references by digest only
    if offline:
        return _published_local(where, spec, ref, spec_hash)
    doc, digest, image_id, config = _from_registry(where, spec, ref)
    os_, arch, var = config.get("os", ""), config.get("architecture", ""), config.get("variant")
    if not platform_matches(spec.platform, os_, arch, var):
        have = "/".join(x for x in (os_, arch, var) if x)
        raise ResolveError(f"{where}: {spec.published} is {have}, not {spec.platform}")
    return LockedPublishedImage(spec_hash=spec_hash, published=spec.published, manifest_digest=digest,
                                image_id=image_id, diff_ids=_diff_ids(where, config, len(doc.get("layers") or [])),
                                platform=spec.platform, source="registry")


def _from_registry(where: str, spec: PublishedImage, ref: ImageRef) -> tuple[dict[str, Any], str, str, dict[str, Any]]:
    """The platform's manifest, its digest, the config digest it names (the ImageID) and that config,
    from the registry; each failure one ResolveError that names the image."""
    assert ref.digest is not None
    reg = RegistryClient(ref)
    try:
        doc, digest = _platform_manifest(where, spec, reg, ref.digest)
        image_id = str((doc.get("config") or {}).get("digest"))
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", image_id):
            raise ResolveError(f"{where}: {spec.published}: the manifest names no config digest")
        config = reg.blob_json(image_id)
    except ResolveError as e:
        text = str(e)
        raise ResolveError(text if text.startswith(where) else f"{where}: {text}") from None
    except urllib.error.HTTPError as e:
        what = "not found" if e.code == 404 else f"HTTP {e.code}"
        raise ResolveError(f"{where}: {spec.published}: {what} at {ref.registry}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise ResolveError(f"{where}: cannot reach {ref.registry} for {spec.published}: {network_reason(e)}") from None
    return doc, digest, image_id, config


def _platform_manifest(where: str, spec: PublishedImage, reg: RegistryClient,
                       pinned: str) -> tuple[dict[str, Any], str]:
    """The image manifest the pinned digest names, through its index's entry for the pin's platform
    when it names an index; with its digest."""
    doc, media, digest = reg.manifest(pinned)
    if media in INDEX_TYPES or "manifests" in doc:
        match = next((m for m in doc.get("manifests") or []
                      if platform_matches(spec.platform, (m.get("platform") or {}).get("os", ""),
                                          (m.get("platform") or {}).get("architecture", ""),
                                          (m.get("platform") or {}).get("variant"))), None)
        if match is None:
            raise ResolveError(f"{where}: platform {spec.platform} is not in the index {spec.published}")
        doc, media, digest = reg.manifest(str(match.get("digest")))
    if not (media in MANIFEST_TYPES or "config" in doc):
        raise ResolveError(f"{where}: {spec.published}: unsupported manifest type {media or 'unknown'}")
    return doc, digest


def _published_local(where: str, spec: PublishedImage, ref: ImageRef, spec_hash: str) -> LockedPublishedImage:
    info = local_image(where, spec.published, [spec.platform], " is not in the Docker engine")
    image_id = str(info["Id"])
    diff_ids = _diff_ids(where, {"rootfs": {"diff_ids": (info.get("RootFS") or {}).get("Layers")}}, None)
    assert ref.digest is not None
    return LockedPublishedImage(spec_hash=spec_hash, published=spec.published, manifest_digest=ref.digest,
                                image_id=image_id, diff_ids=diff_ids, platform=spec.platform, source="local")
