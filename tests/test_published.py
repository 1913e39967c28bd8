"""A published image, run as it is, against a REAL registry (Debian's docker-registry on loopback) and this
machine's Docker Engine: an image built here (a two-layer demo image of its own) is pushed, then named by
digest in the pins as `[images.pub] published = ...`; `builder lock` resolves it through the registry,
`builder image pub` pulls it by digest and records it, `builder bundle --with-image` carries it and the
real installer loads it into a root of the test's own. A manifest or config that does not match the pin
is refused in one line; so is a tag without a digest."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.lib import projectlib, registrylib

pytestmark = [pytest.mark.registry, pytest.mark.docker, pytest.mark.build]


def _docker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)


@dataclass
class Published:
    root: Path
    workdir: Path
    env: dict[str, str]
    registry: registrylib.Registry
    built: dict[str, Any]  # the record of the image built here, then pushed
    reference: str  # host:port/builder/demo@sha256:...
    keys: Path

    def builder(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return projectlib.run_builder(self.root, self.env, *args, check=check)

    def pin(self, published: str) -> None:
        projectlib.pin_published(self.root, published)

    def locked(self) -> dict[str, Any]:
        entry: dict[str, Any] = json.loads((self.root / "pins.lock").read_text())["images"]["pub"]
        return entry

    def blob(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return self.registry.workdir / "storage" / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexd[:2] / \
            hexd / "data"


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Published]:
    registrylib.require_parts()
    workdir = tmp_path_factory.mktemp("published")
    # a payload no other image shares: this image's ImageID is this test's alone, so removing it is safe
    root = projectlib.two_layer_project(workdir / "project", secrets.token_bytes(projectlib.PAYLOAD))
    env = projectlib.env_for(workdir)
    keys = workdir / "keys"
    projectlib.run_builder(root, env, "keygen", "--out", str(keys))
    projectlib.local_fleet(root, workdir, keys, name="pub")
    projectlib.run_builder(root, env, "lock", "--offline", "demo")
    projectlib.run_builder(root, env, "fetch", "demo", "--offline")
    built = json.loads(projectlib.run_builder(root, env, "image", "demo", "--offline", "--json").stdout)
    with registrylib.start_registry(workdir / "registry") as reg:
        out = json.loads(projectlib.run_builder(root, env, "push", "demo", "--registry", reg.url, "--json").stdout)
        # from here on the image exists only in the registry: `builder image pub` must pull it
        assert _docker("rmi", "--force", built["image_id"]).returncode == 0
        p = Published(root, workdir, env, reg, built, out["reference"], keys)
        p.pin(p.reference)
        yield p
    _docker("rmi", "--force", built["image_id"])


def test_lock_image_bundle_install(published: Published) -> None:
    p = published
    p.builder("lock", "pub")
    entry = p.locked()
    digest = p.reference.rsplit("@", 1)[1]
    assert entry["published"] == p.reference and entry["source"] == "registry"
    assert entry["manifest_digest"] == digest == p.built["manifest_digest"]
    assert entry["image_id"] == p.built["image_id"] and entry["diff_ids"] == p.built["diff_ids"]
    p.builder("lock", "--check", "pub")

    assert _docker("image", "inspect", p.built["image_id"]).returncode != 0
    rec = json.loads(p.builder("image", "pub", "--json").stdout)
    assert rec["built"] is True and rec["published"] == p.reference
    assert rec["image_id"] == p.built["image_id"] and rec["diff_ids"] == p.built["diff_ids"]
    assert rec["tag"] == f"builder/pub:{rec['input_address'][:32]}"
    got = _docker("image", "inspect", "--format", "{{.Id}}", rec["tag"]).stdout.strip()
    assert got == p.built["image_id"]  # pulled by digest, tagged as a build is
    assert rec["labels"]["io.builder.input-address"] == p.built["input_address"]  # the image's own labels
    again = p.builder("image", "pub", "--json")
    assert json.loads(again.stdout)["built"] is False and "up to date" in again.stderr

    # offline: the lock keeps what it holds, with the registry gone
    p.registry.stop()
    try:
        before = (p.root / "pins.lock").read_bytes()
        p.builder("lock", "--offline", "pub")
        assert (p.root / "pins.lock").read_bytes() == before
    finally:
        p.registry.start()

    out = p.workdir / "bundle"
    p.builder("bundle", "pub/pub-1", "--with-image", "--with-models", "--key", str(p.keys / "builder.key"),
              "--out", str(out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["image"]["image_id"] == p.built["image_id"] and manifest["image"]["name"] == "pub"
    assert manifest["image"]["archive"]  # a fleet with no registry: the archive, as for a built image

    assert _docker("rmi", "--force", p.built["image_id"]).returncode == 0
    installed = subprocess.run([sys.executable, str(out / "install.pyz"), "install", str(out), "--root",
                                str(p.workdir / "root"), "--trusted-key", str(p.keys / "builder.pub")],
                               capture_output=True, text=True, timeout=600,
                               env={**os.environ, "DOCKER_CONFIG": str(p.workdir / "docker-config")})
    assert installed.returncode == 0, installed.stderr
    assert _docker("image", "inspect", "--format", "{{.Id}}", rec["tag"]).stdout.strip() == p.built["image_id"]
    assert (p.workdir / "root" / "current").is_symlink()

    # a fleet with a registry of its own: the bundle names the image by digest, the installer pulls it
    projectlib.local_fleet(p.root, p.workdir, p.keys, name="pubreg", registry=p.registry.url)
    out = p.workdir / "bundle-reg"
    p.builder("bundle", "pubreg/pubreg-1", "--with-image", "--with-models", "--key", str(p.keys / "builder.key"),
              "--out", str(out))
    image = json.loads((out / "manifest.json").read_text())["image"]
    assert image["image_id"] == p.built["image_id"] and image["archive"] is None
    assert image["pull"] == f"{p.registry.addr}/builder/pub@{p.built['manifest_digest']}"
    assert _docker("rmi", "--force", p.built["image_id"]).returncode == 0
    installed = subprocess.run([sys.executable, str(out / "install.pyz"), "install", str(out), "--root",
                                str(p.workdir / "root-reg"), "--trusted-key", str(p.keys / "builder.pub")],
                               capture_output=True, text=True, timeout=600,
                               env={**os.environ, "DOCKER_CONFIG": str(p.workdir / "docker-config")})
    assert installed.returncode == 0, installed.stderr
    assert _docker("image", "inspect", "--format", "{{.Id}}", rec["tag"]).stdout.strip() == p.built["image_id"]


def _one_error(proc: subprocess.CompletedProcess[str]) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


def test_a_wrong_digest_is_refused_and_the_lock_keeps_its_entry(published: Published) -> None:
    p = published
    p.builder("lock", "pub")
    before = p.locked()
    wrong = p.reference.rsplit("@", 1)[0] + "@sha256:" + secrets.token_hex(32)
    p.pin(wrong)
    try:
        proc = p.builder("lock", "pub", check=False)
        assert proc.returncode == 1
        line = _one_error(proc)
        assert "images.pub" in line and "not found" in line and p.registry.addr in line, line
        assert p.locked() == before  # the last complete resolution stays (stale for the new pin)
        proc = p.builder("image", "pub", check=False)
        assert proc.returncode == 2 and "stale" in _one_error(proc)
    finally:
        p.pin(p.reference)


@pytest.mark.parametrize("what", ["manifest", "config"])
def test_registry_content_that_does_not_hash_to_the_pin_is_refused(published: Published, what: str) -> None:
    p = published
    p.builder("lock", "pub")
    digest = p.reference.rsplit("@", 1)[1] if what == "manifest" else p.built["image_id"]
    blob = p.blob(digest)
    saved = blob.read_bytes()
    doc = json.loads(saved)
    if what == "manifest":
        doc["layers"].reverse()
    else:
        doc["rootfs"]["diff_ids"].reverse()
    blob.write_bytes(json.dumps(doc).encode())
    try:
        proc = p.builder("lock", "--update", "pub", "pub", check=False)
        assert proc.returncode == 1
        line = _one_error(proc)
        assert "images.pub" in line and re.search(r"hashes to|does not match", line), line
    finally:
        blob.write_bytes(saved)


def test_a_tag_without_a_digest_is_one_line(published: Published) -> None:
    p = published
    lock_before = (p.root / "pins.lock").read_bytes()
    p.pin(p.reference.rsplit("@", 1)[0] + ":latest")
    try:
        proc = p.builder("lock", "pub", check=False)
        assert proc.returncode == 2
        line = _one_error(proc)
        assert "pins.toml: images.pub.published:" in line and "names a tag, not a digest" in line, line
        assert (p.root / "pins.lock").read_bytes() == lock_before
    finally:
        p.pin(p.reference)


def test_offline_image_does_not_pull(published: Published) -> None:
    p = published
    p.builder("lock", "pub")
    _docker("rmi", "--force", p.built["image_id"])
    proc = p.builder("image", "pub", "--offline", check=False)
    assert proc.returncode == 1
    assert "--offline does not pull" in _one_error(proc)
