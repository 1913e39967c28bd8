"""(c) `builder image demo` when up to date vs `docker build` of the same recipe with every layer cached.

Set-up (not timed): the ziglang wheel the recipe builds with, found where the README's first command
left it (bench.common.wheelhouse: a wheelhouse, the project's store, else `pip download`); a copy of
the project (pins, lock, recipes, sources) in the workdir with its own --store there;
`builder lock --offline demo`; `builder image demo` (builds once unless the project's own store
already recorded the same input address for an image the engine still holds: that record is copied
in, which is exactly what "up to date" means); the build context `builder image` assembles for the
recipe (image.assemble_context) built once with `docker build` so every step is cached.
Timed: `builder image demo` (a no-op) against `docker build` of that context (every step "Using cache").
Clean-up: the copy, the store, the bench tag and the image docker build made.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.common import (
    REPO,
    Config,
    Row,
    builder_argv,
    judge,
    median_interleaved,
    secs,
    skipped,
    wheelhouse,
    wheels_in_env,
)
from bench.common import run as sh
from builder.foundation import dockerio
from builder.image import build as image
from builder.image import plan
from builder.store.content import Store

NAME = "image"
FIG = "builder image demo (up to date) vs docker build (cached)"
TARGET = "<= 0.5"
COPY = ["pins.toml", "pins.lock", "images", "patches", "engine-src", "files", "models", "flake.nix", "flake.lock"]


def _docker_ok() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI"
    p = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if p.returncode != 0:
        return "no Docker engine reachable"
    return None


def run(cfg: Config) -> list[Row]:
    why = _docker_ok()
    if why:
        return [skipped(NAME, FIG, why, TARGET)]
    proj = cfg.workdir / "image-project"
    store = cfg.workdir / "image-store"
    proj.mkdir()
    for n in COPY:
        src = REPO / n
        if src.is_dir():
            shutil.copytree(src, proj / n, ignore=shutil.ignore_patterns("__pycache__", ".zig-cache", "zig-out"))
        elif src.is_file():
            shutil.copy2(src, proj / n)
    b = [*builder_argv(), "--pins", str(proj / "pins.toml"), "--store", str(store)]
    try:
        sh([*b, "lock", "--offline", "demo"], cwd=proj)
    except RuntimeError as e:
        return [skipped(NAME, FIG, f"builder lock --offline demo failed: {str(e)[-160:]}", TARGET)]
    # Seed the bench store with the project's image records: a record only counts when the engine
    # still holds that exact ImageID with the labels (image.up_to_date), so this cannot fake a no-op.
    own = REPO / ".cache" / "builder" / "images"
    if own.is_dir():
        shutil.copytree(own, store / "images", dirs_exist_ok=True)
    # A first build, and _assemble (which assembles docker build's context in this process, offline),
    # need the ziglang wheel, and the copy has no .cache: find it where the README's commands left it
    # (bench.common.wheelhouse) and name it in BUILDER_WHEELHOUSE for the duration.
    wheels, why = wheelhouse("demo", cfg.workdir)
    if wheels is None:
        return [skipped(NAME, FIG, f"the demo image's wheel: {why}", TARGET)]
    with wheels_in_env(wheels):
        return _timed(cfg, proj, store, b)


def _timed(cfg: Config, proj: Path, store: Path, b: list[str]) -> list[Row]:
    try:
        sh([*b, "image", "demo"], cwd=proj)  # build once if needed (not timed)
    except RuntimeError as e:
        return [skipped(NAME, FIG, f"builder image demo failed: {str(e)[-160:]}", TARGET)]

    tag = f"builder-bench-docker:{cfg.workdir.name.lower().replace('_', '-')[-40:]}"
    ctx_dir = Path(tempfile.mkdtemp(prefix="ctx-", dir=cfg.workdir))
    try:
        buildargs = _assemble(proj, store, ctx_dir)
        argv = ["docker", "build", "--network", "none", "-q", "-t", tag]
        for k, v in sorted(buildargs.items()):
            argv += ["--build-arg", f"{k}={v}"]
        argv.append(str(ctx_dir))
        # Fill docker's build cache for this context (not timed). Retried once: on a shared engine
        # another job's `docker image prune` can remove the fresh image before it is tagged.
        try:
            sh(argv)
        except RuntimeError:
            sh(argv)

        def noop() -> None:
            sh([*b, "image", "demo"], cwd=proj)

        def docker_cached() -> None:
            sh(argv)

        t = median_interleaved({"builder": noop, "docker": docker_cached}, cfg.runs)
        ratio = t["builder"] / t["docker"]
        return [Row(NAME, FIG, secs(t["builder"]), secs(t["docker"]), ratio, TARGET, judge(ratio, TARGET),
                    "ratio = builder time / docker build time (lower is better)",
                    {"builder_s": t["builder"], "docker_s": t["docker"]})]
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
        shutil.rmtree(ctx_dir, ignore_errors=True)


def _assemble(proj: Path, store: Path, dest: Path) -> dict[str, str]:
    """The build context and build args `builder image demo` would use (builder.image.build's own code)."""
    pins, lock, _ = image.load_inputs(proj / "pins.toml", proj / "pins.lock", "demo")
    p = plan.make_plan(pins, lock, "demo", proj)
    engine = dockerio.engine_platform()
    return image.assemble_context(pins, lock, p, proj, Store(store), dest, offline=True,
                                  build_platform=engine, on_log=lambda _line: None)
