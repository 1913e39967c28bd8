"""`builder push` against a REAL registry (Debian's docker-registry) on loopback, with htpasswd auth, and
the image built by the CLI in a copy of the project (a two-layer demo image). The registry's own access
log tells what was sent."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from builder.errors import ConfigError
from builder.image import registry as reg
from builder.image.imagerecord import tag_for
from builder.installer.engine import pulled_tag
from tests.lib import projectlib, registrylib

pytestmark = [pytest.mark.registry, pytest.mark.docker, pytest.mark.build]


@dataclass
class Built:
    root: Path
    workdir: Path
    env: dict[str, str]
    record: dict[str, Any]

    def builder(self, *args: str, check: bool = True, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
        return projectlib.run_builder(self.root, {**self.env, **(env or {})}, *args, check=check)

    def record_now(self) -> dict[str, Any]:
        rec: dict[str, Any] = json.loads((self.workdir / "store" / "images" /
                                          f"{self.record['input_address']}.json").read_text())
        return rec


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    registrylib.require_parts()
    workdir = tmp_path_factory.mktemp("push")
    root = projectlib.two_layer_project(workdir / "project")
    env = projectlib.env_for(workdir)
    projectlib.run_builder(root, env, "lock", "--offline", "demo")
    p = projectlib.run_builder(root, env, "image", "demo", "--offline", "--json")
    return Built(root, workdir, env, json.loads(p.stdout))


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[registrylib.Registry]:
    with registrylib.start_registry(tmp_path / "registry", auth=True) as r:
        yield r


def creds(r: registrylib.Registry) -> dict[str, str]:
    assert r.username and r.password
    return {"BUILDER_REGISTRY_USER": r.username, "BUILDER_REGISTRY_PASSWORD": r.password}


def test_the_record_knows_the_manifest_and_the_image_has_two_layers(built: Built) -> None:
    rec = built.record
    assert len(rec["diff_ids"]) == 2 and rec["manifest_digest"].startswith("sha256:")
    assert rec["layer_sizes"][0] > projectlib.PAYLOAD and rec["config_size"] > 0


def test_push_sends_every_blob_then_nothing(built: Built, registry: registrylib.Registry) -> None:
    p = built.builder("push", "demo", "--registry", registry.url, "--json", env=creds(registry))
    first = json.loads(p.stdout)
    rec = built.record_now()
    assert first["manifest_digest"] == rec["manifest_digest"] == built.record["manifest_digest"]
    assert first["reference"] == f"{registry.addr}/builder/demo@{rec['manifest_digest']}"
    assert rec["pushed"] == {registry.addr: first["reference"]}
    assert first["sent_blobs"] == 3 and not first["already"]  # the config and both layers
    assert registry.blob_puts() == 3
    assert first["sent_bytes"] >= sum(rec["layer_sizes"]) + rec["config_size"]

    before = len(registry.requests())
    p = built.builder("push", "demo", "--registry", registry.url, "--json", env=creds(registry))
    again = json.loads(p.stdout)
    assert again["already"] and again["sent_bytes"] == 0 and again["sent_blobs"] == 0
    assert registry.blob_puts(before) == 0  # the registry's own log: no upload
    assert not [r for r in registry.requests()[before:] if r["method"] in ("PUT", "POST", "PATCH")]
    # credentials never in records, output or the store
    assert registry.password is not None
    assert registry.password not in p.stdout + p.stderr
    for f in (built.workdir / "store").rglob("*.json"):
        assert registry.password not in f.read_text(errors="replace"), f


def test_push_sends_only_the_layers_the_registry_lacks(built: Built, registry: registrylib.Registry) -> None:
    """The payload layer already there (pushed under another repository name would not count: the
    same repository), only the config and the engine layer go."""
    built.builder("push", "demo", "--registry", registry.url, env=creds(registry))
    rec = built.record_now()
    engine_layer = rec["diff_ids"][1]
    registry.stop()
    blob = registry.workdir / "storage" / "docker" / "registry" / "v2" / "repositories" / "builder" / "demo"
    shutil.rmtree(blob / "_layers" / "sha256" / engine_layer.removeprefix("sha256:"))
    shutil.rmtree(blob / "_manifests")
    registry.start()
    before = len(registry.requests())
    out = json.loads(built.builder("push", "demo", "--registry", registry.url, "--json", env=creds(registry)).stdout)
    assert out["sent_blobs"] == 1 and out["held_blobs"] == 2
    assert out["sent_bytes"] < rec["layer_sizes"][0]  # not the payload
    assert registry.blob_puts(before) == 1


def test_docker_pulls_what_was_pushed_by_digest(built: Built, tmp_path: Path) -> None:
    """The engine takes the manifest builder pushed (uncompressed OCI layers): a pull by digest gives the
    recorded ImageID. (No auth: the loopback registry docker trusts without TLS.)"""
    with registrylib.start_registry(tmp_path / "open") as r:
        out = json.loads(built.builder("push", "demo", "--registry", r.url, "--json").stdout)
        p = subprocess.run(["docker", "pull", out["reference"]], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        got = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", out["reference"]],
                             capture_output=True, text=True).stdout.strip()
        subprocess.run(["docker", "rmi", out["reference"]], capture_output=True)
        assert got == built.record["image_id"]


def test_credentials_from_the_docker_config(built: Built, registry: registrylib.Registry) -> None:
    cfg = built.workdir / "docker-config"
    cfg.mkdir(exist_ok=True)
    auth = base64.b64encode(f"{registry.username}:{registry.password}".encode()).decode()
    (cfg / "config.json").write_text(json.dumps({"auths": {registry.addr: {"auth": auth}}}))
    try:
        p = built.builder("push", "demo", "--registry", registry.url)
        assert p.stdout.strip().endswith(built.record["manifest_digest"])
    finally:
        (cfg / "config.json").unlink()
    p = built.builder("push", "demo", "--registry", registry.url, check=False)
    assert p.returncode == 1 and "wants credentials" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_credentials_from_a_credential_helper(built: Built, registry: registrylib.Registry, tmp_path: Path) -> None:
    """The docker config names a credential helper for the registry (``credHelpers``, where nvcr.io's
    token lives): builder runs ``docker-credential-<name> get`` as docker does, through the docker SDK,
    and neither prints nor writes what it answers."""
    helpers = tmp_path / "helpers"
    helpers.mkdir()
    exe = helpers / "docker-credential-buildertest"
    answer = json.dumps({"ServerURL": registry.addr, "Username": registry.username, "Secret": registry.password})
    exe.write_text(f"#!/bin/sh\nserver=$(cat)\n[ \"$1\" = get ] && [ \"$server\" = {registry.addr} ] && "
                   f"echo '{answer}'\n")
    exe.chmod(0o755)
    cfg = built.workdir / "docker-config"
    cfg.mkdir(exist_ok=True)
    (cfg / "config.json").write_text(json.dumps({"credHelpers": {registry.addr: "buildertest"}}))
    try:
        env = {"PATH": f"{helpers}{os.pathsep}{os.environ['PATH']}"}
        p = built.builder("push", "demo", "--registry", registry.url, env=env)
        assert p.stdout.strip().endswith(built.record["manifest_digest"])
        assert str(registry.password) not in p.stdout + p.stderr
        for f in (built.workdir / "store").rglob("*"):
            if f.is_file() and f.stat().st_size < 1 << 20:
                assert str(registry.password).encode() not in f.read_bytes(), f
    finally:
        (cfg / "config.json").unlink()


def test_a_missing_credential_helper_is_one_line(built: Built, registry: registrylib.Registry) -> None:
    """The docker config names ``credsStore: foo`` and no ``docker-credential-foo`` is on PATH: a build
    (whose engine request carries every credential the config holds) and a push say so in one line
    naming the config file, the helper and the fix."""
    cfg = built.workdir / "docker-config"
    cfg.mkdir(exist_ok=True)
    (cfg / "config.json").write_text(json.dumps({"credsStore": "foo"}))
    try:
        for args in (("image", "demo", "--offline", "--force"), ("push", "demo", "--registry", registry.url)):
            p = built.builder(*args, check=False)
            assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
            errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
            assert len(errors) == 1, p.stderr
            assert f"{cfg / 'config.json'}: credsStore names the credential helper foo" in errors[0], errors
            assert "docker-credential-foo is not on PATH" in errors[0] and "remove credsStore" in errors[0]
    finally:
        (cfg / "config.json").unlink()


def one_error(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, p.stderr
    return errors[0]


def test_refused_credentials_are_one_line_naming_the_registry_and_the_fix(
        built: Built, registry: registrylib.Registry) -> None:
    wrong = {"BUILDER_REGISTRY_USER": str(registry.username), "BUILDER_REGISTRY_PASSWORD": "not-the-password"}
    line = one_error(built.builder("push", "demo", "--registry", registry.url, check=False, env=wrong))
    assert line.startswith(f"error: registry {registry.addr}: authentication failed (401): "), line
    assert "refused the credentials from BUILDER_REGISTRY_USER and BUILDER_REGISTRY_PASSWORD" in line, line
    assert f"`docker login {registry.addr}`" in line and "not-the-password" not in line
    line = one_error(built.builder("push", "demo", "--registry", registry.url, check=False))
    assert f"{registry.addr}/builder/demo: authentication failed (401)" in line, line
    assert "none are set" in line and f"`docker login {registry.addr}`" in line, line


def test_tls_failures_name_the_registry_the_cause_and_the_fix(built: Built, tmp_path: Path) -> None:
    with registrylib.start_registry(tmp_path / "tls", tls=True) as r:
        assert r.ca is not None
        line = one_error(built.builder("push", "demo", "--registry", r.url, check=False))
        assert line.startswith(f"error: registry {r.addr}: certificate verify failed: "), line
        assert "unable to get local issuer certificate" in line and "--ca FILE" in line, line
        assert "fleet.registry_ca" in line, line
        other, _, _ = registrylib.make_ca(tmp_path / "other-ca", "127.0.0.1")
        line = one_error(built.builder("push", "demo", "--registry", r.url, "--ca", str(other), check=False))
        assert f"the CA file {other} does not sign its certificate" in line, line
        port = r.addr.rsplit(":", 1)[1]
        line = one_error(built.builder("push", "demo", "--registry", f"https://localhost:{port}", "--ca",
                                       str(r.ca), check=False))
        assert line.startswith(f"error: registry localhost:{port}: certificate verify failed: "), line
        assert "not valid for 'localhost'" in line and "a certificate for localhost" in line, line
        p = built.builder("push", "demo", "--registry", r.url, "--ca", str(r.ca))  # the right CA: it goes
        assert p.stdout.strip().endswith(built.record["manifest_digest"])


class StallUploads:
    """A TCP proxy in front of the registry that forwards every request but a blob upload's start
    (POST .../blobs/uploads/), which it holds unanswered: a push stands still with the image's bytes
    spooled from the engine."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.stalled = threading.Event()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._srv.getsockname()[1]}"
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self._srv.close()
        for c in self._held:
            c.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, conn: socket.socket) -> None:
        first = conn.recv(65536)
        if first.startswith(b"POST ") and b"/blobs/uploads/" in first.split(b"\r\n", 1)[0]:
            self._held.append(conn)
            self.stalled.set()
            return
        up = socket.create_connection(self.upstream)

        def copy(a: socket.socket, b: socket.socket) -> None:
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for x in (a, b):
                    try:
                        x.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        up.sendall(first)
        threading.Thread(target=copy, args=(up, conn), daemon=True).start()
        copy(conn, up)


