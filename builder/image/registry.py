"""`builder push`: a built image into a registry by digest, through the OCI distribution API.

What is pushed is the image's own OCI manifest (builder.image.layers: uncompressed layers, so every layer's
digest is its DiffID and the manifest digest is a function of the image), not what `docker push`
would make of it: the same image gives the same manifest digest from any machine. Before anything is
sent, the manifest and every blob are asked for with HEAD; what the registry holds is not sent, and an
image the registry holds whole costs one HEAD (plus the check below). The engine is asked for the
image's bytes (`docker save`) only when a blob is missing. After the push the registry's answer is
checked: the manifest by digest, its config's DiffIDs against the record. The reference pushed
(``host:port/builder/NAME@sha256:...``) is recorded in the image record. The model files of a fleet
go to its registry as blobs here too, and the bundle's preflight asks the registry through here.

Every request goes through builder.foundation.distribution, the operator side's one registry client:
blobs in chunks resumed where a link drops, the credentials (sent only to the registry, never written
or printed), one-line errors naming the registry.
"""

from __future__ import annotations

import io
import ipaddress
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from builder.errors import ConfigError, VerifyError
from builder.foundation.canon import canonical_json, file_lock
from builder.foundation.distribution import ImageRef, RegistryClient, sha256_of
from builder.image import layers
from builder.image.imagerecord import ImageRecord, read_record, write_record
from builder.image.layers.spooled import MEDIA_CONFIG, MEDIA_LAYER, MEDIA_MANIFEST
from builder.inputs.hosts import Fleet, fleet_registry_ca
from builder.store.content import live_marker

REPO_PREFIX = "builder"
#: the repository that holds a fleet's model files, each a blob whose digest is its locked sha256
MODEL_REPOSITORY = f"{REPO_PREFIX}/model-files"


@dataclass(frozen=True)
class Target:
    """A registry to push to or pull from: ``host:port``, its scheme and the CA file that signs its TLS."""

    registry: str
    scheme: str
    ca_file: str | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.registry}"

    def repository(self, name: str) -> str:
        return f"{REPO_PREFIX}/{name}"

    def reference(self, name: str, manifest_digest: str) -> str:
        return f"{self.registry}/{self.repository(name)}@{manifest_digest}"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_target(url: str, where: str, ca_file: str | Path | None = None) -> Target:
    """``https://host:port`` (or ``host:port``; plain ``http://`` only for loopback). ConfigError naming
    ``where`` otherwise. The URL is never echoed when it carries credentials."""
    text = url if "://" in url else f"https://{url}"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ConfigError(f"{where}: not a registry URL: {url}") from None
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{where}: credentials do not belong in the registry URL "
                          "(set BUILDER_REGISTRY_USER and BUILDER_REGISTRY_PASSWORD)")
    if parts.scheme not in ("https", "http") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise ConfigError(f"{where}: not a registry URL (want https://host:port): {url}")
    host = parts.hostname
    if ":" in host:
        host = f"[{host}]"
    if parts.scheme == "http" and not _loopback(parts.hostname):
        raise ConfigError(f"{where}: plain http is for a loopback registry only; use https with a CA file: {url}")
    registry = f"{host}:{port}" if port else host
    ca = None
    if ca_file is not None:
        ca = str(ca_file)
        if not os.path.isfile(ca):
            raise ConfigError(f"{where}: CA file not found: {ca}")
    return Target(registry=registry, scheme=parts.scheme, ca_file=ca)


@dataclass
class PushResult:
    reference: str
    manifest_digest: str
    registry: str
    sent_blobs: int
    sent_bytes: int  # handed to the connection: the blobs (each byte a cut made resend, counted again), the manifest
    held_blobs: int
    already: bool  # the registry held the whole image: nothing was sent

    def as_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "manifest_digest": self.manifest_digest, "registry": self.registry,
                "sent_blobs": self.sent_blobs, "sent_bytes": self.sent_bytes, "held_blobs": self.held_blobs,
                "already": self.already}


