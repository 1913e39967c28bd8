"""Thin bundles on THIS machine's Docker Engine: `builder bundle --with-image --thin --have FILE` packs
only the layers the host lacks, and the installer (run here, into a root of the test's own) loads it
with `docker load` when the engine holds the layers left out, and refuses before changing anything
when it does not.

The finding this tests: Docker Engine with the classic image store (this machine's 20.10, overlay or
fuse-overlayfs) loads an archive whose manifest.json lists a layer the archive lacks, as long as the
engine holds that layer's chain: the loader looks the chain up first and reads the file only when
it is absent. An engine keeping images in containerd (the containerd snapshotter) needs every blob;
the installer refuses a thin bundle there (`check_thin`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lib import clirun, projectlib

pytestmark = [pytest.mark.docker, pytest.mark.build, pytest.mark.registry]


def _fleet(root: Path, tmp: Path, keys: Path) -> None:
    projectlib.local_fleet(root, tmp, keys)


def _docker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)


def test_a_thin_bundle_carries_only_the_missing_layer_and_loads(tmp_path: Path) -> None:
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip("no Docker Engine")
    # a payload no other image on the engine shares, so its layer chain is this test's alone
    payload = secrets.token_bytes(projectlib.PAYLOAD)
    root = projectlib.two_layer_project(tmp_path / "project", payload)
    env = projectlib.env_for(tmp_path)
    keys = tmp_path / "keys"

    def builder(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return projectlib.run_builder(root, env, *args, check=check)

    builder("keygen", "--out", str(keys))
    _fleet(root, tmp_path, keys)
    builder("lock", "--offline", "demo")
    builder("fetch", "demo", "--offline")
    old = json.loads(builder("image", "demo", "--offline", "--json").stdout)
    projectlib.engine_change(root, "0.1.7")
    builder("lock", "--offline", "demo")
    new = json.loads(builder("image", "demo", "--offline", "--json").stdout)
    assert new["diff_ids"][0] == old["diff_ids"][0] and new["diff_ids"][1] != old["diff_ids"][1]

    # the host's record: what `installer status` reports of the release it runs (the old image)
    have = tmp_path / "status.json"
    have.write_text(json.dumps({"applied": {"image": {"diff_ids": old["diff_ids"]}}}))
    key = str(keys / "builder.key")
    builder("bundle", "thin/thin-1", "--with-image", "--with-models", "--key", key, "--out", str(tmp_path / "full"))
    builder("bundle", "thin/thin-1", "--with-image", "--with-models", "--thin", "--have", str(have),
            "--key", key, "--out", str(tmp_path / "thin"))
    full_m = json.loads((tmp_path / "full" / "manifest.json").read_text())
    thin_m = json.loads((tmp_path / "thin" / "manifest.json").read_text())
    assert thin_m["image"]["omitted_layers"] == 1 and "omitted_layers" not in full_m["image"]

    def archive_size(m: dict[str, object]) -> int:
        files = m["files"]
        assert isinstance(files, list)
        return int(next(f["size"] for f in files if f["path"] == "image.tar"))

    saved = archive_size(full_m) - archive_size(thin_m)
    assert saved >= old["layer_sizes"][0]  # the payload layer is not in the thin archive
    assert archive_size(thin_m) <= 1.1 * new["layer_sizes"][1] + 16 * 1024  # the changed layer (+ tar/config)

    installer = tmp_path / "thin" / "install.pyz"
    pub = str(keys / "builder.pub")

    def install(where: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(installer), "install", str(tmp_path / "thin"), "--root",
                               str(tmp_path / where), "--trusted-key", pub], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "DOCKER_CONFIG": str(tmp_path / "docker-config")})

    # the engine holds the old image (the payload layer's chain), not the new one
    assert _docker("rmi", "--force", new["image_id"]).returncode == 0
    p = install("root-a")
    assert p.returncode == 0, p.stderr
    got = _docker("image", "inspect", "--format", "{{.Id}}", new["image_id"]).stdout.strip()
    assert got == new["image_id"]  # docker load took the thin archive; the ImageID is the lock's
    assert (tmp_path / "root-a" / "current").is_symlink()

    # now the engine holds neither: refused before anything changes (no current, no release)
    assert _docker("rmi", "--force", new["image_id"]).returncode == 0
    assert _docker("rmi", "--force", old["image_id"]).returncode == 0
    p = install("root-b")
    assert p.returncode == 1
    assert "leaves out 1 layer(s) this host does not hold" in p.stderr and p.stderr.count("error:") == 1, p.stderr
    assert not (tmp_path / "root-b" / "current").exists()
    assert not any((tmp_path / "root-b" / "releases").glob("*")) if (tmp_path / "root-b" / "releases").exists() \
        else True
    shutil.rmtree(tmp_path / "srv", ignore_errors=True)


def test_thin_needs_with_image_and_have(tmp_path: Path) -> None:
    p = clirun.run("bundle", "x/y", "--thin", cwd=projectlib.ROOT, argv0=(clirun.SCRIPT,))
    assert p.returncode == 2 and "--thin needs --with-image and --have FILE" in p.stderr
    bad = tmp_path / "have.json"
    bad.write_text('{"image": {}}')
    p = clirun.run("bundle", "x/y", "--with-image", "--thin", "--have", str(bad), cwd=projectlib.ROOT,
                   argv0=(clirun.SCRIPT,))
    assert p.returncode == 2 and f"--have {bad}: no layer list" in p.stderr and "Traceback" not in p.stderr
