"""The operator side's one client of a registry: the OCI distribution API over HTTP(S) with urllib.

Everything builder asks of a registry from the operator's machine goes through ``RegistryClient``: the
lock's manifests and configs (bases, published images), the push of an image and of model files, and
the registry's preflight before a bundle is rendered. It owns the protocol's failure handling, each rule
once: a 401 is answered once (registryauth: Basic credentials or a bearer token, and where credentials
may go), then a second 401 is one line naming the registry, where the credentials came from and the fix;
a blob goes up in chunks (POST, PATCH with ``Content-Range`` per chunk, PUT with its digest), and a chunk
the link drops is followed by a look at where the upload stands (GET on its location: its ``Range``)
and the blob goes on from the byte the registry holds, with retries that back off. Every body read is
bounded, a manifest's bytes are checked against the digest that names it, and plain ``http://`` is
used only for loopback registries (127.0.0.1:PORT, localhost) or where the URL says so.

The hosts' pull of model files (builder.installer.blobs) is not this client: the installer runs on
hosts with the standard library alone and imports nothing of builder.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import re
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from builder.errors import BuilderError, ConfigError, ResolveError, UnreachableError, VerifyError
from builder.foundation.registryauth import RegistryAuth, network_reason

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
ACCEPT = ", ".join([OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST])
INDEX_TYPES = {OCI_INDEX, DOCKER_LIST}
MANIFEST_TYPES = {OCI_MANIFEST, DOCKER_MANIFEST}
TIMEOUT = 30.0
MAX_MANIFEST = 4 * 1024 * 1024
MAX_CONFIG = 16 * 1024 * 1024
DOCKER_HUB = "registry-1.docker.io"
LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}
#: bytes read from a blob at a time while a chunk is sent
UPLOAD_BLOCK = 1024 * 1024
#: bytes one PATCH carries (a registry's OCI-Chunk-Min-Length can ask for more): a chunk the link drops
#: midway costs at most this much where the registry keeps the chunks before it
CHUNK = 64 * 1024 * 1024
#: tries in a row that bring an upload no byte further, and the wait before the first (doubled each time)
RETRIES = 5
RETRY_WAIT = 0.5
#: what a dropped link raises mid-request (urllib's URLError is an OSError)
LINK_ERRORS = (OSError, http.client.HTTPException)


@dataclass(frozen=True)
class ImageRef:
    registry: str
    repository: str
    tag: str | None
    digest: str | None
    scheme: str | None = None  # set by a registry URL (https://host:5000); else https but for loopback

    @property
    def reference(self) -> str:
        return self.digest or self.tag or "latest"

    @property
    def host(self) -> str:
        return self.registry.rsplit(":", 1)[0] if not self.registry.startswith("[") else \
            self.registry.split("]")[0] + "]"

    @property
    def base_url(self) -> str:
        scheme = self.scheme or ("http" if self.host in LOOPBACK else "https")
        return f"{scheme}://{self.registry}"


def parse_ref(ref: str) -> ImageRef:
    """Parse ``[registry[:port]/]repo[:tag][@sha256:...]`` (Docker Hub names get ``library/``)."""
    rest, digest = ref, None
    if "@" in ref:
        rest, digest = ref.split("@", 1)
    if digest is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise ConfigError(f"{ref}: not a sha256 digest: {digest}")
    first, _, remainder = rest.partition("/")
    if remainder and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, remainder
    else:
        registry, path = DOCKER_HUB, rest
        if "/" not in path:
            path = f"library/{path}"
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
    if not re.fullmatch(r"[a-z0-9]+([._/-]+[a-z0-9]+)*", path):
        raise ConfigError(f"{ref}: not a valid repository name: {path}")
    if tag is not None and not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", tag):
        raise ConfigError(f"{ref}: not a valid tag: {tag}")
    if tag is None and digest is None:
        tag = "latest"
    return ImageRef(registry=registry, repository=path, tag=tag, digest=digest)


def sha256_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class RegistryClient:
    """One repository of one registry: reads (manifests, JSON blobs), HEADs, blob uploads, manifest PUTs.

    ``push``: the token asked for may push (its scope), and a refusal's fix says so. ``ca_file``: the CA
    that signs the registry's TLS certificate, where the system's store does not hold it."""

    def __init__(self, ref: ImageRef, *, timeout: float = TIMEOUT, ca_file: str | None = None,
                 push: bool = False) -> None:
        self.ref = ref
        self.timeout = timeout
        self.ca_file = ca_file
        self.auth = RegistryAuth(ref.registry, ref.repository, ref.base_url, push=push)
        self.where = f"registry {ref.registry}"
        # redirects (to blob stores) are followed; the Authorization header is "unredirected"
        handlers: list[urllib.request.BaseHandler] = []
        if ca_file is not None:
            try:
                ctx = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"{ca_file}: not a CA file: {e}") from None
            handlers.append(urllib.request.HTTPSHandler(context=ctx))
        self.opener = urllib.request.build_opener(*handlers)

    # ----------------------------------------------------------------------------- HTTP and the 401

    def _open(self, url: str, *, method: str = "GET", accept: str | None = None,
              auth: str | None = None, data: Any = None, headers: dict[str, str] | None = None) -> Any:
        req = urllib.request.Request(url, method=method, data=data,
                                     headers={"User-Agent": "builder-oci/1", **(headers or {})})
        if accept:
            req.add_header("Accept", accept)
        if auth:
            req.add_unredirected_header("Authorization", auth)
        return self.opener.open(req, timeout=self.timeout)

    def _call(self, url: str, *, method: str = "GET", accept: str | None = None, data: Any = None,
              headers: dict[str, str] | None = None) -> Any:
        """The response to one request, a first 401 answered (its challenge met) and the request sent once
        more. HTTPError for any other non-2xx answer, and for a 401 to the request that carried what the
        challenge asked for. A body that is a ``_Piece`` is sent again from its start."""
        try:
            return self._open(url, method=method, accept=accept, auth=self.auth.for_url(url), data=data,
                              headers=headers)
        except urllib.error.HTTPError as e:
            if e.code != 401:
                raise
            challenge = e.headers.get("WWW-Authenticate", "")
            e.close()
        self.auth.answer(challenge, lambda token_url, basic: self._open(token_url, auth=basic))
        return self._open(url, method=method, accept=accept, auth=self.auth.for_url(url), data=data,
                          headers=headers)

    def _url(self, url_or_path: str) -> str:
        if url_or_path.startswith(("http://", "https://")):
            return url_or_path
        if url_or_path.startswith("/"):
            return self.ref.base_url + url_or_path
        return f"{self.ref.base_url}/v2/{self.ref.repository}/{url_or_path}"

    def request(self, path: str, *, accept: str | None = None,
                limit: int = MAX_MANIFEST) -> tuple[bytes, dict[str, str]]:
        """GET ``path`` of the repository: (body, headers). HTTPError for a non-2xx answer, ResolveError
        for one refused twice or larger than ``limit``."""
        try:
            with self._call(self._url(path), accept=accept) as resp:
                body = resp.read(limit + 1)
                if len(body) > limit:
                    raise ResolveError(f"{self._where()}: answer too large from {path}")
                return body, {k.lower(): v for k, v in resp.headers.items()}
        except urllib.error.HTTPError as e:
            if e.code != 401:
                raise
            e.close()
            raise ResolveError(self.auth.refused()) from None

    def send(self, url_or_path: str, *, method: str, data: Any = None,
             headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        """One request that may carry a body (uploads, manifest PUTs, HEADs): (status, body, headers).

        Non-2xx answers are returned, not raised, so a caller reads 404 as "not there"; one refused twice
        is BuilderError, one line naming the registry and the fix."""
        try:
            with self._call(self._url(url_or_path), method=method, data=data, headers=headers) as resp:
                body = resp.read(MAX_MANIFEST + 1) if method != "HEAD" else b""
                return resp.status, body[:MAX_MANIFEST], {k.lower(): v for k, v in resp.headers.items()}
        except urllib.error.HTTPError as e:
            hdrs = {k.lower(): v for k, v in e.headers.items()}
            body = b"" if method == "HEAD" or e.code == 401 else e.read(64 * 1024)
            e.close()
            if e.code == 401:
                raise BuilderError(self.auth.refused()) from None
            return e.code, body, hdrs

    def _where(self) -> str:
        return f"{self.ref.registry}/{self.ref.repository}"

    @contextlib.contextmanager
    def one_line_errors(self) -> Iterator[None]:
        """An HTTP error or a dropped link as one line naming the registry (UnreachableError for a link
        or a TLS check that failed)."""
        try:
            yield
        except urllib.error.HTTPError as e:
            raise BuilderError(f"{self.where}: HTTP {e.code} for {self.ref.repository}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            tls = self.tls_problem(e)
            if tls is not None:
                raise UnreachableError(tls) from None
            raise UnreachableError(f"{self.where}: cannot reach {self.ref.base_url}: {network_reason(e)}") from None

    def tls_problem(self, exc: BaseException) -> str | None:
        """One line for a TLS handshake the registry's certificate failed: the registry, what the check
        said, and the fix. None for any other trouble."""
        e = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if not isinstance(e, ssl.SSLError):
            return None
        said = getattr(e, "verify_message", None) or getattr(e, "reason", None) or str(e)
        if isinstance(e, ssl.SSLCertVerificationError):
            cause = f"certificate verify failed: {said}"
            if "mismatch" in str(said) or "not valid for" in str(said):
                fix = (f"reach it by a name its certificate is for, or give it a certificate for "
                       f"{self.ref.registry.rsplit(':', 1)[0]}")
            elif self.ca_file is not None:
                fix = f"the CA file {self.ca_file} does not sign its certificate; give the one that does with --ca FILE"
            else:
                fix = "give the CA file that signs its certificate with --ca FILE, or the fleet's fleet.registry_ca"
        else:
            cause = f"TLS handshake failed: {said}"
            fix = f"check that {self.ref.base_url} serves TLS on that port"
        return f"{self.where}: {cause} (fix: {fix})"

    # ----------------------------------------------------------------------------- reads

    def manifest(self, reference: str) -> tuple[dict[str, Any], str, str]:
        """(parsed manifest, media type, digest) with the digest checked against the body."""
        body, headers = self.request(f"manifests/{reference}", accept=ACCEPT)
        digest = sha256_of(body)
        claimed = headers.get("docker-content-digest")
        if claimed and claimed != digest:
            raise ResolveError(f"{self._where()}: manifest {reference}: Docker-Content-Digest {claimed} "
                               f"does not match the body ({digest})")
        if reference.startswith("sha256:") and reference != digest:
            raise ResolveError(f"{self._where()}: manifest {reference}: body hashes to {digest}")
        try:
            doc = json.loads(body)
        except ValueError:
            raise ResolveError(f"{self._where()}: manifest {reference} is not JSON") from None
        media = doc.get("mediaType") or headers.get("content-type", "").split(";")[0].strip()
        if not media and "manifests" in doc:
            media = OCI_INDEX
        return doc, media, digest

    def blob_json(self, digest: str) -> dict[str, Any]:
        body, _ = self.request(f"blobs/{digest}", limit=MAX_CONFIG)
        got = sha256_of(body)
        if got != digest:
            raise ResolveError(f"{self._where()}: blob {digest} hashes to {got}")
        try:
            doc = json.loads(body)
        except ValueError:
            raise ResolveError(f"{self._where()}: config {digest} is not JSON") from None
        return doc if isinstance(doc, dict) else {}

    def has(self, kind: str, digest: str, *, accept: str | None = None) -> bool:
        """Whether the repository holds ``kind`` (``blobs`` or ``manifests``) ``digest``: one HEAD
        (``accept``: the manifest's media type). A manifest answered under another digest is VerifyError."""
        status, _, headers = self.send(f"{kind}/{digest}", method="HEAD",
                                       headers={"Accept": accept} if accept else None)
        if status == 200:
            if kind == "manifests" and headers.get("docker-content-digest", digest) != digest:
                raise VerifyError(f"{self.where}: manifest {digest} is answered as "
                                  f"{headers.get('docker-content-digest')}")
            return True
        if status == 404:
            return False
        raise BuilderError(f"{self.where}: HEAD {kind}/{digest[:19]}: HTTP {status}")

    # ----------------------------------------------------------------------------- writes

    def put_manifest(self, reference: str, raw: bytes, media_type: str) -> None:
        status, body, headers = self.send(f"manifests/{reference}", method="PUT", data=raw,
                                          headers={"Content-Type": media_type})
        if status != 201:
            raise BuilderError(f"{self.where}: putting manifest {reference[:19]}: HTTP {status} {_short(body)}")
        theirs = headers.get("docker-content-digest")
        if theirs and theirs != sha256_of(raw):
            raise VerifyError(f"{self.where}: manifest {reference[:19]}: the registry says {theirs}, "
                              f"the bytes are {sha256_of(raw)}")

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
        further, then BuilderError; ``open_body``: a seekable binary file of the blob, as a context
        manager; ``on_bytes``: told each number of bytes sent (negative when the registry kept fewer
        than were sent). Returns the bytes of the blob handed to the connection, each resent byte
        counted again: ``size`` when no chunk was cut, at most one chunk more where the registry keeps
        the bytes of a cut chunk, more where it drops the upload."""
        told = [0]  # the bytes on_bytes was told so far
        wire = [0]  # the bytes handed to the connection, resent ones too

        def tell(n: int) -> None:
            told[0] += n
            if on_bytes is not None and n:
                on_bytes(n)

        def back_to(off: int) -> None:  # progress back to what the registry holds
            tell(off - told[0])

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
                except LINK_ERRORS:
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
                    except LINK_ERRORS:
                        continue  # still no link
                back_to(off)


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


__all__ = ["RegistryClient", "ImageRef", "parse_ref", "sha256_of", "network_reason", "ACCEPT", "INDEX_TYPES",
           "MANIFEST_TYPES", "OCI_INDEX"]