def manifest_of(rec: ImageRecord) -> bytes | None:
    """The image's OCI manifest from the record alone (None for a record of an older build)."""
    if rec.config_size is None or len(rec.layer_sizes) != len(rec.diff_ids):
        return None
    return canonical_json({
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": rec.image_id, "size": rec.config_size},
        "layers": [{"mediaType": MEDIA_LAYER, "digest": d, "size": s}
                   for d, s in zip(rec.diff_ids, rec.layer_sizes, strict=True)],
    })


def client_for(target: Target, repository: str) -> RegistryClient:
    """The registry client that pushes to ``repository`` of ``target``."""
    ref = ImageRef(registry=target.registry, repository=repository, tag=None, digest=None, scheme=target.scheme)
    return RegistryClient(ref, ca_file=target.ca_file, push=True)


def verify_pushed(client: RegistryClient, rec: ImageRecord, manifest_digest: str) -> None:
    """What the registry returns for the digest is this image: its config is the ImageID, its layers and
    its config's DiffIDs are the recorded ones."""
    doc, _, got = client.manifest(manifest_digest)
    if got != manifest_digest:
        raise VerifyError(f"{client.where}: manifest {manifest_digest} hashes to {got}")
    config = doc.get("config") or {}
    if config.get("digest") != rec.image_id:
        raise VerifyError(f"{client.where}: manifest {manifest_digest[:19]} names config {config.get('digest')}, "
                          f"not image {rec.image_id}")
    layer_digests = [str(x.get("digest")) for x in doc.get("layers") or []]
    cfg = client.blob_json(rec.image_id)
    diff_ids = [str(x) for x in ((cfg.get("rootfs") or {}).get("diff_ids") or [])]
    if diff_ids != list(rec.diff_ids) or layer_digests != list(rec.diff_ids):
        raise VerifyError(f"{client.where}: {client.ref.repository}@{manifest_digest[:19]} has DiffIDs other "
                          f"than the image record's")


#: a push's progress: called once the blobs to send are known, with a label and their bytes; returns the
#: callback then told each number of bytes sent
PushProgress = Callable[[str, int], Callable[[int], None]]


def push(store: Path, rec: ImageRecord, target: Target, *,
         on_log: Callable[[str], None] = lambda s: None,
         progress: PushProgress | None = None) -> tuple[PushResult, ImageRecord]:
    return push_image(store, rec, target, on_log=on_log, progress=progress)


def push_image(store: Path, rec: ImageRecord, target: Target, *,
               on_log: Callable[[str], None] = lambda s: None,
               progress: PushProgress | None = None) -> tuple[PushResult, ImageRecord]:
    """Push the recorded image; return what was sent and the updated record (also written).

    One push of an image at a time (a lock beside its record): the bundles of a fleet are made at once,
    and the second finds the registry holding what the first sent."""
    client = client_for(target, target.repository(rec.name))
    with client.one_line_errors(), file_lock(store / "locks" / f"push-{rec.input_address}.lock"):
        rec = read_record(store, rec.input_address) or rec
        res, rec = _push(store, rec, target, client, on_log, progress)
    return res, rec


