"""The test registry: Debian's ``docker-registry`` (the CNCF distribution registry, 2.8), started one way.

    from tests.lib.registrylib import start_registry

    with start_registry(tmp_path, auth=True) as reg:          # htpasswd (bcrypt) basic auth
        idx = reg.push_index("demo/multi", "v1")               # OCI index, amd64 + arm64, pure HTTP
        idx.digest, idx.manifests["linux/arm64"]                # what was computed = what the registry says
        reg.blob_bytes_served(mark)                             # bytes its access log says it served

    with start_registry(tmp_path, ip=gateway, tls=True) as reg:   # on the test fleet's network, TLS
        reg.ca                                                  # the CA made here, for dockerd and builder

By default it listens on 127.0.0.1 (Docker treats 127.0.0.0/8 as an insecure-allowed registry, so
``docker push 127.0.0.1:PORT/...`` needs no daemon config); ``ip`` puts it on another address (the test
fleet's gateway), ``tls`` serves a certificate for that address from a CA made in the test. Storage,
config, TLS files, htpasswd and the log (with the access log, from which served bytes are counted) all
live under workdir. ``stop()`` (or leaving ``with``) ends it; ``start()`` starts it again on the same address and
storage. The planted password is a test value; it never appears in this object's repr.
"""

from __future__ import annotations

import base64
import datetime
import gzip
import hashlib
import io
import ipaddress
import json
import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt  # distribution's htpasswd accepts bcrypt only; bcrypt comes with paramiko
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.lib.fleetlib import docker_available

REGISTRY_BIN = "docker-registry"
DEFAULT_USER = "builder-test"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
ACCEPT_ALL = ", ".join([OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST])

def require_parts() -> None:
    """Skip when docker-registry or the Docker Engine is missing here; under CI, where .ci/run installs
    both, fail instead."""
    missing = None
    if shutil.which(REGISTRY_BIN) is None:
        missing = "docker-registry is not installed (apt-get install docker-registry)"
    elif not docker_available():
        missing = "no Docker Engine"
    if missing is not None:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(missing)


