"""`builder push`: a built image into a registry by digest, through the OCI distribution API.

What is pushed is the image's own OCI manifest (builder.image.layers: uncompressed layers, so every layer's
digest is its DiffID and the manifest digest is a function of the image), not what `docker push`
would make of it: the same image gives the same manifest digest from any machine. Before anything is
sent, the manifest and every blob are asked for with HEAD; what the registry holds is not sent, and an
image the registry holds whole costs one HEAD (plus the check below). The engine is asked for the
image's bytes (`docker save`) only when a blob is missing. A blob is sent in chunks (PATCH with
Content-Range); a chunk the link drops is followed by a look at where the upload stands, and the blob
goes on from there (or, where the registry dropped the upload, starts again). After the push the
registry's answer is checked: the manifest by digest, its config's DiffIDs against the record. The reference pushed
(``host:port/builder/NAME@sha256:...``) is recorded in the image record; credentials
(BUILDER_REGISTRY_USER / BUILDER_REGISTRY_PASSWORD, else the docker client's config through the docker
SDK: its credential helpers, ``credHelpers`` and ``credsStore``, and its ``auths``) are sent only to the
registry and never written or printed.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import io
import ipaddress
import os
import re
import ssl
import tempfile
import time
import urllib.error
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from builder.errors import BuilderError, ConfigError, UnreachableError, VerifyError
from builder.foundation import dockerio
from builder.foundation.canon import canonical_json, file_lock
from builder.image import layers
from builder.image.imagerecord import ImageRecord, read_record, write_record
from builder.image.layers.spooled import MEDIA_CONFIG, MEDIA_LAYER, MEDIA_MANIFEST
from builder.inputs.hosts import Fleet, fleet_registry_ca
from builder.lock import oci
from builder.lock.plainfiles import network_reason
from builder.store.content import live_marker

REPO_PREFIX = "builder"
#: the repository that holds a fleet's model files, each a blob whose digest is its locked sha256
MODEL_REPOSITORY = f"{REPO_PREFIX}/model-files"
#: bytes read from a blob at a time while a chunk is sent
UPLOAD_BLOCK = 1024 * 1024
#: bytes one PATCH carries (a registry's OCI-Chunk-Min-Length can ask for more): a chunk the link drops
#: midway costs at most this much where the registry keeps the chunks before it
CHUNK = 64 * 1024 * 1024
#: tries in a row that bring an upload no byte further, and the wait before the first (doubled each time)
RETRIES = 5
RETRY_WAIT = 0.5


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


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class _Client:
    """The push side of the distribution API over oci.Registry's HTTP and auth."""

    def __init__(self, target: Target, repository: str) -> None:
        self.target = target
        ref = oci.ImageRef(registry=target.registry, repository=repository, tag=None, digest=None,
                           scheme=target.scheme)
        self.reg = oci.Registry(ref, ca_file=target.ca_file, push=True)
        self.where = f"registry {target.registry}"

    def send(self, url_or_path: str, **kw: Any) -> tuple[int, bytes, dict[str, str]]:
        """oci.Registry.send; a 401 after the credentials were sent is BuilderError (auth_failed)."""
        status, body, headers = self.reg.send(url_or_path, **kw)
        if status == 401:
            raise BuilderError(self.auth_failed())
        return status, body, headers

    def auth_failed(self) -> str:
        """One line for a registry that refused the credentials sent (oci.Registry.auth_refused)."""
        return self.reg.auth_refused()

    def has(self, kind: str, digest: str) -> bool:
        status, _, headers = self.send(f"{kind}/{digest}", method="HEAD",
                                       headers={"Accept": MEDIA_MANIFEST} if kind == "manifests" else None)
        if status == 200:
            if kind == "manifests" and headers.get("docker-content-digest", digest) != digest:
                raise VerifyError(f"{self.where}: manifest {digest} is answered as "
                                  f"{headers.get('docker-content-digest')}")
            return True
        if status == 404:
            return False
        raise BuilderError(f"{self.where}: HEAD {kind}/{digest[:19]}: HTTP {status}")

    def _start_upload(self) -> tuple[str, int]:
        """POST a new upload: (its location, the chunk size the registry asks at least)."""
        status, body, headers = self.send("blobs/uploads/", method="POST", data=b"",
                                          headers={"Content-Length": "0"})
        if status != 202 or "location" not in headers:
            raise BuilderError(f"{self.where}: starting an upload: HTTP {status} {_short(body)}")
        least = headers.get("oci-chunk-min-length", "")
        return headers["location"], int(least) if least.isdigit() else 0

    def _upload_state(self, location: str) -> tuple[str, int] | None:
        """Where an upload stands (GET on its location: 204 with its ``Range``): (its location now, the
        bytes it holds). None when the registry no longer has it (404, or 400: distribution cancels an
        upload that holds more bytes than its last answer said, as a chunk cut midway leaves it)."""
        status, body, headers = self.send(location, method="GET")
        if status in (200, 204):
            return headers.get("location", location), _received(headers.get("range"))
        if status in (400, 404):
            return None
        if status >= 500 or status in (408, 429):  # (the registry's trouble, not the upload's: ask again)
            raise ConnectionError(f"HTTP {status}")
        raise BuilderError(f"{self.where}: asking an upload's state: HTTP {status} {_short(body)}")

    def upload(self, digest: str, size: int, open_body: Callable[[], Any],
               on_bytes: Callable[[int], None] | None = None) -> int:
        """Send one blob in chunks (POST, then PATCH with ``Content-Range`` per chunk, then PUT with its
        digest). A chunk cut midway (a dropped link, a refused connection, a 5xx) is followed by a
        look at where the upload stands (GET on its location) and the blob goes on from the byte the
        registry holds; where the registry has dropped the upload (distribution does, for a chunk cut
        midway) a new one starts from the blob's first byte. RETRIES tries in a row that bring nothing
        further, then BuilderError; ``on_bytes``: told each number of bytes sent (negative when the
        registry kept fewer than were sent). Returns the bytes of the blob handed to the connection,
        each resent byte counted again: ``size`` when no chunk was cut, at most one chunk more where the
        registry keeps the bytes of a cut chunk, more where it drops the upload."""
        told = [0]  # the bytes on_bytes was told so far
        wire = [0]  # the bytes handed to the connection, resent ones too

        def tell(n: int) -> None:
            told[0] += n
            if on_bytes is not None and n:
                on_bytes(n)

        def back_to(off: int) -> None:  # progress back to what the registry holds
            tell(off - told[0])

        link_errors = (OSError, http.client.HTTPException)
        with open_body() as f:
            location, least = self._start_upload()
            chunk = max(CHUNK, least)
            off, tries, starts = 0, 0, 1  # off: the bytes the registry has acknowledged
            while True:
                done = off >= size
                status: int | None = None
                try:
                    if done:  # the last request: no bytes, the digest
                        sep = "&" if "?" in location else "?"
                        status, body, headers = self.send(f"{location}{sep}digest={digest}", method="PUT",
                                                          data=b"", headers={"Content-Length": "0"})
                        if status == 201:
                            return wire[0]
                    else:
                        n = min(chunk, size - off)
                        status, body, headers = self.send(
                            location, method="PATCH", data=_Piece(f, off, n, tell, wire),
                            headers={"Content-Type": "application/octet-stream",
                                     "Content-Range": f"{off}-{off + n - 1}", "Content-Length": str(n)})
                        if status == 202 and "location" in headers:
                            got = _received(headers.get("range"))
                            location, off, tries = headers["location"], got if got > off else off + n, 0
                            back_to(off)
                            continue
                    if 400 <= status < 500 and status not in (400, 404, 408, 416, 429):
                        raise BuilderError(f"{self.where}: uploading {digest[:19]}: HTTP {status} {_short(body)}")
                except _Piece.Spent as e:
                    raise BuilderError(f"{self.where}: uploading {digest[:19]}: {e}") from None
                except link_errors:
                    pass  # the link dropped mid-request
                back_to(off)
                # where does the upload stand? (asked until the registry answers, a few times)
                while True:
                    tries += 1
                    if tries > RETRIES or starts > RETRIES:
                        raise BuilderError(
                            f"{self.where}: uploading {digest[:19]}: no progress after {RETRIES} tries, at byte "
                            f"{off} of {size} (last answer: "
                            f"{'none, the link dropped' if status is None else f'HTTP {status}'})")
                    time.sleep(min(RETRY_WAIT * 2 ** (tries - 1), 8.0))
                    try:
                        if done and self.has("blobs", digest):  # the PUT was taken; its answer was lost
                            return wire[0]
                        state = self._upload_state(location)
                        if state is None:  # the registry dropped the upload: a new one, from the first byte
                            (location, least), starts = self._start_upload(), starts + 1
                            chunk, off = max(CHUNK, least), 0
                        else:
                            location, off = state
                        break
                    except link_errors:
                        continue  # still no link
                back_to(off)

    def put_manifest(self, reference: str, raw: bytes) -> None:
        status, body, headers = self.send(f"manifests/{reference}", method="PUT", data=raw,
                                          headers={"Content-Type": MEDIA_MANIFEST})
        if status != 201:
            raise BuilderError(f"{self.where}: putting manifest {reference[:19]}: HTTP {status} {_short(body)}")
        theirs = headers.get("docker-content-digest")
        if theirs and theirs != _sha(raw):
            raise VerifyError(f"{self.where}: manifest {reference[:19]}: the registry says {theirs}, "
                              f"the bytes are {_sha(raw)}")


