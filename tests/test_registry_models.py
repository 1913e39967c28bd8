"""Model files by way of the fleet registry, below the fleet: a REAL registry (Debian's docker-registry, on
loopback) holds each file as a blob whose digest is its sha256 (builder.image.registry.push_blobs: a HEAD
first, each blob once), and the installer's pull (builder.installer.blobs) fetches them, checked by digest;
a faulty link in front of it (tests/lib/blobproxy.py) cuts a pull midway. The manifest's rules for a
file's registry source are checked without any of it."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from builder.errors import UnreachableError
from builder.image import registry
from builder.installer import blobs
from builder.installer.errors import InstallError
from builder.installer.manifest import REGISTRY_CA, check_manifest
from tests.lib import blobproxy, bundlelib, clirun, registrylib, rlib

HEX = "ab" * 32


def _manifest(source: dict[str, Any], files: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "format": 1, "kind": "builder-bundle", "bundle_id": "cd" * 32, "builder": "0", "fleet": "f", "host": "h",
        "lane": "l", "rank": 0, "role": "head", "world_size": 1, "lock_hash": "ef" * 32,
        "image": {"name": "demo", "input_address": "01" * 32, "image_id": "sha256:" + "02" * 32, "diff_ids": [],
                  "archive": None},
        "paths": {"bundles": "/var/lib/builder", "models": "/srv/models", "engram": "/srv/engram"},
        "files": files or [],
        "models": [{"model": "m", "file": "w.bin", "path": "/srv/models/m/w.bin", "size": 3, "sha256": HEX,
                    "bundled": None, "registry": source}],
    }


GOOD = {"url": "https://spark-head:5000", "repository": registry.MODEL_REPOSITORY, "digest": "sha256:" + HEX,
        "ca": None}


def test_a_model_files_registry_source_is_checked() -> None:
    check_manifest(_manifest(GOOD))
    ca_file = {"path": REGISTRY_CA, "size": 1, "sha256": HEX, "mode": "0644"}
    check_manifest(_manifest({**GOOD, "ca": REGISTRY_CA}, [ca_file]))
    for bad, where in [
        ({**GOOD, "digest": "sha256:" + "cd" * 32}, "registry.digest"),
        ({**GOOD, "url": "https://spark-head:5000/v2"}, "registry.url"),
        ({**GOOD, "repository": "../x"}, "registry.repository"),
        ({**GOOD, "ca": REGISTRY_CA}, "registry.ca"),
        ({**GOOD, "extra": 1}, "registry.extra"),
    ]:
        with pytest.raises(InstallError) as e:
            check_manifest(_manifest(bad))
        assert f"models[0].{where}" in str(e.value), (where, str(e.value))


# ----------------------------------------------------------------------------- with a real registry


def _files(folder: Path, sizes: list[int]) -> list[registry.Blob]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, n in enumerate(sizes):
        data = hashlib.sha256(str(i).encode()).digest() * (n // 32) + bytes(n % 32)
        p = folder / f"f{i}.bin"
        p.write_bytes(data)
        out.append(registry.Blob("sha256:" + hashlib.sha256(data).hexdigest(), n, p))
    return out


def _entries(blob_list: list[registry.Blob], url: str, models: Path) -> list[dict[str, Any]]:
    return [{"model": "m", "file": b.path.name, "path": str(models / "m" / b.path.name), "size": b.size,
             "sha256": b.digest.split(":", 1)[1], "bundled": None,
             "registry": {"url": url, "repository": registry.MODEL_REPOSITORY, "digest": b.digest, "ca": None}}
            for b in blob_list]


def _place(pulled: blobs.Pulled) -> None:
    for tmp, dest in pulled.files:
        os.replace(tmp, dest)


@pytest.fixture
def reg(tmp_path: Path) -> Any:
    registrylib.require_parts()
    with registrylib.start_registry(tmp_path / "registry") as r:
        yield r


@pytest.fixture(autouse=True)
def _quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blobs, "RETRY_WAIT", 0.01)


@pytest.mark.registry
def test_each_blob_is_pushed_once_and_pulled_by_digest(tmp_path: Path, reg: registrylib.Registry) -> None:
    files = _files(tmp_path / "src", [3 * 1024 * 1024 + 7, 1000, 0])
    target = registry.parse_target(reg.url, "test")
    assert registry.push_blobs(target, registry.MODEL_REPOSITORY, files + files[:1]) == (3, sum(
        b.size for b in files), 0)
    mark = len(reg.requests())
    assert registry.push_blobs(target, registry.MODEL_REPOSITORY, files) == (0, 0, 3)
    assert reg.blob_puts(mark) == 0
    models = tmp_path / "models"
    entries = _entries(files, reg.url, models)
    mark = len(reg.requests())
    pulled = blobs.pull_models(entries, None, "spark-1")
    _place(pulled)
    assert pulled.tally()["files"] == 3 and pulled.nbytes == sum(b.size for b in files) and pulled.seconds > 0
    for b, m in zip(files, entries, strict=True):
        assert Path(m["path"]).read_bytes() == b.path.read_bytes()
    assert reg.blob_bytes_served(mark, agent="builder-installer/") == sum(b.size for b in files)


@pytest.mark.registry
def test_a_cut_pull_goes_on_from_the_bytes_it_has(tmp_path: Path, reg: registrylib.Registry) -> None:
    files = _files(tmp_path / "src", [2 * 1024 * 1024 + 5])
    registry.push_blobs(registry.parse_target(reg.url, "test"), registry.MODEL_REPOSITORY, files)
    with blobproxy.BlobProxy(reg.url) as proxy:
        proxy.cut_after = 700_000
        entries = _entries(files, proxy.url, tmp_path / "models")
        _place(blobs.pull_models(entries, None, "spark-1"))
        gets = proxy.blob_gets()
    assert Path(entries[0]["path"]).read_bytes() == files[0].path.read_bytes()
    assert [g.range for g in gets] == [None, "bytes=700000-"], gets
    assert sum(g.sent for g in gets) == files[0].size  # no byte sent twice


@pytest.mark.registry
def test_a_pull_the_link_cut_for_good_resumes_at_the_next_install(tmp_path: Path, reg: registrylib.Registry) -> None:
    files = _files(tmp_path / "src", [2 * 1024 * 1024 + 5])
    registry.push_blobs(registry.parse_target(reg.url, "test"), registry.MODEL_REPOSITORY, files)
    with blobproxy.BlobProxy(reg.url, cut_after=900_000, down_after_cut=True) as proxy:
        entries = _entries(files, proxy.url, tmp_path / "models")
        with pytest.raises(InstallError) as e:
            blobs.pull_models(entries, None, "spark-1")
    msg = str(e.value)
    assert msg.startswith(f"host spark-1: model file {entries[0]['path']}: ") and "at byte 900000 of" in msg, msg
    assert not Path(entries[0]["path"]).exists()
    mark = len(reg.requests())
    entries = _entries(files, reg.url, tmp_path / "models")  # the next install, the link back
    pulled = blobs.pull_models(entries, None, "spark-1")
    _place(pulled)
    assert pulled.nbytes == files[0].size - 900_000  # what this pull brought, not the bytes held
    assert Path(entries[0]["path"]).read_bytes() == files[0].path.read_bytes()
    gets = [r for r in reg.requests()[mark:] if r["method"] == "GET" and "/blobs/" in r["path"]]
    assert [(g["status"], g["size"]) for g in gets] == [(206, files[0].size - 900_000)], gets


@pytest.mark.registry
def test_a_wrong_blob_in_the_registry_is_refused_naming_host_and_file(
        tmp_path: Path, reg: registrylib.Registry) -> None:
    files = _files(tmp_path / "src", [100_000])
    registry.push_blobs(registry.parse_target(reg.url, "test"), registry.MODEL_REPOSITORY, files)
    hexd = files[0].digest.split(":", 1)[1]
    data = reg.workdir / "storage" / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexd[:2] / hexd / "data"
    raw = bytearray(data.read_bytes())
    raw[5000] ^= 0xFF
    data.write_bytes(bytes(raw))  # the registry's own storage holds wrong bytes under the digest
    entries = _entries(files, reg.url, tmp_path / "models")
    with pytest.raises(InstallError) as e:
        blobs.pull_models(entries, None, "spark-1")
    msg = str(e.value)
    assert msg.startswith(f"host spark-1: model file {entries[0]['path']}: ") and "refused" in msg, msg
    assert "\n" not in msg
    assert not os.listdir(tmp_path / "models" / "m")  # nothing placed, no temp left


@pytest.mark.registry
def test_an_unreachable_registry_is_one_line_naming_host_file_and_cause(tmp_path: Path) -> None:
    files = _files(tmp_path / "src", [1000])
    url = f"http://127.0.0.1:{registrylib.free_port()}"
    entries = _entries(files, url, tmp_path / "models")
    with pytest.raises(InstallError) as e:
        blobs.pull_models(entries, None, "spark-2")
    msg = str(e.value)
    assert msg.startswith(f"host spark-2: model file {entries[0]['path']}: ") and "cannot reach" in msg, msg
    assert not (tmp_path / "models" / "m" / "f0.bin").exists()
    with pytest.raises(UnreachableError) as u:
        registry.check_blobs_reachable(registry.parse_target(url, "test"), registry.MODEL_REPOSITORY)
    assert "registry 127.0.0.1" in str(u.value)


def test_a_full_disk_is_one_line_naming_host_and_file_before_any_byte_is_pulled(tmp_path: Path) -> None:
    mib = 1024 * 1024
    entries = [{**e, "size": n} for e, n in zip(_entries(_files(tmp_path / "src", [10, 20]), "http://127.0.0.1:9",
                                                        tmp_path / "models"), [100 * mib, 200 * mib], strict=True)]
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(InstallError) as e:  # room for the first file, not for both
        blobs.check_room([], entries, free - 150 * mib, "spark-1")
    msg = str(e.value)
    assert msg.startswith(f"host spark-1: model file {entries[1]['path']}: not enough disk"), msg
    blobs.check_room([], entries, 0, "spark-1")


@pytest.mark.registry
@pytest.mark.docker
def test_a_bundle_folder_installs_its_model_files_from_the_registry(
        tmp_path: Path, reg: registrylib.Registry, request: pytest.FixtureRequest) -> None:
    """The installer's `install` of a bundle folder (sneakernet's path) on a fleet with `models_from =
    "registry"`: the bundle carries no model file, the install pulls them; with the registry down, a
    later install is one line naming the host and the file, and the old release stays current."""
    host = tmp_path / "host"
    p = bundlelib.make_project(tmp_path, hosts=bundlelib.local_hosts(host), docker_image=True,
                               marker=request.node.nodeid)
    try:
        text = bundlelib.fleet_toml(p.hosts, registry=reg.url)
        (p.root / "hosts" / "test.toml").write_text(text.replace("[fleet]\n", '[fleet]\nmodels_from = "registry"\n', 1))
        v1 = bundlelib.bundle(p, tmp_path / "v1", with_models=True)
        models = bundlelib.manifest(v1)["models"]
        assert models and not (v1 / "models").exists()
        assert all(m["registry"]["url"] == reg.url and m["registry"]["ca"] is None for m in models)
        root = host / "builder"
        r = bundlelib.install(v1, root, "--trusted-key", str(p.pub), "--host", "spark-b")
        assert r.returncode == 0, r.stderr
        for m in models:
            assert hashlib.sha256(Path(m["path"]).read_bytes()).hexdigest() == m["sha256"]
        current = os.readlink(root / "current")

        bundlelib.relock(p, streams=3)
        v2 = bundlelib.bundle(p, tmp_path / "v2", with_models=True)
        victim = max(models, key=lambda m: m["size"])
        os.unlink(victim["path"])
        reg.stop()
        r = bundlelib.install(v2, root, "--host", "spark-b")
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert f"host spark-b: model file {victim['path']}: " in line and "cannot reach" in line, r.stderr
        assert os.readlink(root / "current") == current
        assert not [n for n in os.listdir(Path(victim["path"]).parent) if n.startswith(".tmp-")]
        reg.start()
        r = bundlelib.install(v2, root, "--host", "spark-b")
        assert r.returncode == 0, r.stderr
        assert os.readlink(root / "current") == f"releases/{bundlelib.manifest(v2)['bundle_id']}"
    finally:
        subprocess.run(["docker", "image", "rm", "-f", p.image_id], capture_output=True)


@pytest.mark.registry
@pytest.mark.docker
def test_hosts_pull_model_files_through_the_fleets_pull_front(
        tmp_path: Path, reg: registrylib.Registry, request: pytest.FixtureRequest) -> None:
    """`fleet.registry_pull`: the bundles name the front and the pushes still go to `fleet.registry`; the
    install pulls every file through the front, checked by digest. The front is Debian's docker-registry
    as a pull-through cache of the fleet registry, where a P2P engine's registry mirror sits on a host."""
    host = tmp_path / "host"
    p = bundlelib.make_project(tmp_path, hosts=bundlelib.local_hosts(host), docker_image=True,
                               marker=request.node.nodeid)
    try:
        with registrylib.start_registry(tmp_path / "front", proxy_of=reg.url) as front:
            text = bundlelib.fleet_toml(p.hosts, registry=reg.url)
            (p.root / "hosts" / "test.toml").write_text(text.replace(
                "[fleet]\n", f'[fleet]\nmodels_from = "registry"\nregistry_pull = "{front.url}"\n', 1))
            mark = len(reg.requests())
            v1 = bundlelib.bundle(p, tmp_path / "v1", with_models=True)
            models = bundlelib.manifest(v1)["models"]
            assert models and all(m["registry"]["url"] == front.url for m in models)
            distinct = {m["sha256"]: m["size"] for m in models}
            assert reg.blob_puts(mark) == len(distinct) and front.blob_puts() == 0
            r = bundlelib.install(v1, host / "builder", "--trusted-key", str(p.pub), "--host", "spark-b")
            assert r.returncode == 0, r.stderr
            for m in models:
                assert hashlib.sha256(Path(m["path"]).read_bytes()).hexdigest() == m["sha256"]
            assert front.blob_bytes_served(agent="builder-installer/") == sum(m["size"] for m in models)
    finally:
        subprocess.run(["docker", "image", "rm", "-f", p.image_id], capture_output=True)