def credential_helper(folder: Path, name: str, book: dict[str, list[str]]) -> Path:
    """The FAKE `docker-credential-NAME` (tests/lib/fake_credential_helper.py) in `folder` (for PATH),
    answering with `book` (server -> [user, secret]); the servers it is asked for go to folder/asked."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "book.json").write_text(json.dumps(book))
    exe = folder / f"docker-credential-{name}"
    exe.write_bytes((Path(__file__).resolve().parent / "fake_credential_helper.py").read_bytes())
    exe.chmod(0o755)
    return folder


_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) (?P<size>\d+|-) '
                     r'"[^"]*" "(?P<agent>[^"]*)"')


class RegistryError(RuntimeError):
    """The test registry failed to start or refused a request (one line)."""


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def registry_available() -> bool:
    return shutil.which(REGISTRY_BIN) is not None


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class PushedManifest:
    platform: str  # "linux/arm64"
    digest: str  # sha256 of the manifest bytes as pushed
    config_digest: str
    layer_digests: tuple[str, ...]
    diff_ids: tuple[str, ...]
    raw: bytes = field(repr=False)


@dataclass(frozen=True)
class PushedIndex:
    repository: str
    tag: str
    digest: str  # sha256 of the index bytes as pushed
    manifests: dict[str, str]  # "linux/amd64" -> manifest digest
    details: tuple[PushedManifest, ...]
    raw: bytes = field(repr=False)
    reference: str = ""  # 127.0.0.1:PORT/repo:tag


@dataclass
class Registry:
    """A running registry. Use :func:`start_registry`."""

    workdir: Path
    addr: str  # ip:port it listens on, the registry part of image references
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca: Path | None = None  # the test CA's certificate, when it serves TLS
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)  # None until start()

    @property
    def url(self) -> str:
        return f"{'https' if self.ca else 'http'}://{self.addr}"

    @property
    def log(self) -> Path:
        return self.workdir / "registry.log"

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def start(self, timeout: float = 20) -> None:
        """Start it (again, after stop()) on its address, storage and configuration; return once
        ``/v2/`` answers."""
        with open(self.log, "ab") as log:
            process = subprocess.Popen([REGISTRY_BIN, "serve", str(self.workdir / "registry.json")],
                                       stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        self.process = process
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if self.request("GET", "/v2/", auth=False, timeout=2).status in (200, 401):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        last = self.log.read_text(errors="replace").strip()[-300:]
        raise RegistryError(f"{REGISTRY_BIN}: did not start on {self.addr}: {last}")

    # ---- its access log

    def requests(self) -> list[dict[str, Any]]:
        """Every request the access log holds: method, path, status, bytes of the body served, agent."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            m = _ACCESS.search(line)
            if m:
                size = m["size"]
                out.append({"method": m["method"], "path": m["path"], "status": int(m["status"]),
                            "size": 0 if size == "-" else int(size), "agent": m["agent"]})
        return out

    def blob_bytes_served(self, since: int = 0, agent: str = "docker/") -> int:
        """Bytes of blobs the registry sent (GET .../blobs/sha256:..., 200) from request ``since`` on, to
        clients whose User-Agent starts with ``agent`` (by default Docker Engines pulling, not builder's
        own read-back after a push)."""
        return sum(r["size"] for r in self.requests()[since:]
                   if r["method"] == "GET" and "/blobs/sha256:" in r["path"] and r["status"] == 200
                   and r["agent"].startswith(agent))

    def blob_puts(self, since: int = 0) -> int:
        return sum(1 for r in self.requests()[since:] if r["method"] == "PUT" and "/blobs/uploads/" in r["path"])

    # ---- HTTP

    def request(
        self,
        method: str,
        path: str,
        data: bytes | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        auth: bool | tuple[str, str] = True,
        timeout: float = 30,
    ) -> Response:
        """One HTTP request to the registry API (``path`` like ``/v2/``). Non-2xx answers are returned,
        not raised. ``auth``: True = the registry's credentials, False = none, (user, pw) = those."""
        url = path if path.startswith("http") else self.url + path
        req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
        creds = (self.username, self.password) if auth is True else auth or None
        if creds and creds[0] is not None:
            token = base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        ctx = ssl.create_default_context(cafile=str(self.ca)) if self.ca else None
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
                return Response(r.status, dict(r.headers.items()), r.read())
        except urllib.error.HTTPError as e:
            return Response(e.code, dict(e.headers.items()), e.read())

    def _ok(self, resp: Response, what: str, *codes: int) -> Response:
        if resp.status not in (codes or (200, 201, 202)):
            raise RegistryError(f"{self.addr}: {what}: HTTP {resp.status}: {resp.body[:200]!r}")
        return resp

    def push_blob(self, repository: str, data: bytes) -> str:
        """Monolithic blob upload (POST then PUT ?digest=). Returns the digest."""
        digest = sha256_digest(data)
        if self.request("HEAD", f"/v2/{repository}/blobs/{digest}").status == 200:
            return digest
        start = self._ok(self.request("POST", f"/v2/{repository}/blobs/uploads/"), "start upload", 202)
        location = start.headers.get("Location") or start.headers.get("location") or ""
        if location.startswith("/"):
            location = self.url + location
        sep = "&" if "?" in location else "?"
        put = self.request(
            "PUT",
            f"{location}{sep}digest={digest}",
            data,
            headers={"Content-Type": "application/octet-stream"},
        )
        self._ok(put, f"upload {digest}", 201)
        return digest

    def put_manifest(self, repository: str, reference: str, raw: bytes, media_type: str) -> str:
        """PUT a manifest or index as these exact bytes; check the registry's digest equals ours."""
        resp = self._ok(
            self.request(
                "PUT", f"/v2/{repository}/manifests/{reference}", raw, headers={"Content-Type": media_type}
            ),
            f"put manifest {reference}",
            201,
        )
        ours = sha256_digest(raw)
        theirs = resp.headers.get("Docker-Content-Digest")
        if theirs != ours:
            raise RegistryError(f"{self.addr}: manifest {reference}: registry says {theirs}, computed {ours}")
        return ours

    def get_manifest(
        self, repository: str, reference: str, accept: str = ACCEPT_ALL, auth: bool | tuple[str, str] = True
    ) -> Response:
        return self.request(
            "GET", f"/v2/{repository}/manifests/{reference}", headers={"Accept": accept}, auth=auth
        )

    # ---- pushes

    def push_index(
        self,
        repository: str,
        tag: str,
        platforms: Sequence[str] = ("linux/amd64", "linux/arm64"),
        files: Mapping[str, bytes] | None = None,
    ) -> PushedIndex:
        """Push an OCI image index with one image manifest per platform, each with one gzip layer
        (``files`` plus a file naming the platform, so every platform's digests differ) and an OCI config.
        All bytes are built here deterministically (same inputs, same digests) and sent with plain HTTP."""
        details: list[PushedManifest] = []
        entries: list[dict[str, Any]] = []
        for plat in platforms:
            os_name, arch, *variant = plat.split("/")
            content = dict(files or {})
            content["etc/builder-test-platform"] = f"{plat}\n".encode()
            layer_tar = _deterministic_tar(content)
            layer = gzip.compress(layer_tar, mtime=0)
            diff_id = sha256_digest(layer_tar)
            config: dict[str, Any] = {
                "architecture": arch,
                "os": os_name,
                "config": {"Entrypoint": ["/bin/sh"], "Labels": {"builder-test.platform": plat}},
                "rootfs": {"type": "layers", "diff_ids": [diff_id]},
                "history": [{"created_by": "registrylib.push_index"}],
            }
            if variant:
                config["variant"] = variant[0]
            config_raw = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
            config_digest = self.push_blob(repository, config_raw)
            layer_digest = self.push_blob(repository, layer)
            manifest = {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config_raw)},
                "layers": [{"mediaType": OCI_LAYER_GZIP, "digest": layer_digest, "size": len(layer)}],
            }
            raw = json.dumps(manifest, indent=2, sort_keys=True).encode()
            digest = self.put_manifest(repository, sha256_digest(raw), raw, OCI_MANIFEST)
            platform: dict[str, str] = {"architecture": arch, "os": os_name}
            if variant:
                platform["variant"] = variant[0]
            entries.append(
                {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(raw), "platform": platform}
            )
            details.append(PushedManifest(plat, digest, config_digest, (layer_digest,), (diff_id,), raw))
        index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": entries}
        raw_index = json.dumps(index, indent=2, sort_keys=True).encode()
        index_digest = self.put_manifest(repository, tag, raw_index, OCI_INDEX)
        return PushedIndex(
            repository,
            tag,
            index_digest,
            {d.platform: d.digest for d in details},
            tuple(details),
            raw_index,
            f"{self.addr}/{repository}:{tag}",
        )


