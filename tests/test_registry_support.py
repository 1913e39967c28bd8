"""What the registry tests share (no tests here): a real registry (Debian's docker-registry, the CNCF
distribution registry) on an address of the test's choosing, with TLS from a CA made in the test and
its access log on, from which the bytes it served are counted; and a copy of the project whose demo
image has two layers (a payload that an engine change leaves alone, then the engine), built by the CLI.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import journeylib  # noqa: E402
import registrylib  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAYLOAD = 2 * 1024 * 1024  # the layer an engine change leaves alone


# --------------------------------------------------------------------------- a test CA


def make_ca(folder: Path, ip: str) -> tuple[Path, Path, Path]:
    """(ca.crt, server.crt, server.key): a CA made here and a server certificate for ``ip`` signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

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


# --------------------------------------------------------------------------- a registry


_ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) (?P<size>\d+|-) '
                     r'"[^"]*" "(?P<agent>[^"]*)"')


@dataclass
class Served:
    workdir: Path
    addr: str  # ip:port it listens on
    process: subprocess.Popen[bytes] = field(repr=False)
    ca: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def scheme(self) -> str:
        return "https" if self.ca else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.addr}"

    @property
    def log(self) -> Path:
        return self.workdir / "registry.log"

    def requests(self) -> list[dict[str, Any]]:
        """Every request the access log holds: method, path, status, bytes of the body served."""
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

    def stop(self) -> None:
        registrylib.stop_process(self.process)

    def start(self) -> None:
        """Start it again (after stop()) on the same address, storage and configuration."""
        self.process = _spawn(self.workdir)
        _wait(self)


def _spawn(workdir: Path) -> subprocess.Popen[bytes]:
    log = open(workdir / "registry.log", "ab")
    try:
        return subprocess.Popen([registrylib.REGISTRY_BIN, "serve", str(workdir / "registry.json")], stdout=log,
                                stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()


def _wait(reg: Served, timeout: float = 20) -> None:
    import ssl

    ctx = ssl.create_default_context(cafile=str(reg.ca)) if reg.ca else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and reg.process.poll() is None:
        try:
            urllib.request.urlopen(f"{reg.url}/v2/", timeout=2, context=ctx)
            return
        except urllib.error.HTTPError as e:
            if e.code == 401:
                return
        except OSError:
            pass
        time.sleep(0.05)
    reg.stop()
    raise RuntimeError(f"docker-registry did not start on {reg.addr}: {reg.log.read_text()[-300:]}")


@contextmanager
def serve(workdir: Path, *, ip: str = "127.0.0.1", tls: bool = False, auth: bool = False) -> Iterator[Served]:
    """docker-registry on ``ip`` (a free port), TLS from a test CA when ``tls``, htpasswd when ``auth``."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port(ip)
    config: dict[str, Any] = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(workdir / "storage")}, "delete": {"enabled": True}},
        "http": {"addr": f"{ip}:{port}", "secret": secrets.token_hex(16)},
    }
    ca = None
    if tls:
        ca, crt, key = make_ca(workdir / "tls", ip)
        config["http"]["tls"] = {"certificate": str(crt), "key": str(key)}
    user = password = None
    if auth:
        user, password = registrylib.DEFAULT_USER, "planted-registry-pw-" + secrets.token_hex(8)
        (workdir / "htpasswd").write_text(registrylib._htpasswd_line(user, password))
        config["auth"] = {"htpasswd": {"realm": "builder-test", "path": str(workdir / "htpasswd")}}
    (workdir / "registry.json").write_text(json.dumps(config, indent=2))
    reg = Served(workdir, f"{ip}:{port}", _spawn(workdir), ca, user, password)
    try:
        _wait(reg)
        yield reg
    finally:
        reg.stop()


def _free_port(ip: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- a project with a two-layer image


def two_layer_project(dest: Path, payload: bytes | None = None) -> Path:
    """A copy of the project whose demo image is a payload layer, then the engine layer. ``payload``:
    the bytes of that layer's file (a fixed pattern by default; give unique bytes for a layer chain no
    other test's image shares)."""
    root = journeylib.project_copy(dest)
    recipe = root / "images" / "demo"
    (recipe / "payload.bin").write_bytes(payload if payload is not None else bytes(range(256)) * (PAYLOAD // 256))
    text = (recipe / "Dockerfile").read_text()
    text = text.replace("FROM scratch\nCOPY --from=build",
                        "FROM scratch\nCOPY payload.bin /usr/share/demo/payload.bin\nCOPY --from=build")
    (recipe / "Dockerfile").write_text(text)
    return root


def local_fleet(root: Path, tmp: Path, keys: Path, name: str = "thin", lane: str = "demo",
                registry: str | None = None) -> None:
    """An inventory of two hosts whose paths lie under ``tmp``: bundles for an installer run here, into a
    root of the test's own (``--root``); ``registry``: its `fleet.registry`."""
    paths = f'{{ models = "{tmp}/srv/models", engram = "{tmp}/srv/engram", bundles = "{tmp}/var" }}'
    text = f'[fleet]\nname = "{name}"\nlane = "{lane}"\ntrusted_key = "{keys / "builder.pub"}"\n'
    if registry is not None:
        text += f'registry = "{registry}"\n'
    for rank, host in enumerate((f"{name}-1", f"{name}-2")):
        text += (f'\n[[hosts]]\nname = "{host}"\nssh = "{host}"\naddress = "192.0.2.{rank + 10}"\nrank = {rank}\n'
                 f'role = "{"head" if rank == 0 else "worker"}"\npaths = {paths}\n')
    (root / "hosts" / f"{name}.toml").write_text(text)


def engine_change(root: Path, version: str = "0.1.1") -> None:
    """Change only the engine: another ENGINE_VERSION compiled in (the payload layer stays)."""
    pins = root / "pins.toml"
    text = pins.read_text()
    want = f'build_args = {{ ZIG_TARGET = "x86_64-linux-musl", ENGINE_VERSION = "{version}" }}'
    new, n = re.subn(r'build_args = \{ ZIG_TARGET = "x86_64-linux-musl"(, ENGINE_VERSION = "[^"]*")? \}', want, text,
                     count=1)
    assert n == 1, "images.demo.build_args not found in pins.toml"
    pins.write_text(new)


def env_for(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BUILDER_", "HF_", "SSH_AUTH", "DOCKER_CONFIG"))}
    env.update(BUILDER_STORE=str(workdir / "store"), HF_HUB_OFFLINE="1", HF_HOME=str(workdir / "hf-home"),
               XDG_CONFIG_HOME=str(workdir / "config"), NO_COLOR="1", DOCKER_CONFIG=str(workdir / "docker-config"))
    wheelhouse = os.environ.get("BUILDER_WHEELHOUSE") or (str(ROOT / ".cache" / "wheelhouse")
                                                         if (ROOT / ".cache" / "wheelhouse").is_dir() else None)
    if wheelhouse:
        env["BUILDER_WHEELHOUSE"] = wheelhouse
    return env


def run_builder(root: Path, env: dict[str, str], *args: str, check: bool = True,
                timeout: float = 900) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([journeylib.BUILDER, *args], cwd=root, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"builder {' '.join(args)}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p