def _short(body: bytes) -> str:
    text = " ".join(body.decode("utf-8", "replace").split())
    return text[:160]


def _received(rng: str | None) -> int:
    """The bytes an upload holds from its ``Range: 0-<last>`` (distribution says ``0-0`` for none)."""
    m = re.fullmatch(r"\s*(?:bytes=)?0-(\d+)\s*", rng or "")
    last = int(m.group(1)) if m else -1
    return last + 1 if last > 0 else 0


class _Piece:
    """One chunk of a blob as a request body: ``n`` bytes from ``off`` of ``f``, read as it is sent, in
    blocks of UPLOAD_BLOCK; iterated again from its start (a retry after a 401), it sends them again.
    ``tell`` is told each block handed to the connection (less what an earlier pass told); ``wire[0]``
    counts every block handed to it, each pass's."""

    class Spent(OSError):
        """The file ended before the chunk did (it changed under the push)."""

    def __init__(self, f: Any, off: int, n: int, tell: Callable[[int], None], wire: list[int]) -> None:
        self.f, self.off, self.n, self.tell, self.wire = f, off, n, tell, wire
        self.told = 0

    def __iter__(self) -> Any:
        self.tell(-self.told)  # (again: count from the start)
        self.told = 0
        self.f.seek(self.off)
        left = self.n
        while left:
            block = self.f.read(min(UPLOAD_BLOCK, left))
            if not block:
                raise _Piece.Spent(f"the blob ended {left} bytes early")
            left -= len(block)
            self.told += len(block)
            self.wire[0] += len(block)
            self.tell(len(block))
            yield block