def _push(store: Path, rec: ImageRecord, target: Target, client: RegistryClient,
          on_log: Callable[[str], None], progress: PushProgress | None = None) -> tuple[PushResult, ImageRecord]:
    manifest = manifest_of(rec)
    sizes: dict[str, Any] = {}
    sent_blobs = sent_bytes = held = 0
    already = False
    if manifest is not None and client.has("manifests", sha256_of(manifest), accept=MEDIA_MANIFEST):
        already = True
        held = 1 + len(rec.diff_ids)
        on_log(f"{client.where} holds {sha256_of(manifest)[:19]}: nothing to send")
    else:
        blobs = [rec.image_id, *rec.diff_ids]
        missing = [d for d in dict.fromkeys(blobs) if not client.has("blobs", d)]
        held = len(dict.fromkeys(blobs)) - len(missing)
        if missing or manifest is None:
            manifest, n, size, sizes = _send_from_engine(store, rec, client, set(missing), on_log, progress)
            sent_blobs, sent_bytes = n, size
        client.put_manifest(sha256_of(manifest), manifest, MEDIA_MANIFEST)
        sent_bytes += len(manifest)
    digest = sha256_of(manifest)
    tag = rec.input_address[:32]
    status, _, headers = client.send(f"manifests/{tag}", method="HEAD", headers={"Accept": MEDIA_MANIFEST})
    if status != 200 or headers.get("docker-content-digest") != digest:
        client.put_manifest(tag, manifest, MEDIA_MANIFEST)  # a tag too, so the registry's garbage collection keeps it
    verify_pushed(client, rec, digest)
    reference = target.reference(rec.name, digest)
    new = rec.model_copy(update={
        **sizes,  # a record of an older build learns its manifest's sizes
        "manifest_digest": digest,
        "pushed": {**rec.pushed, target.registry: reference},
    })
    if new != rec:
        write_record(store, new)
    return PushResult(reference=reference, manifest_digest=digest, registry=target.registry, sent_blobs=sent_blobs,
                      sent_bytes=sent_bytes, held_blobs=held, already=already), new


def _send_from_engine(store: Path, rec: ImageRecord, client: RegistryClient, missing: set[str],
                      on_log: Callable[[str], None],
                      progress: PushProgress | None = None) -> tuple[bytes, int, int, dict[str, Any]]:
    """The image's bytes from the engine (spooled: the config and its layers), the missing blobs sent.
    Returns (manifest, blobs sent, bytes handed to the connection for them, the record's size fields)."""
    # Imported here for start-up time: builder.foundation.dockerio loads the Docker SDK, which only a push
    # from the engine needs; every deploy imports this module for a fleet's registry.
    from builder.foundation import dockerio

    if not dockerio.image_exists(rec.image_id):
        raise ConfigError(f"images.{rec.name}: image {rec.image_id[:19]} is not in the Docker Engine "
                          f"(run `builder image {rec.name}`)")
    tmp = store / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    sent = size = 0
    # (a push killed mid-way leaves the spool, image-sized; `builder gc` removes it once its marker is free)
    with tempfile.TemporaryDirectory(prefix=f"push-{os.getpid()}-", dir=tmp) as td, live_marker(Path(td)):
        image = layers.read_image(dockerio.save(rec.image_id), Path(td) / "work")
        if image.image_id != rec.image_id or image.diff_ids != list(rec.diff_ids):
            raise VerifyError(f"images.{rec.name}: the engine saved {image.image_id[:19]}, "
                              f"the record says {rec.image_id[:19]}")
        manifest = image.manifest
        sizes = {"config_size": len(image.config), "layer_sizes": [layer.size for layer in image.layers]}
        if rec.manifest_digest and image.manifest_digest != rec.manifest_digest:
            raise VerifyError(f"images.{rec.name}: manifest {image.manifest_digest[:19]} is not the recorded "
                              f"{rec.manifest_digest[:19]}")
        unsent = {layer.diff_id: layer.size for layer in image.layers if layer.diff_id in missing}
        total = sum(unsent.values()) + (len(image.config) if rec.image_id in missing else 0)
        on_bytes = progress(f"push {rec.name}", total) if progress is not None else None
        if rec.image_id in missing:
            on_log(f"sending config {rec.image_id[:19]} ({len(image.config)} bytes)")
            config = image.config
            size += client.upload(rec.image_id, len(config), lambda: io.BytesIO(config), on_bytes)
            sent += 1
        done: set[str] = set()
        for layer in image.layers:
            if layer.diff_id not in missing or layer.diff_id in done:
                continue
            on_log(f"sending layer {layer.diff_id[:19]} ({layer.size} bytes)")
            size += client.upload(layer.diff_id, layer.size, lambda p=layer.path: open(p, "rb"),  # type: ignore[misc]
                                  on_bytes)
            done.add(layer.diff_id)
            sent += 1
    return manifest, sent, size, sizes


