"""Runtime dependencies cover the runtime: builder installed WITHOUT extras, into a fresh venv (no system
site-packages), builds the demo image on a remote engine over `DOCKER_HOST=ssh://` (the README's path for
GB10 images), with the same ImageID as the local build.

The install is offline and real: pip resolves the package's declared dependencies from the wheelhouse
`.ci/run` fills (`pip download .` of the project: its runtime dependencies, no extras; and setuptools and
wheel, to build it), so what lands in the venv is exactly what `pip install builder` gives. The docker
SDK defines its ssh:// transport only when paramiko imports: without paramiko declared, the remote build
fails. The remote engine is a test host's own dockerd, reached through this machine's ssh (builder asks
the SDK for the system ssh client) with the test fleet's ssh_config, put on PATH by a one-line wrapper.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from builder.image.imagerecord import tag_for
from tests.lib import dockerlib, fleetlib
from tests.lib.fleetlib import docker_available
from tests.lib.shipped import ROOT, copy_project

pytestmark = [pytest.mark.docker, pytest.mark.fleet, pytest.mark.slow]

#: what `pip install .` reads: the project's metadata and the package
PACKAGE_FILES = ("pyproject.toml", "README.md", "builder")


def _wheelhouses() -> list[Path]:
    dirs = [Path(d) for d in os.environ.get("BUILDER_WHEELHOUSE", "").split(os.pathsep) if d]
    return [d for d in [*dirs, ROOT / ".cache" / "wheelhouse"] if d.is_dir()]


def _has(dirs: list[Path], project: str) -> bool:
    return any(d.glob(f"{project}-*.whl") for d in dirs)


def _env(**extra: str) -> dict[str, str]:
    """The environment of a command in the venv: no PYTHONPATH (the tests point it at this tree; the
    venv's own installed copy must run), no DOCKER_HOST unless given."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DOCKER_HOST", "VIRTUAL_ENV")}
    env.update({"NO_COLOR": "1", "COLUMNS": "250", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"})
    env.update(extra)
    return env


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _install_without_extras(tmp: Path, houses: list[Path]) -> Path:
    """A fresh venv with `pip install <the project>` from the wheelhouse only; returns its bin folder."""
    src = tmp / "src"
    src.mkdir()
    for name in PACKAGE_FILES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    bin_ = venv / "bin"
    links = [a for d in houses for a in ("--find-links", str(d))]
    p = _run([str(bin_ / "python"), "-m", "pip", "install", "-q", "--no-index", *links, str(src)], _env(), tmp,
             timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    check = _run([str(bin_ / "python"), "-m", "pip", "check"], _env(), tmp)
    assert check.returncode == 0, check.stdout + check.stderr
    return bin_


def test_a_plain_install_builds_on_a_remote_engine_over_ssh(tmp_path: Path, wheelhouse: Path) -> None:
    if not docker_available():
        pytest.skip("no Docker engine")
    houses = _wheelhouses()
    if not (_has(houses, "setuptools") and _has(houses, "wheel")):
        pytest.skip("no wheelhouse with builder's runtime dependencies (.ci/run's wheelhouse step makes it)")
    if not fleetlib.image_exists(fleetlib.testhost_tag()):
        pytest.skip(f"{fleetlib.testhost_tag()} missing: run tests/fleet/build-testhost.sh")
    bin_ = _install_without_extras(tmp_path, houses)
    py = str(bin_ / "python")

    # 1. the install is the package and its runtime dependencies: paramiko through them, no extras
    probe = ("import importlib.metadata as md, importlib.util as u, builder, json; "
             "print(json.dumps({'builder': builder.__file__, 'requires': md.requires('builder'), "
             "'paramiko': u.find_spec('paramiko') is not None, 'hypothesis': u.find_spec('hypothesis') is not None, "
             "'ruff': u.find_spec('ruff') is not None}))")
    p = _run([py, "-c", probe], _env(), tmp_path)
    assert p.returncode == 0, p.stderr
    facts = json.loads(p.stdout)
    assert facts["builder"].startswith(str(tmp_path / "venv")), facts  # the installed copy, not this tree
    assert "paramiko>=3" in facts["requires"], facts["requires"]  # a runtime requirement (no extra marker)
    assert facts["paramiko"] and not facts["hypothesis"] and not facts["ruff"], facts

    proj = copy_project(tmp_path / "proj")
    tags = dockerlib.Tags()
    zig = {"BUILDER_WHEELHOUSE": str(wheelhouse)}

    def image(store: Path, **env: str) -> subprocess.CompletedProcess[str]:
        return _run([str(bin_ / "builder"), "--pins", str(proj / "pins.toml"), "--store", str(store),
                     "image", "demo", "--json"], _env(**zig, **env), proj)

    try:
        # 2. the local build, by the installed builder
        local = image(tmp_path / "store-local")
        assert local.returncode == 0, local.stderr[-3000:]
        here = json.loads(local.stdout)
        tags.watch(tag_for("demo", here["input_address"]))

        # 3. the same build on a test host's own dockerd, DOCKER_HOST=ssh://
        with fleetlib.start_fleet(1, tmp_path / "fleet", dockerd=True) as fleet:
            h = fleet.hosts[0]
            wrapper = tmp_path / "bin" / "ssh"
            wrapper.parent.mkdir()
            wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {fleet.ssh_config} "$@"\n')
            wrapper.chmod(0o755)
            path = f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}"
            docker_host = f"ssh://{h.user}@{h.name}"
            assert fleet.images(h) == set()  # (nothing built there yet)
            remote = image(tmp_path / "store-remote", DOCKER_HOST=docker_host, PATH=path)
            assert remote.returncode == 0, remote.stderr[-3000:]
            there = json.loads(remote.stdout)
            assert there["built"] is True
            assert there["image_id"] == here["image_id"], (there, here)
            assert there["diff_ids"] == here["diff_ids"]
            assert here["image_id"] in fleet.images(h)  # built in the host's engine, not here

            # 4. without paramiko the same command fails in one plain line naming DOCKER_HOST
            p = _run([py, "-m", "pip", "uninstall", "-q", "-y", "paramiko"], _env(), tmp_path)
            assert p.returncode == 0, p.stderr
            gone = image(tmp_path / "store-gone", DOCKER_HOST=docker_host, PATH=path)
            assert gone.returncode == 1 and "Traceback" not in gone.stderr, gone.stderr[-3000:]
            errors = [ln for ln in gone.stderr.splitlines() if ln.startswith("error:")]
            assert errors == [f"error: no Docker engine: {docker_host} (DOCKER_HOST): the Docker SDK's ssh:// "
                              "transport needs paramiko (a dependency of builder: reinstall builder)"], gone.stderr
    finally:
        tags.restore()