def verify_pushed(client: _Client, rec: ImageRecord, manifest_digest: str) -> None:
    """What the registry returns for the digest is this image: its config is the ImageID, its layers and
    its config's DiffIDs are the recorded ones."""
    doc, _, got = client.reg.manifest(manifest_digest)
    if got != manifest_digest:
        raise VerifyError(f"{client.where}: manifest {manifest_digest} hashes to {got}")
    config = doc.get("config") or {}
    if config.get("digest") != rec.image_id:
        raise VerifyError(f"{client.where}: manifest {manifest_digest[:19]} names config {config.get('digest')}, "
                          f"not image {rec.image_id}")
    layer_digests = [str(x.get("digest")) for x in doc.get("layers") or []]
    cfg = client.reg.blob_json(rec.image_id)
    diff_ids = [str(x) for x in ((cfg.get("rootfs") or {}).get("diff_ids") or [])]
    if diff_ids != list(rec.diff_ids) or layer_digests != list(rec.diff_ids):
        raise VerifyError(f"{client.where}: {client.reg.ref.repository}@{manifest_digest[:19]} has DiffIDs other "
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
    client = _Client(target, target.repository(rec.name))
    with _one_line_errors(client), file_lock(store / "locks" / f"push-{rec.input_address}.lock"):
        rec = read_record(store, rec.input_address) or rec
        res, rec = _push(store, rec, target, client, on_log, progress)
    return res, rec


@contextlib.contextmanager
def _one_line_errors(client: _Client) -> Iterator[None]:
    """An HTTP error or a dropped link as one line naming the registry."""
    try:
        yield
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise BuilderError(client.auth_failed()) from None
        raise BuilderError(f"{client.where}: HTTP {e.code} for {client.reg.ref.repository}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        tls = tls_problem(e, client.target)
        if tls is not None:
            raise UnreachableError(tls) from None
        raise UnreachableError(f"{client.where}: cannot reach {client.target.url}: {network_reason(e)}") from None


def tls_problem(exc: BaseException, target: Target) -> str | None:
    """One line for a TLS handshake the registry's certificate failed: the registry, what the check
    said, and the fix. None for any other trouble."""
    e = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if not isinstance(e, ssl.SSLError):
        return None
    said = getattr(e, "verify_message", None) or getattr(e, "reason", None) or str(e)
    where = f"registry {target.registry}"
    if isinstance(e, ssl.SSLCertVerificationError):
        cause = f"certificate verify failed: {said}"
        if "mismatch" in str(said) or "not valid for" in str(said):
            fix = (f"reach it by a name its certificate is for, or give it a certificate for "
                   f"{target.registry.rsplit(':', 1)[0]}")
        elif target.ca_file is not None:
            fix = f"the CA file {target.ca_file} does not sign its certificate; give the one that does with --ca FILE"
        else:
            fix = "give the CA file that signs its certificate with --ca FILE, or the fleet's fleet.registry_ca"
    else:
        cause = f"TLS handshake failed: {said}"
        fix = f"check that {target.url} serves TLS on that port"
    return f"{where}: {cause} (fix: {fix})"


def _push(store: Path, rec: ImageRecord, target: Target, client: _Client,
          on_log: Callable[[str], None], progress: PushProgress | None = None) -> tuple[PushResult, ImageRecord]:
    manifest = manifest_of(rec)
    sizes: dict[str, Any] = {}
    sent_blobs = sent_bytes = held = 0
    already = False
    if manifest is not None and client.has("manifests", _sha(manifest)):
        already = True
        held = 1 + len(rec.diff_ids)
        on_log(f"{client.where} holds {_sha(manifest)[:19]}: nothing to send")
    else:
        blobs = [rec.image_id, *rec.diff_ids]
        missing = [d for d in dict.fromkeys(blobs) if not client.has("blobs", d)]
        held = len(dict.fromkeys(blobs)) - len(missing)
        if missing or manifest is None:
            manifest, n, size, sizes = _send_from_engine(store, rec, client, set(missing), on_log, progress)
            sent_blobs, sent_bytes = n, size
        client.put_manifest(_sha(manifest), manifest)
        sent_bytes += len(manifest)
    digest = _sha(manifest)
    tag = rec.input_address[:32]
    status, _, headers = client.send(f"manifests/{tag}", method="HEAD", headers={"Accept": MEDIA_MANIFEST})
    if status != 200 or headers.get("docker-content-digest") != digest:
        client.put_manifest(tag, manifest)  # a tag too, so the registry's garbage collection keeps it
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


def _send_from_engine(store: Path, rec: ImageRecord, client: _Client, missing: set[str],
                      on_log: Callable[[str], None],
                      progress: PushProgress | None = None) -> tuple[bytes, int, int, dict[str, Any]]:
    """The image's bytes from the engine (spooled: the config and its layers), the missing blobs sent.
    Returns (manifest, blobs sent, bytes handed to the connection for them, the record's size fields)."""
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
            size += client.upload(rec.image_id, len(config), lambda: _BytesBody(config), on_bytes)
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


class _BytesBody(contextlib.AbstractContextManager["_BytesBody"]):
    """Bytes as a seekable body for a retried PUT."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def seek(self, pos: int) -> int:
        return self._f.seek(pos)

    def __exit__(self, *exc: object) -> None:
        self._f.close()


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
    return None if manifest is None else target.reference(rec.name, _sha(manifest))


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
    drops (``_Client.upload``). Returns (blobs sent, bytes sent, blobs the registry held). One line
    naming the registry on any failure."""
    client = _Client(target, repository)
    unique = list({b.digest: b for b in blobs}.values())
    with _one_line_errors(client):
        missing = [b for b in unique if not client.has("blobs", b.digest)]
        on_bytes = progress(f"push {repository}", sum(b.size for b in missing)) if progress and missing else None
        for b in missing:
            on_log(f"sending {b.path.name} {b.digest[:19]} ({b.size} bytes)")
            client.upload(b.digest, b.size, lambda p=b.path: open(p, "rb"), on_bytes)  # type: ignore[misc]
    return len(missing), sum(b.size for b in missing), len(unique) - len(missing)


def check_blobs_reachable(target: Target, repository: str) -> None:
    """One HEAD request in ``repository``: the registry answers, with the credentials a push would use.
    UnreachableError or BuilderError, one line, otherwise."""
    client = _Client(target, repository)
    with _one_line_errors(client):
        client.has("blobs", "sha256:" + "0" * 64)


def check_reachable(rec: ImageRecord, target: Target) -> None:
    """One HEAD request for the image's manifest (else its config, for a record that cannot name its
    manifest): the registry answers, with the credentials a push would use. UnreachableError or
    BuilderError, one line, otherwise."""
    client = _Client(target, target.repository(rec.name))
    manifest = manifest_of(rec)
    with _one_line_errors(client):
        if manifest is not None:
            client.has("manifests", _sha(manifest))
        else:
            client.has("blobs", rec.image_id)
