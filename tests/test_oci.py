"""builder.lock.oci, and the registry client it reads through (builder.foundation.distribution), against
a REAL registry on loopback (Debian's docker-registry, tests/lib/registrylib.py) and, offline, against a
local image in the real Docker engine."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.errors import ConfigError, ResolveError
from builder.foundation import distribution
from builder.inputs.pins import BaseImage
from builder.lock import oci
from tests.lib import clirun, factory
from tests.lib.registrylib import (
    DOCKER_MANIFEST,
    Registry,
    registry_available,
    sha256_digest,
    start_registry,
)

H = "0" * 64
NGC_ENV = ["PATH=/usr/local/bin:/usr/bin", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1"]


def test_parse_ref() -> None:
    r = distribution.parse_ref("nvcr.io/nvidia/pytorch:26.07-py3")
    assert (r.registry, r.repository, r.tag, r.digest) == ("nvcr.io", "nvidia/pytorch", "26.07-py3", None)
    assert r.base_url == "https://nvcr.io"
    r = distribution.parse_ref("ubuntu")
    assert (r.registry, r.repository, r.tag) == ("registry-1.docker.io", "library/ubuntu", "latest")
    r = distribution.parse_ref("127.0.0.1:5000/demo/x@sha256:" + "a" * 64)
    assert r.base_url == "http://127.0.0.1:5000" and r.reference == "sha256:" + "a" * 64
    assert distribution.parse_ref("localhost:5000/x:1").base_url == "http://localhost:5000"
    with pytest.raises(ConfigError, match=r"bases\.b\.ref: .*not a valid repository name"):
        oci.resolve("b", BaseImage(ref="Bad/UPPER:1", platforms=["linux/arm64"]), offline=False, spec_hash=H)
    with pytest.raises(ConfigError, match=r"bases\.b\.ref: 'scratch' is not a base"):
        oci.resolve("b", BaseImage(ref="scratch", platforms=["linux/arm64"]), offline=False, spec_hash=H)


def test_platform_matching() -> None:
    assert oci.platform_matches("linux/arm64", "linux", "arm64", "v8")
    assert oci.platform_matches("linux/arm64/v8", "linux", "arm64", None)
    assert not oci.platform_matches("linux/arm64", "linux", "amd64", None)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    if not registry_available():
        pytest.skip("docker-registry is not installed")
    with start_registry(tmp_path / "registry") as reg:
        yield reg


def push_single(reg: Registry, repository: str, tag: str, env: list[str], arch: str = "arm64") -> str:
    config = json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "config": {"Env": env},
            "rootfs": {"type": "layers", "diff_ids": []},
        },
        sort_keys=True,
    ).encode()
    cdigest = reg.push_blob(repository, config)
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": DOCKER_MANIFEST,
            "config": {
                "mediaType": "application/vnd.docker.container.image.v1+json",
                "digest": cdigest,
                "size": len(config),
            },
            "layers": [],
        },
        indent=3,
    ).encode()
    return reg.put_manifest(repository, tag, manifest, DOCKER_MANIFEST)


@pytest.mark.registry
def test_index_digests_from_a_real_registry(registry: Registry) -> None:
    idx = registry.push_index("demo/multi", "v1")
    spec = BaseImage(ref=idx.reference, platforms=["linux/arm64", "linux/amd64"])
    got = oci.resolve("b", spec, offline=False, spec_hash=H)
    assert got.source == "registry" and got.index_digest == idx.digest
    assert got.platforms == {
        "linux/arm64": idx.manifests["linux/arm64"],
        "linux/amd64": idx.manifests["linux/amd64"],
    }
    assert got.config_env == {"linux/arm64": [], "linux/amd64": []}
    # pins that agree pass; pins that disagree name the platform
    ok = spec.model_copy(update={"digest": idx.digest, "platform_digests": dict(idx.manifests)})
    assert oci.resolve("b", ok, offline=False, spec_hash=H) == got
    bad = spec.model_copy(update={"platform_digests": {"linux/arm64": "sha256:" + "1" * 64}})
    with pytest.raises(
        ResolveError, match=r"bases\.b: platform linux/arm64: .* but the pin says sha256:1111"
    ):
        oci.resolve("b", bad, offline=False, spec_hash=H)
    with pytest.raises(ResolveError, match=r"bases\.b: .* resolves to sha256:.*but the pin says sha256:2222"):
        oci.resolve("b", spec.model_copy(update={"digest": "sha256:" + "2" * 64}), offline=False, spec_hash=H)
    # by digest works too
    by_digest = BaseImage(ref=f"{registry.addr}/demo/multi@{idx.digest}", platforms=["linux/arm64"])
    assert oci.resolve("b", by_digest, offline=False, spec_hash=H).index_digest == idx.digest


@pytest.mark.registry
def test_missing_platform_tag_and_registry(registry: Registry) -> None:
    idx = registry.push_index("demo/amd", "v1", platforms=("linux/amd64",))
    with pytest.raises(ResolveError) as ei:
        oci.resolve("b", BaseImage(ref=idx.reference, platforms=["linux/arm64"]), offline=False, spec_hash=H)
    assert str(ei.value) == f"bases.b: platform linux/arm64 is not in the index of {idx.reference}"
    with pytest.raises(ResolveError, match=rf"bases\.b: {registry.addr}/demo/amd:v2: not found at"):
        oci.resolve(
            "b",
            BaseImage(ref=f"{registry.addr}/demo/amd:v2", platforms=["linux/amd64"]),
            offline=False,
            spec_hash=H,
        )
    with pytest.raises(ResolveError, match=r"bases\.b: cannot reach 127\.0\.0\.1:9 for .*refused"):
        oci.resolve(
            "b", BaseImage(ref="127.0.0.1:9/x:1", platforms=["linux/amd64"]), offline=False, spec_hash=H
        )


@pytest.mark.registry
def test_single_manifest_records_platform_and_env(registry: Registry) -> None:
    digest = push_single(registry, "nvidia/pytorch", "26.07-py3", NGC_ENV)
    ref = f"{registry.addr}/nvidia/pytorch:26.07-py3"
    got = oci.resolve("ngc", BaseImage(ref=ref, platforms=["linux/arm64"]), offline=False, spec_hash=H)
    assert got.index_digest is None and got.platforms == {"linux/arm64": digest}
    assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1" in got.config_env["linux/arm64"]
    with pytest.raises(
        ResolveError,
        match=r"platform linux/amd64 is not in .*single-platform image for "
        r"linux/arm64",
    ):
        oci.resolve("ngc", BaseImage(ref=ref, platforms=["linux/amd64"]), offline=False, spec_hash=H)
    assert digest == sha256_digest(registry.get_manifest("nvidia/pytorch", "26.07-py3").body)


@pytest.mark.registry
def test_basic_auth_from_env_and_no_password_in_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not registry_available():
        pytest.skip("docker-registry is not installed")
    with start_registry(tmp_path / "reg", auth=True) as reg:
        idx = reg.push_index("demo/private", "v1")
        spec = BaseImage(ref=idx.reference, platforms=["linux/arm64"])
        with pytest.raises(ResolveError, match="wants credentials"):
            oci.resolve("b", spec, offline=False, spec_hash=H)
        assert reg.username and reg.password
        monkeypatch.setenv("BUILDER_REGISTRY_USER", reg.username)
        monkeypatch.setenv("BUILDER_REGISTRY_PASSWORD", reg.password)
        got = oci.resolve("b", spec, offline=False, spec_hash=H)
        assert got.index_digest == idx.digest
        assert reg.password not in got.model_dump_json()
        monkeypatch.setenv("BUILDER_REGISTRY_PASSWORD", reg.password + "-wrong")
        with pytest.raises(ResolveError) as ei:
            oci.resolve("b", spec, offline=False, spec_hash=H)
        assert "401" in str(ei.value) and reg.password not in str(ei.value)


@pytest.mark.registry
def test_cli_lock_with_a_registry_base(registry: Registry, tmp_path: Path) -> None:
    idx = registry.push_index("demo/base", "v1")
    proj = tmp_path / "proj"
    proj.mkdir()
    base = {"ref": idx.reference, "platforms": ["linux/arm64"]}
    factory.write_pins(proj, factory.pins(bases={"base": base}))
    p = clirun.run("lock", cwd=proj, pins=proj / "pins.toml")
    assert p.returncode == 0, p.stderr
    lock = json.loads((proj / "pins.lock").read_text())
    assert lock["bases"]["base"]["platforms"] == {"linux/arm64": idx.manifests["linux/arm64"]}
    # offline, the registry is not asked; the local engine does not have it: named, exit 1
    factory.write_pins(proj, factory.pins(bases={"base": base | {"note": "edited"}}))
    before = (proj / "pins.lock").read_bytes()
    p = clirun.run("lock", "--offline", cwd=proj, pins=proj / "pins.toml")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert f"error: bases.base: not reachable offline ({idx.reference})" in p.stderr
    # a lock that fails writes nothing (its entry stays, stale for the edited pin, which --check reports)
    assert (proj / "pins.lock").read_bytes() == before


def _docker_ok() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.docker
def test_offline_from_a_local_image() -> None:
    if not _docker_ok():
        pytest.skip("no Docker Engine")
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(
        subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip(), "amd64"
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"hi\n"))
    tag = "builder-test-oci-local:1"
    subprocess.run(
        ["docker", "import", "--change", "ENV TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1", "-", tag],
        input=buf.getvalue(),
        capture_output=True,
        check=True,
    )
    try:
        image_id = subprocess.run(
            ["docker", "image", "inspect", "-f", "{{.Id}}", tag], capture_output=True, text=True, check=True
        ).stdout.strip()
        got = oci.resolve("b", BaseImage(ref=tag, platforms=[f"linux/{arch}"]), offline=True, spec_hash=H)
        assert got.source == "local" and got.platforms == {f"linux/{arch}": image_id}
        assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1" in got.config_env[f"linux/{arch}"]
        other = "arm64" if arch == "amd64" else "amd64"
        with pytest.raises(ResolveError, match=rf"the local image {tag} is linux/{arch}, not linux/{other}"):
            oci.resolve("b", BaseImage(ref=tag, platforms=[f"linux/{other}"]), offline=True, spec_hash=H)
        with pytest.raises(ResolveError) as ei:
            oci.resolve(
                "b",
                BaseImage(ref="builder-test-oci-absent:1", platforms=["linux/arm64"]),
                offline=True,
                spec_hash=H,
            )
        assert str(ei.value) == "bases.b: not reachable offline (builder-test-oci-absent:1)"
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


# --------------------------------------------------------------------------- where credentials go
# A registry on loopback (a real HTTP server) answers 401 with a Bearer challenge; the token service it
# names is another real server. The registry's Basic credentials go to a token service over https, or
# over plain http on the registry's own host (a plain-http registry); a plain-http realm on another host
# is refused before anything is sent there.


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Records each request's path and Authorization header. As a registry: 401 with the challenge
    until a Bearer token comes, then a manifest. As a token service: a token."""

    challenge = ""
    seen: list[tuple[str, str]]

    def do_GET(self) -> None:  # noqa: N802 (the http.server name)
        auth = self.headers.get("Authorization", "")
        self.seen.append((self.path, auth))
        if self.path.startswith("/token"):
            body = json.dumps({"token": "tok"}).encode()
        elif auth != "Bearer tok":
            self.send_response(401)
            self.send_header("WWW-Authenticate", self.challenge)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        else:
            body = b'{"schemaVersion": 2}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _server(ip: str, challenge: str = "") -> Iterator[tuple[str, list[tuple[str, str]]]]:
    seen: list[tuple[str, str]] = []
    handler = type("H", (_Recorder,), {"challenge": challenge, "seen": seen})
    srv = http.server.ThreadingHTTPServer((ip, 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"{ip}:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


def test_credentials_never_go_to_a_plain_http_token_service_on_another_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUILDER_REGISTRY_USER", "builder")
    monkeypatch.setenv("BUILDER_REGISTRY_PASSWORD", "planted-secret-pw")
    with _server("127.0.0.2") as (tokens, token_seen):
        realm = f"http://{tokens}/token"
        with _server("127.0.0.1", f'Bearer realm="{realm}",service="reg"') as (addr, reg_seen):
            reg = distribution.RegistryClient(distribution.parse_ref(f"{addr}/demo/x:v1"))
            with pytest.raises(ResolveError) as ei:
                reg.manifest("v1")
    assert token_seen == []  # nothing at all went to the other host
    assert [a for _, a in reg_seen] == [""]  # the registry itself got no credentials either
    line = str(ei.value)
    assert "\n" not in line and f"registry {addr}" in line and realm in line
    assert "plain http on another host" in line and "planted-secret-pw" not in line


def test_credentials_go_to_the_registrys_own_token_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUILDER_REGISTRY_USER", "builder")
    monkeypatch.setenv("BUILDER_REGISTRY_PASSWORD", "planted-secret-pw")
    with _server("127.0.0.1") as (tokens, token_seen):  # the registry's host (loopback, plain http)
        with _server("127.0.0.1", f'Bearer realm="http://{tokens}/token",service="reg"') as (addr, _):
            doc, _, _ = distribution.RegistryClient(distribution.parse_ref(f"{addr}/demo/x:v1")).manifest("v1")
    assert doc == {"schemaVersion": 2}
    (path, auth), = token_seen
    assert path.startswith("/token?") and auth.startswith("Basic ")