def test_gc_removes_a_killed_push_s_spool_and_keeps_a_live_one(built: Built, tmp_path: Path) -> None:
    """A push spools the image from the engine under the store's tmp/, holding the flock of the spool's
    marker; one killed by SIGKILL (no clean-up runs) leaves the spool, and `builder gc` removes it,
    whoever has its pid since; a push under way keeps its spool."""
    tmp = built.workdir / "store" / "tmp"
    with registrylib.start_registry(tmp_path / "registry") as r:
        proxy = StallUploads(r.addr)
        env = {**built.env, "PYTHONPATH": os.pathsep.join([str(projectlib.clirun.REPO), os.environ.get(
            "PYTHONPATH", "")])}
        push = subprocess.Popen([projectlib.clirun.SCRIPT, "push", "demo", "--registry", proxy.url],
                                cwd=built.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proxy.stalled.wait(120), "the push never started an upload"
            spools = list(tmp.glob(f"push-{push.pid}-*"))
            assert len(spools) == 1, list(tmp.iterdir())
            size = sum(f.stat().st_size for f in spools[0].rglob("*") if f.is_file())
            assert size >= sum(built.record["layer_sizes"]), size  # the image's bytes, spooled
            built.builder("gc")
            assert spools[0].is_dir()  # the push is alive: its spool stays
            push.send_signal(signal.SIGKILL)
            push.wait(30)
            assert push.returncode == -signal.SIGKILL and (spools[0] / ".live").is_file()
            # its pid taken by another process since (here this test's): the free marker still says stale
            reused = spools[0].rename(tmp / f"push-{os.getpid()}-reused")
            p = built.builder("gc")
            assert not reused.exists(), p.stderr
            assert not list(tmp.glob("push-*")), list(tmp.iterdir())
        finally:
            if push.poll() is None:
                push.kill()
                push.wait(30)
            proxy.close()


def test_a_registry_serving_other_bytes_is_caught(built: Built, registry: registrylib.Registry) -> None:
    """The registry's storage changed under it (the config blob's bytes): the check after the push reads
    the config back, and refuses."""
    built.builder("push", "demo", "--registry", registry.url, env=creds(registry))
    cfg_hex = built.record["image_id"].removeprefix("sha256:")
    blobs = registry.workdir / "storage" / "docker" / "registry" / "v2" / "blobs" / "sha256"
    data = blobs / cfg_hex[:2] / cfg_hex / "data"
    doc = json.loads(data.read_bytes())
    doc["rootfs"]["diff_ids"].reverse()
    data.write_bytes(json.dumps(doc).encode())
    p = built.builder("push", "demo", "--registry", registry.url, check=False, env=creds(registry))
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and registry.addr in errors[0] and "hashes to" in errors[0], p.stderr
    assert "Traceback" not in p.stderr


def test_a_registry_that_is_down_is_one_line(built: Built, tmp_path: Path) -> None:
    with registrylib.start_registry(tmp_path / "gone") as r:
        url = r.url
    p = built.builder("push", "demo", "--registry", url, check=False)
    assert p.returncode == 3 and p.stderr.count("\n") == 1, p.stderr
    assert url.removeprefix("http://") in p.stderr and "cannot reach" in p.stderr


def test_bad_registry_urls_are_refused_before_anything(built: Built) -> None:
    for url, says in (("http://203.0.113.7:5000", "plain http is for a loopback registry"),
                      ("https://someone:s3cret-planted@203.0.113.7:5000", "credentials do not belong"),
                      ("ftp://203.0.113.7", "not a registry URL")):
        p = built.builder("push", "demo", "--registry", url, check=False)
        assert p.returncode == 2 and says in p.stderr and "--registry" in p.stderr, p.stderr
        assert "s3cret-planted" not in p.stderr and "Traceback" not in p.stderr
    p = built.builder("image", "demo", "--push", "http://203.0.113.7:5000", check=False)
    assert p.returncode == 2 and "plain http" in p.stderr


def test_the_installer_tags_a_pulled_image_as_a_build_does() -> None:
    assert pulled_tag({"name": "demo", "input_address": "ab" * 32}) == tag_for("demo", "ab" * 32)


def test_parse_target() -> None:
    t = reg.parse_target("https://spark-head:5000", "fleet.registry")
    assert (t.registry, t.scheme, t.url) == ("spark-head:5000", "https", "https://spark-head:5000")
    assert reg.parse_target("127.0.0.1:5000", "x").scheme == "https"
    assert reg.parse_target("http://[::1]:5000", "x").registry == "[::1]:5000"
    with pytest.raises(ConfigError, match="fleet.registry: not a registry URL"):
        reg.parse_target("https://h:5000/path", "fleet.registry")
    with pytest.raises(ConfigError, match="CA file not found"):
        reg.parse_target("https://h:5000", "x", "/nonexistent/ca.crt")


def test_a_record_of_an_older_build_is_pushed_from_the_engine(built: Built, registry: registrylib.Registry) -> None:
    """A record written before manifests were recorded: the image is read from the engine, pushed, and the
    record learns its manifest (the next push needs the engine no more)."""
    path = built.workdir / "store" / "images" / f"{built.record['input_address']}.json"
    saved = path.read_text()
    try:
        old = json.loads(saved)
        for k in ("manifest_digest", "config_size", "layer_sizes", "pushed"):
            old.pop(k, None)
        path.write_text(json.dumps(old))
        out = json.loads(built.builder("push", "demo", "--registry", registry.url, "--json",
                                       env=creds(registry)).stdout)
        assert out["manifest_digest"] == built.record["manifest_digest"] and out["sent_blobs"] == 3
        rec = built.record_now()
        assert rec["layer_sizes"] == built.record["layer_sizes"] and rec["config_size"] == built.record["config_size"]
        again = json.loads(built.builder("push", "demo", "--registry", registry.url, "--json",
                                         env=creds(registry)).stdout)
        assert again["already"]
    finally:
        path.write_text(saved)


def test_a_push_after_a_recipe_change_is_refused_before_any_request(
        built: Built, registry: registrylib.Registry) -> None:
    """Once a recipe file changes the plan refuses the stale lock and nothing is sent; put back, the
    push finds what the registry holds again."""
    def push(check: bool = True) -> subprocess.CompletedProcess[str]:
        return built.builder("push", "demo", "--registry", registry.url, "--json", check=check, env=creds(registry))

    for _ in range(2):
        assert json.loads(push().stdout)["manifest_digest"] == built.record["manifest_digest"]
    dockerfile = built.root / "images" / "demo" / "Dockerfile"
    saved = dockerfile.read_bytes()
    mark = len(registry.requests())
    dockerfile.write_bytes(saved + b"\n# changed\n")
    try:
        p = push(check=False)
        assert p.returncode == 2 and "stale for image demo" in p.stderr and "Dockerfile" in p.stderr, p.stderr
        assert registry.requests()[mark:] == []  # refused before the registry was asked anything
    finally:
        dockerfile.write_bytes(saved)
    out = json.loads(push().stdout)
    assert out["already"] is True and out["manifest_digest"] == built.record["manifest_digest"]


def test_a_read_refused_twice_is_one_line_naming_the_registry_and_the_fix(
        registry: registrylib.Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `builder lock` asks of a registry (a manifest, to pin a published image) refused with the
    credentials it wanted: the same one line as a push's, for an account that may pull."""
    from builder.errors import ResolveError
    from builder.foundation import distribution

    monkeypatch.setenv("BUILDER_REGISTRY_USER", str(registry.username))
    monkeypatch.setenv("BUILDER_REGISTRY_PASSWORD", "not-the-password")
    ref = distribution.ImageRef(registry=registry.addr, repository="builder/demo", tag="v1", digest=None,
                                scheme="http")
    with pytest.raises(ResolveError) as e:
        distribution.RegistryClient(ref).manifest("v1")
    line = str(e.value)
    assert line.startswith(f"registry {registry.addr}: authentication failed (401): it refused the credentials "
                           "from BUILDER_REGISTRY_USER and BUILDER_REGISTRY_PASSWORD"), line
    assert "may pull there" in line and "\n" not in line and "not-the-password" not in line, line