def _deterministic_tar(files: Mapping[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs: set[str] = set()
        for name in sorted(files):
            parts = name.strip("/").split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    ti = tarfile.TarInfo(d)
                    ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 0
                    tar.addfile(ti)
            ti = tarfile.TarInfo("/".join(parts))
            ti.size, ti.mode, ti.mtime = len(files[name]), 0o644, 0
            tar.addfile(ti, io.BytesIO(files[name]))
    return buf.getvalue()


def _htpasswd_line(user: str, password: str) -> str:
    return f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()}\n"


def make_ca(folder: Path, ip: str) -> tuple[Path, Path, Path]:
    """(ca.crt, server.crt, server.key): a CA made here and a server certificate for ``ip`` signed by it."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "builder test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ip)])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    paths[2].chmod(0o600)
    return paths


def start_registry(
    workdir: Path | str,
    *,
    ip: str = "127.0.0.1",
    tls: bool = False,
    auth: bool = False,
    username: str = DEFAULT_USER,
    password: str | None = None,
    port: int | None = None,
    proxy_of: str | None = None,
) -> Registry:
    """Start ``docker-registry`` on ``ip`` (a free port unless given) with storage under workdir; TLS from
    a test CA made here with ``tls``; with ``auth``, htpasswd basic auth for ``username`` and ``password``
    (a random planted test value if None; read it back from ``.password``); with ``proxy_of`` (a
    registry's URL), a pull-through cache of that registry, as a registry mirror in front of it. Returns
    once ``/v2/`` answers; stop() or ``with`` ends it."""
    if not registry_available():
        raise RegistryError(f"{REGISTRY_BIN}: not installed (apt-get install docker-registry)")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if auth and password is None:
        password = "planted-registry-pw-" + secrets.token_hex(8)
    ca = None
    http: dict[str, Any] = {"secret": secrets.token_hex(16)}
    if tls:
        ca, crt, key = make_ca(workdir / "tls", ip)
        http["tls"] = {"certificate": str(crt), "key": str(key)}
    config: dict[str, Any] = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(workdir / "storage")}, "delete": {"enabled": True}},
        "http": http,
    }
    if proxy_of is not None:
        config["proxy"] = {"remoteurl": proxy_of}
    if auth:
        assert password is not None
        htpasswd = workdir / "htpasswd"
        htpasswd.write_text(_htpasswd_line(username, password))
        htpasswd.chmod(0o600)
        config["auth"] = {"htpasswd": {"realm": "builder-test", "path": str(htpasswd)}}
    error = RegistryError(f"{REGISTRY_BIN}: did not start")
    for _attempt in range(1 if port else 3):  # a free port can be taken before the registry binds it
        http["addr"] = f"{ip}:{port or free_port(ip)}"
        cfg = workdir / "registry.json"  # YAML parser, JSON syntax
        cfg.write_text(json.dumps(config, indent=2))
        cfg.chmod(0o600)
        reg = Registry(workdir, http["addr"], username if auth else None, password if auth else None, ca)
        try:
            reg.start()
            return reg
        except RegistryError as e:
            error = e
    raise error