def reference_for(rec: ImageRecord, target: Target) -> str | None:
    """The recorded reference of this image in ``target`` (None when it was not pushed there)."""
    ref = rec.pushed.get(target.registry)
    if ref is None or not rec.manifest_digest or not ref.endswith("@" + rec.manifest_digest):
        return None
    if not re.fullmatch(r"[^@\s]+@sha256:[0-9a-f]{64}", ref):
        return None
    return ref


def fleet_target(fleet_path: Path, fleet: Fleet) -> Target | None:
    """The fleet's registry (None when it names none). ConfigError naming the file and key when it is
    not a registry URL or its CA file is missing; nothing is sent."""
    if fleet.fleet.registry is None:
        return None
    return parse_target(fleet.fleet.registry, f"{fleet_path}: fleet.registry", fleet_registry_ca(fleet_path, fleet))


def planned_reference(rec: ImageRecord, target: Target) -> str | None:
    """The reference by digest the image has in ``target`` once pushed, from the record alone (None for a
    record of an older build, whose manifest only the engine's bytes tell)."""
    manifest = manifest_of(rec)
    return None if manifest is None else target.reference(rec.name, sha256_of(manifest))


def fleet_pull_reference(fleet_path: Path, fleet: Fleet, rec: ImageRecord, *, pushing: bool) -> str | None:
    """The reference by digest a fleet's hosts pull the image by (None when the fleet names no registry).
    Nothing is sent: ``pushing``, the reference the push that follows makes (``planned_reference``);
    else the reference recorded by an earlier push, or None when it was never pushed there."""
    target = fleet_target(fleet_path, fleet)
    if target is None:
        return None
    if pushing:
        return planned_reference(rec, target)
    return reference_for(rec, target)


@dataclass(frozen=True)
class Blob:
    """A file to hold in the registry as a blob: its digest (``sha256:<hex>``), size and where it is."""

    digest: str
    size: int
    path: Path


def push_blobs(target: Target, repository: str, blobs: list[Blob], *,
               on_log: Callable[[str], None] = lambda s: None,
               progress: PushProgress | None = None) -> tuple[int, int, int]:
    """Each blob the registry lacks (a HEAD for each first) sent once, in chunks, resumed where a link
    drops (``RegistryClient.upload``). Returns (blobs sent, bytes sent, blobs the registry held). One line
    naming the registry on any failure."""
    client = client_for(target, repository)
    unique = list({b.digest: b for b in blobs}.values())
    with client.one_line_errors():
        missing = [b for b in unique if not client.has("blobs", b.digest)]
        on_bytes = progress(f"push {repository}", sum(b.size for b in missing)) if progress and missing else None
        for b in missing:
            on_log(f"sending {b.path.name} {b.digest[:19]} ({b.size} bytes)")
            client.upload(b.digest, b.size, lambda p=b.path: open(p, "rb"), on_bytes)  # type: ignore[misc]
    return len(missing), sum(b.size for b in missing), len(unique) - len(missing)


def check_blobs_reachable(target: Target, repository: str) -> None:
    """One HEAD request in ``repository``: the registry answers, with the credentials a push would use.
    UnreachableError or BuilderError, one line, otherwise."""
    client = client_for(target, repository)
    with client.one_line_errors():
        client.has("blobs", "sha256:" + "0" * 64)


def check_reachable(rec: ImageRecord, target: Target) -> None:
    """One HEAD request for the image's manifest (else its config, for a record that cannot name its
    manifest): the registry answers, with the credentials a push would use. UnreachableError or
    BuilderError, one line, otherwise."""
    client = client_for(target, target.repository(rec.name))
    manifest = manifest_of(rec)
    with client.one_line_errors():
        if manifest is not None:
            client.has("manifests", sha256_of(manifest), accept=MEDIA_MANIFEST)
        else:
            client.has("blobs", rec.image_id)