def test_a_pull_front_needs_models_from_the_registry_and_a_plain_url(tmp_path: Path) -> None:
    root = tmp_path / "p"
    for keys, want in [
        ('registry = "https://spark-head:5000"\nregistry_pull = "http://127.0.0.1:65001"\n',
         'registry_pull needs models_from = "registry"'),
        ('registry = "https://spark-head:5000"\nmodels_from = "registry"\nregistry_pull = "http://127.0.0.1:65001/v2"\n',
         "not a registry URL"),
    ]:
        p = bundlelib.make_project(root / str(len(want)), hosts=bundlelib.local_hosts(tmp_path / "h"))
        text = bundlelib.fleet_toml(p.hosts).replace("[fleet]\n", "[fleet]\n" + keys, 1)
        (p.root / "hosts" / "test.toml").write_text(text)
        r = clirun.run("bundle", "--fleet", bundlelib.FLEET, cwd=p.root, pins=p.root / "pins.toml")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "test.toml" in r.stderr and want in r.stderr, r.stderr


@pytest.mark.registry
def test_a_registry_whose_certificate_fails_is_one_line_at_once(tmp_path: Path) -> None:
    """A misconfigured registry: its TLS certificate is not of the CA the bundle carries. One line naming
    the host, the file and the cause, with no retry (a retry cannot mend a certificate)."""
    other_ca = registrylib.make_ca(tmp_path / "other", "127.0.0.1")[0]
    with registrylib.start_registry(tmp_path / "reg", tls=True) as reg:
        files = _files(tmp_path / "src", [4096])
        registry.push_blobs(registry.parse_target(reg.url, "test", reg.ca), registry.MODEL_REPOSITORY, files)
        entries = _entries(files, reg.url, tmp_path / "models")
        mark = len(reg.requests())
        with pytest.raises(InstallError) as e:
            blobs.pull_models(entries, str(other_ca), "spark-1")
    msg = rlib.assert_one_line(e.value)
    assert msg.startswith(f"host spark-1: model file {entries[0]['path']}: {reg.url}: ") and "certificate" in msg, msg
    assert "fleet.registry_ca" in msg and len(reg.requests()) == mark
    assert not Path(entries[0]["path"]).exists()
