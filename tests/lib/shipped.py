"""The shipped project in a test's folder: a copy of its inputs (pins, lock, recipes, engine source,
patches, files, models; not hosts/ or tests/), the real CLI run on it, a relock, and edits of its
lock (its pins are edited through tests.lib.factory.edit_pins). tests.lib.journeylib.project_copy
copies a whole fresh clone instead."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.lock.lockfile import Lock, render_lock
from tests.lib import clirun

ROOT = Path(__file__).resolve().parents[2]
PROJECT_FILES = ("pins.toml", "pins.lock", "images", "engine-src", "patches", "files", "models")
PATCH_REL = "patches/demo/0001-version-suffix-patched.patch"
NO_DOCKER = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}


def copy_project(dest: Path) -> Path:
    """A copy of the shipped project (pins, lock, recipes, engine bundle, patches, files, models)."""
    dest.mkdir(parents=True)
    for name in PROJECT_FILES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", ".zig-cache", "zig-out"))
        else:
            shutil.copy2(src, dest / name)
    return dest


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.strip()]

    def json(self) -> Any:
        return json.loads(self.out)


def run_cli(root: Path, *args: str, store: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 1800, wrap: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """`python -m builder --pins root/pins.toml ARGS` in ``root`` (store: ``root/.cache/builder`` unless
    given), with this environment plus ``env``, colour off, wide, and no user or system git config;
    ``wrap``: the command it runs under (`unshare -n`)."""
    return clirun.run(*args, cwd=root, pins=root / "pins.toml", store=store, env=clirun.environment(env),
                      timeout=timeout, argv0=(*wrap, *clirun.ARGV))


def builder(root: Path, *args: str, store: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 1800, wrap: tuple[str, ...] = ()) -> Result:
    """`run_cli`, its exit status and output as a Result."""
    p = run_cli(root, *args, store=store, env=env, timeout=timeout, wrap=wrap)
    return Result(p.returncode, p.stdout, p.stderr)


def relock(root: Path, *names: str) -> None:
    r = builder(root, "lock", "--offline", *(names or ("demo",)))
    assert r.rc == 0, r.err


def edit_lock(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the lock's content and write it the way `builder lock` does (sorted, sealed)."""
    path = root / "pins.lock"
    data = json.loads(path.read_text())
    change(data)
    data.pop("seal", None)
    path.write_bytes(render_lock(Lock.model_validate(data)))


def plan_of(root: Path) -> dict[str, Any]:
    r = builder(root, "why", "demo", "--json", env=NO_DOCKER)
    assert r.rc == 0, r.err
    return dict(r.json())
