"""The project copies the registry tests work in (no tests here): one whose demo image has two layers (a
payload that an engine change leaves alone, then the engine), built by the CLI; an engine-only change; a
lane that serves a published image; a local two-host fleet; the environment and the CLI runner. The
registry they push to is tests/lib/registrylib.py's.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from tests.lib import clirun, factory, journeylib

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = 2 * 1024 * 1024  # the layer an engine change leaves alone


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
    paths = {"models": f"{tmp}/srv/models", "engram": f"{tmp}/srv/engram", "bundles": f"{tmp}/var"}
    rows = [factory.host(h, rank, address=f"192.0.2.{rank + 10}", paths=paths)
            for rank, h in enumerate((f"{name}-1", f"{name}-2"))]
    factory.write_fleet(root, factory.fleet(name, lane, rows, trusted_key=keys / "builder.pub", registry=registry))


def engine_change(root: Path, version: str = "0.1.1") -> None:
    """Change only the engine: another ENGINE_VERSION compiled in (the payload layer stays)."""
    factory.edit_pins(root, lambda d: d["images"]["demo"]["build_args"].update(ENGINE_VERSION=version))


def pin_published(root: Path, reference: str) -> None:
    """The demo lane serves `images.pub`, published as ``reference`` (`[images.pub] published = ...`);
    called again, the pin names the new reference."""

    def publish(d: dict[str, Any]) -> None:
        d["lanes"]["demo"]["image"] = "pub"
        d["images"]["pub"] = factory.image(published=reference, platform="linux/amd64")

    factory.edit_pins(root, publish)


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
    return clirun.run(*args, cwd=root, env=env, check=check, timeout=timeout, argv0=(clirun.SCRIPT,))
