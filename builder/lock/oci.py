"""Base images: resolve a tag to the index digest and each platform's manifest digest.

Online this speaks the OCI distribution API over HTTP(S) with urllib: ``GET
/v2/<repo>/manifests/<tag>`` with the Accept headers for OCI index, Docker manifest list,
OCI manifest and Docker v2 manifest; the body's sha256 is checked against
Docker-Content-Digest; the bearer-token flow (WWW-Authenticate) works for real registries;
basic credentials come from BUILDER_REGISTRY_USER / BUILDER_REGISTRY_PASSWORD, else from the docker
client's config through the docker SDK (credHelpers, credsStore, auths), asked only once a registry
wants them; they are never written or printed. Plain ``http://`` is used only for loopback
registries (127.0.0.1:PORT, localhost).

Offline, a local image in the Docker engine is used (``source = "local"``). For such an
entry ``platforms`` holds the local ImageID (the config digest, the image's identity in the
classic store), since the engine does not keep manifest digests; ``index_digest`` is the
RepoDigest of the same repository when the engine has one.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import re
import ssl
import subprocess
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

from builder.errors import ConfigError, ResolveError
from builder.inputs.pins import BaseImage
from builder.lock.lockfile import LockedBase
from builder.lock.plainfiles import network_reason

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


def split_platform(p: str) -> tuple[str, str, str | None]:
    parts = p.split("/")
    return parts[0], parts[1], (parts[2] if len(parts) > 2 else None)


def platform_matches(want: str, os_: str, arch: str, variant: str | None) -> bool:
    wos, warch, wvar = split_platform(want)
    if (wos, warch) != (os_, arch):
        return False
    if wvar is None:
        return True
    if arch == "arm64" and wvar == "v8" and not variant:
        return True
    return wvar == variant


# ---------------------------------------------------------------------------------------
# HTTP with registry auth


def docker_config_credentials(registry: str) -> tuple[str, str] | None:
    """(user, password) for ``registry`` as the docker client would find them, read through the docker
    SDK's own config and credential-store support (``docker.auth``): the config file
    (``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``); the credential helper its
    ``credHelpers`` names for the registry, else its ``credsStore`` (``docker-credential-NAME get``, the
    helper protocol: where nvcr.io's and cloud registries' tokens live), else its ``auths`` entry, as
    ``docker login`` writes it. None when it has none. The secret is kept in memory only: never
    written or printed. ResolveError naming the helper when it fails."""
    # the SDK (a quarter of a second to load) only here, where a registry has asked for credentials
    from docker import auth, errors

    where = f"registry {registry}"
    try:
        with warnings.catch_warnings():  # (a helper not on PATH: the SDK warns, then fails to run it)
            warnings.simplefilter("ignore")
            found = auth.load_config().resolve_authconfig(registry)
    except errors.DockerException as e:
        from builder.foundation.dockerio import credential_helper_problem  # (the SDK is loaded already)

        missing = credential_helper_problem(e)
        why = missing or " ".join(str(e).split())[:200]  # (what the helper said about itself: no secret in it)
        raise ResolveError(f"{where}: the docker config's credential helper failed: {why}") from None
    if not found:
        return None
    if found.get("IdentityToken"):
        raise ResolveError(f"{where}: the docker config gives an identity token (an OAuth refresh token), which "
                           "builder does not send; set BUILDER_REGISTRY_USER and BUILDER_REGISTRY_PASSWORD")
    user = found.get("Username") or found.get("username")
    password = found.get("Password") or found.get("password")
    if not isinstance(user, str) or not isinstance(password, str) or not user:
        return None
    return user, password


class Registry:
    def __init__(self, ref: ImageRef, *, timeout: float = TIMEOUT, ca_file: str | None = None,
                 push: bool = False) -> None:
        self.ref = ref
        self.timeout = timeout
        self.auth: str | None = None
        self.push = push
        self.user = os.environ.get("BUILDER_REGISTRY_USER")
        self.password = os.environ.get("BUILDER_REGISTRY_PASSWORD")
        #: whether the docker config was asked yet: only once a registry wants credentials (a helper runs
        #: a program, and the docker SDK takes a quarter of a second to load)
        self._asked_docker = self.user is not None and self.password is not None
        #: where the credentials sent came from (for an error that says why they were refused)
        self.creds_from = "BUILDER_REGISTRY_USER and BUILDER_REGISTRY_PASSWORD" if self._asked_docker else None
        # redirects (to blob stores) are followed; the Authorization header is "unredirected"
        handlers: list[urllib.request.BaseHandler] = []
        if ca_file is not None:
            try:
                ctx = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"{ca_file}: not a CA file: {e}") from None
            handlers.append(urllib.request.HTTPSHandler(context=ctx))
        self.opener = urllib.request.build_opener(*handlers)

    def _basic(self) -> str | None:
        if not self._asked_docker:
            self._asked_docker = True
            creds = docker_config_credentials(self.ref.registry)
            if creds is not None:
                self.user, self.password = creds
                self.creds_from = "the docker config"
        if self.user is None or self.password is None:
            return None
        return "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode()

    def _open(self, url: str, *, method: str = "GET", accept: str | None = None,
              auth: str | None = None, data: Any = None, headers: dict[str, str] | None = None) -> Any:
        req = urllib.request.Request(url, method=method, data=data,
                                     headers={"User-Agent": "builder-oci/1", **(headers or {})})
        if accept:
            req.add_header("Accept", accept)
        if auth:
            req.add_unredirected_header("Authorization", auth)
        return self.opener.open(req, timeout=self.timeout)

    def request(self, path: str, *, method: str = "GET", accept: str | None = None,
                limit: int = MAX_MANIFEST) -> tuple[bytes, dict[str, str]]:
        url = f"{self.ref.base_url}/v2/{self.ref.repository}/{path}"
        for attempt in range(2):
            try:
                with self._open(url, method=method, accept=accept, auth=self._auth_for(url)) as resp:
                    body = resp.read(limit + 1)
                    if len(body) > limit:
                        raise ResolveError(f"{self._where()}: answer too large from {path}")
                    return body, {k.lower(): v for k, v in resp.headers.items()}
            except urllib.error.HTTPError as e:
                if e.code == 401 and attempt == 0:
                    challenge = e.headers.get("WWW-Authenticate", "")
                    e.close()
                    self._authenticate(challenge)
                    continue
                if e.code == 401:  # (refused again with the credentials it asked for)
                    e.close()
                    raise ResolveError(self.auth_refused()) from None
                raise
        raise AssertionError("unreachable")

    def auth_refused(self) -> str:
        """One line for a registry that refused the credentials sent: the registry, where they came from,
        and the fix."""
        host = self.ref.registry
        cause = (f"it refused the credentials from {self.creds_from}" if self.creds_from else
                 "it refused the request, and no credentials are set for it")
        return (f"registry {host}: authentication failed (401): {cause} (fix: `docker login {host}` with an "
                f"account that may {'push' if self.push else 'pull'} there, or set BUILDER_REGISTRY_USER and "
                "BUILDER_REGISTRY_PASSWORD)")

    def send(self, url_or_path: str, *, method: str, data: Any = None, headers: dict[str, str] | None = None,
             rewind: Any = None) -> tuple[int, bytes, dict[str, str]]:
        """One request that may carry a body (uploads, manifest PUTs, HEADs): (status, body, headers).

        Non-2xx answers other than a first 401 are returned, not raised, so a caller reads 404 as
        "not there". ``rewind``: called before a retry after a 401, so a file body is sent from its start.
        """
        if url_or_path.startswith(("http://", "https://")):
            url = url_or_path
        elif url_or_path.startswith("/"):
            url = self.ref.base_url + url_or_path
        else:
            url = f"{self.ref.base_url}/v2/{self.ref.repository}/{url_or_path}"
        for attempt in range(2):
            try:
                with self._open(url, method=method, auth=self._auth_for(url), data=data, headers=headers) as resp:
                    body = resp.read(MAX_MANIFEST + 1) if method != "HEAD" else b""
                    return resp.status, body[:MAX_MANIFEST], {k.lower(): v for k, v in resp.headers.items()}
            except urllib.error.HTTPError as e:
                hdrs = {k.lower(): v for k, v in e.headers.items()}
                if e.code == 401 and attempt == 0:
                    e.close()
                    self._authenticate(hdrs.get("www-authenticate", ""))
                    if rewind is not None:
                        rewind()
                    continue
                body = b"" if method == "HEAD" else e.read(64 * 1024)
                e.close()
                return e.code, body, hdrs
        raise AssertionError("unreachable")

    def _where(self) -> str:
        return f"{self.ref.registry}/{self.ref.repository}"

    def _auth_for(self, url: str) -> str | None:
        """What a request to ``url`` carries: Basic credentials go to the registry's own host only (an
        upload Location elsewhere, such as a blob store, gets the request without them)."""
        if self.auth is not None and self.auth.startswith("Basic ") and not self._own_host(url):
            return None
        return self.auth

    def _own_host(self, url: str) -> bool:
        return (urlsplit(url).hostname or "") == urlsplit(self.ref.base_url).hostname

    def _token_url_refused(self, url: str) -> str | None:
        """Why the token service at ``url`` (a challenge's realm) is not asked (None: it is). It gets the
        registry's credentials, so: over https, or over plain http on the registry's own host when the
        registry itself is plain http (loopback, or named so). Elsewhere anyone on the way would read them."""
        scheme = urlsplit(url).scheme.lower()
        if scheme == "https":
            return None
        if scheme != "http":
            return f"not an http(s) URL ({scheme or 'no scheme'})"
        if not self._own_host(url):
            return "plain http on another host than the registry (credentials go there over https only)"
        if urlsplit(self.ref.base_url).scheme != "http":
            return "plain http, while the registry itself is reached over https"
        return None

    def _authenticate(self, challenge: str) -> None:
        scheme, _, params = challenge.partition(" ")
        fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
        if scheme.lower() == "basic":
            basic = self._basic()
            if basic is None:
                host = self.ref.registry
                raise ResolveError(f"{self._where()}: authentication failed (401): the registry wants credentials "
                                   f"and none are set for {host} (fix: `docker login {host}`, "
                                   "or set BUILDER_REGISTRY_USER and BUILDER_REGISTRY_PASSWORD)")
            self.auth = basic
            return
        if scheme.lower() != "bearer" or "realm" not in fields:
            raise ResolveError(f"{self._where()}: unsupported registry authentication: {scheme or 'none'}")
        query = {"service": fields.get("service", "")}
        wanted = "pull,push" if self.push else "pull"
        query["scope"] = fields.get("scope") or f"repository:{self.ref.repository}:{wanted}"
        token_url = f"{fields['realm']}?{urlencode(query)}"
        why = self._token_url_refused(fields["realm"])
        if why is not None:
            raise ResolveError(f"registry {self.ref.registry}: token URL {fields['realm']} refused: {why}")
        try:
            with self._open(token_url, auth=self._basic()) as resp:
                data = json.loads(resp.read(1024 * 1024))
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise ResolveError(self.auth_refused()) from None
            raise ResolveError(f"{self._where()}: token request refused: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ResolveError(f"{self._where()}: token request failed: {network_reason(e)}") from None
        token = data.get("token") or data.get("access_token")
        if not isinstance(token, str) or not token:
            raise ResolveError(f"{self._where()}: the token service gave no token")
        self.auth = f"Bearer {token}"

    def manifest(self, reference: str) -> tuple[dict[str, Any], str, str]:
        """(parsed manifest, media type, digest) with the digest checked against the body."""
        body, headers = self.request(f"manifests/{reference}", accept=ACCEPT)
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
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
        got = "sha256:" + hashlib.sha256(body).hexdigest()
        if got != digest:
            raise ResolveError(f"{self._where()}: blob {digest} hashes to {got}")
        try:
            doc = json.loads(body)
        except ValueError:
            raise ResolveError(f"{self._where()}: config {digest} is not JSON") from None
        return doc if isinstance(doc, dict) else {}


def _env_of(config: dict[str, Any]) -> list[str]:
    env = (config.get("config") or {}).get("Env") or []
    return [str(x) for x in env]


# ---------------------------------------------------------------------------------------
# resolution


def resolve_registry(name: str, spec: BaseImage, spec_hash: str) -> LockedBase:
    where = f"bases.{name}"
    ref = parse_ref(spec.ref)
    reg = Registry(ref)
    try:
        doc, media, digest = reg.manifest(ref.reference)
        platforms: dict[str, str] = {}
        env: dict[str, list[str]] = {}
        index_digest: str | None = None
        if media in INDEX_TYPES or "manifests" in doc:
            index_digest = digest
            entries = doc.get("manifests") or []
            for want in spec.platforms:
                match = None
                for m in entries:
                    p = m.get("platform") or {}
                    if platform_matches(want, p.get("os", ""), p.get("architecture", ""), p.get("variant")):
                        match = m
                        break
                if match is None:
                    raise ResolveError(f"{where}: platform {want} is not in the index of {spec.ref}")
                pdigest = str(match.get("digest"))
                man, _, got = reg.manifest(pdigest)
                platforms[want] = got
                env[want] = _env_of(reg.blob_json(str((man.get("config") or {}).get("digest"))))
        elif media in MANIFEST_TYPES or "config" in doc:
            config = reg.blob_json(str((doc.get("config") or {}).get("digest")))
            os_, arch, var = config.get("os", ""), config.get("architecture", ""), config.get("variant")
            for want in spec.platforms:
                if not platform_matches(want, os_, arch, var):
                    have = "/".join(x for x in (os_, arch, var) if x)
                    raise ResolveError(f"{where}: platform {want} is not in {spec.ref} (single-platform "
                                       f"image for {have})")
                platforms[want] = digest
                env[want] = _env_of(config)
        else:
            raise ResolveError(f"{where}: {spec.ref}: unsupported manifest type {media or 'unknown'}")
    except urllib.error.HTTPError as e:
        what = "not found" if e.code == 404 else f"HTTP {e.code}"
        raise ResolveError(f"{where}: {spec.ref}: {what} at {ref.registry}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        raise ResolveError(f"{where}: cannot reach {ref.registry} for {spec.ref}: {network_reason(e)}") from None
    _check_pins(where, spec, index_digest, platforms)

    return LockedBase(spec_hash=spec_hash, ref=spec.ref, index_digest=index_digest, platforms=platforms,
                      source="registry", config_env=env)


def _check_pins(where: str, spec: BaseImage, index_digest: str | None, platforms: dict[str, str]) -> None:
    if spec.digest is not None:
        top = index_digest or (next(iter(platforms.values())) if len(set(platforms.values())) == 1 else None)
        if top != spec.digest:
            raise ResolveError(f"{where}: {spec.ref} resolves to {top}, but the pin says {spec.digest}")
    for plat, want in sorted(spec.platform_digests.items()):
        got = platforms.get(plat)
        if got != want:
            raise ResolveError(f"{where}: platform {plat}: {spec.ref} resolves to {got}, "
                               f"but the pin says {want}")


def _local_inspect(ref: str) -> dict[str, Any] | None:
    """`docker image inspect` of a local image (None when the engine does not have it).

    Through the docker CLI rather than builder.foundation.dockerio: an offline lock should not need the SDK or a
    running engine, and a missing CLI or engine reads as "not in the engine" (the input is named).
    """
    try:
        p = subprocess.run(["docker", "image", "inspect", ref], capture_output=True, timeout=60, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return None
    try:
        data = json.loads(p.stdout)
    except ValueError:
        return None
    return data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None


def local_image(where: str, ref: str, platforms: list[str], why_missing: str) -> dict[str, Any]:
    """The engine's inspect of a local image, checked offline: it is there, has a sha256 id, and is
    every one of the platforms the pin asks for (ResolveError naming ``where`` otherwise)."""
    info = _local_inspect(ref)
    if info is None:
        raise ResolveError(f"{where}: not reachable offline ({ref}{why_missing})")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", str(info.get("Id", ""))):
        raise ResolveError(f"{where}: the local image {ref} has no sha256 id")
    os_, arch, var = str(info.get("Os", "")), str(info.get("Architecture", "")), info.get("Variant")
    for want in platforms:
        if not platform_matches(want, os_, arch, var):
            have = "/".join(x for x in (os_, arch, var) if x)
            raise ResolveError(f"{where}: the local image {ref} is {have}, not {want} (offline)")
    return info


def resolve_local(name: str, spec: BaseImage, spec_hash: str) -> LockedBase:
    where = f"bases.{name}"
    info = local_image(where, spec.ref, spec.platforms, "")
    image_id = str(info["Id"])
    env_list = [str(x) for x in ((info.get("Config") or {}).get("Env") or [])]
    platforms: dict[str, str] = {}
    env: dict[str, list[str]] = {}
    for want in spec.platforms:
        platforms[want] = image_id
        env[want] = env_list
    repo = parse_ref(spec.ref)
    index_digest = None
    for rd in info.get("RepoDigests") or []:
        r, _, d = str(rd).partition("@")
        try:
            pr = parse_ref(r)
        except ConfigError:
            continue
        if (pr.registry, pr.repository) == (repo.registry, repo.repository) and d.startswith("sha256:"):
            index_digest = d
            break
    if spec.digest is not None and index_digest != spec.digest:
        raise ResolveError(f"{where}: the local image {spec.ref} does not carry the pinned digest "
                           f"{spec.digest}")

    return LockedBase(spec_hash=spec_hash, ref=spec.ref, index_digest=index_digest, platforms=platforms,
                      source="local", config_env=env)


def resolve(name: str, spec: BaseImage, *, offline: bool, spec_hash: str) -> LockedBase:
    """Resolve one base image: the registry online, the local Docker engine offline."""
    if spec.ref == "scratch" or spec.ref.startswith("scratch:"):
        raise ConfigError(f"bases.{name}.ref: 'scratch' is not a base; leave the image's base unset")
    try:
        parse_ref(spec.ref)  # bad references are config errors, online or not
    except ConfigError as e:
        raise ConfigError(f"bases.{name}.ref: {e}") from None
    if offline:
        return resolve_local(name, spec, spec_hash)
    return resolve_registry(name, spec, spec_hash)


# ---------------------------------------------------------------------------------------
__all__ = ["resolve", "resolve_registry", "resolve_local", "parse_ref", "ImageRef", "Registry",
           "platform_matches", "docker_config_credentials"]
