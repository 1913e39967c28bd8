"""(e) Bundle creation vs `tar -c | zstd -T0`, install-side verification of a bundle in parts vs
`openssl dgst -sha256`; (f) peak memory (RSS) of bundle, verify and install on a 4 GiB file.

The project is the bundle tests' small lane (tests/lib/bundlelib.py: pins, fleet, image record) with its
model pointing at the benchmark's model folder (8 files, 4 GiB; symlinks, so nothing is copied to set
up). `builder bundle spark-a --with-models` links the model files from the store (the first run
imports them: hashed, then hard-linked; see bench/ship.py for the fleet's disk and the copy it
saves); `builder verify` checks signature and every file; the offline installer (install.pyz, the
zipapp of builder.installer, as a host runs it) installs it into a root under the workdir. Each runs as
its own process, so wall time and peak RSS (wait4's ru_maxrss for that one child) are its own.

The memory figure uses one 4 GiB sparse file (--quick: 512 MiB) bundled as a model file (linked
into the bundle; the installer streams it through builder.installer.verify.iter_file, the path an
image.tar takes); `docker save`/`docker load` of a real 4 GiB image are not part of it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import (
    Config,
    GiB,
    MiB,
    Row,
    builder_argv,
    gib_s,
    have,
    judge,
    median_interleaved,
    run_measured,
    skipped,
    warm,
)
from bench.data import model_folder
from builder import __version__
from builder.bundle import hostpkg
from builder.foundation import sign
from builder.foundation.canon import atomic_write
from builder.foundation.hashing import in_parallel, recipe_files, sha256_file
from builder.inputs.pins import load_pins
from builder.lock.lockfile import Lock, LockedImage, LockedLane, LockedModel, LockedModelFile, render_lock, spec_hash
from tests.lib import bundlelib

NAME = "bundle"
MEM_LIMIT = 200 * MiB
_IMAGES: list[str] = []


def _project(base: Path, files: dict[str, Path], hosts_root: Path, *, hosts: list[dict[str, Any]] | None = None,
             ssh_config: str | None = None) -> dict[str, Any]:
    """A bundle project whose one model is `files` (name -> path, linked, not copied); its fleet is
    `hosts` (default: the bundle tests' two, with their folders under hosts_root), the lane's
    tensor parallelism their number."""
    root = base / "proj"
    (root / "images" / "tiny").mkdir(parents=True)
    (root / "images" / "tiny" / "Dockerfile").write_text("FROM scratch\n")
    mdir = root / "models" / "demo"
    mdir.mkdir(parents=True)
    for n, p in files.items():
        os.symlink(p, mdir / n)
    bundlelib.set_pins(root)
    if hosts is None:
        hosts = []
        for h in bundlelib.DEFAULT_HOSTS:
            hr = hosts_root / h["name"]
            hosts.append({**h, "paths": {"models": str(hr / "models"), "engram": str(hr / "engram"),
                                         "bundles": str(hr / "bundles")}})
    pins_text = (root / "pins.toml").read_text()
    (root / "pins.toml").write_text(pins_text.replace("tensor_parallel = 2", f"tensor_parallel = {len(hosts)}"))
    (root / "hosts").mkdir()
    (root / "hosts" / "test.toml").write_text(bundlelib.fleet_toml(hosts, ssh_config=ssh_config))
    pins = load_pins(root / "pins.toml")
    named = sorted(files.items())
    lf = [LockedModelFile(path=n, size=size, sha256=digest)
          for (n, _), (digest, size) in zip(named, in_parallel(sha256_file, [p for _, p in named]), strict=True)]
    lock = Lock(
        format=1, builder=__version__, inputs_hash="0" * 64, inputs={},
        images={"tiny": LockedImage(spec_hash=spec_hash(pins.images["tiny"]), recipe="images/tiny",
                                    recipe_files=recipe_files(root, "images/tiny"), platform="linux/amd64",
                                    source_date_epoch=0)},
        models={"demo-model": LockedModel(spec_hash=spec_hash(pins.models["demo-model"]),
                                          repo="demo/tiny-model", revision="main", commit="a" * 40,
                                          source="local", files=lf, total_size=sum(x.size for x in lf))},
        lanes={"demo": LockedLane(spec_hash=spec_hash(pins.lanes["demo"]), image="tiny", models=["demo-model"])},
    )
    atomic_write(root / "pins.lock", render_lock(lock))
    # The installer wants the manifest's image in the engine (it loads it when absent): a real tiny
    # FROM-scratch image when Docker runs, else a made-up ID (then the install figure is skipped).
    if docker_ok():
        image_id, diff_ids = bundlelib.build_tiny_image(f"bench-{base}")
        _IMAGES.append(image_id)
    else:
        image_id = "sha256:" + hashlib.sha256(b"bench: no image").hexdigest()
        diff_ids = ["sha256:" + hashlib.sha256(b"layer").hexdigest()]
    bundlelib.write_record_for(root, image_id, diff_ids)
    keys = base / "keys"
    keys.mkdir()
    sign.generate_keypair(keys / "builder.key", keys / "builder.pub")
    return {"root": root, "key": keys / "builder.key", "pub": keys / "builder.pub", "image_id": image_id}


def docker_ok() -> bool:
    if not have("docker"):
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def part_size(cfg: Config) -> str:
    """The default 256 MiB parts; --quick's files are smaller, so its parts are too (8 MiB)."""
    return "8MiB" if cfg.quick else "256MiB"


def _bundle_argv(p: dict[str, Any], out: Path, parts: str = "256MiB") -> list[str]:
    return [*builder_argv(), "--pins", str(p["root"] / "pins.toml"), "bundle", "spark-a", "--with-models",
            "--key", str(p["key"]), "--out", str(out), "--part-size", parts]


def _verify_argv(p: dict[str, Any], out: Path) -> list[str]:
    return [*builder_argv(), "--pins", str(p["root"] / "pins.toml"), "verify", str(out), "--key", str(p["pub"])]


def install_pyz(base: Path) -> Path:
    """This checkout's install.pyz, written under base: the installer as a host runs it."""
    path = base / hostpkg.NAME
    path.write_bytes(hostpkg.zipapp())
    return path


def _install_argv(p: dict[str, Any], out: Path, root: Path) -> list[str]:
    return [sys.executable, str(install_pyz(p["root"].parent)), "install", str(out), "--root", str(root),
            "--trusted-key", str(p["pub"]), "--reserve", "0"]


def _checked(argv: list[str]) -> tuple[float, int]:
    rc, wall, rss, err = run_measured(argv)
    if rc != 0:
        raise RuntimeError(f"{' '.join(argv[:4])}...: exit {rc}: {err}")
    return wall, rss


def _bundle_files(out: Path) -> list[str]:
    return sorted(str(p) for p in out.rglob("*") if p.is_file())


def run(cfg: Config) -> list[Row]:
    rows: list[Row] = []
    mf = model_folder(cfg)
    base = cfg.workdir / "bundle"
    base.mkdir()
    try:
        rows += _throughput(cfg, mf, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    mem = cfg.workdir / "bundle-mem"
    mem.mkdir()
    try:
        rows += _memory(cfg, mem)
    finally:
        shutil.rmtree(mem, ignore_errors=True)
        for img in _IMAGES:
            subprocess.run(["docker", "rmi", "-f", img], capture_output=True)
    return rows


def _throughput(cfg: Config, mf: Any, base: Path) -> list[Row]:
    rows: list[Row] = []
    p = _project(base, {n: mf.root / n for n, _, _ in mf.entries}, base / "hosts")
    out = base / "out"
    tz = base / "model.tar.zst"
    data = mf.total

    def bundle() -> None:
        # Each contender removes its output at the end (timed, like tar's unlink), so every run starts
        # from the same page cache and disk state instead of replacing a 4 GiB bundle left by the last.
        _checked(_bundle_argv(p, out, part_size(cfg)))
        shutil.rmtree(out)

    contenders = {"builder": bundle}
    fig = "bundle creation vs tar -c | zstd -T0"
    if have("zstd") and have("tar"):
        names = " ".join(n for n, _, _ in mf.entries)

        def tar_zstd() -> None:
            subprocess.run(f"tar -C '{mf.root}' -cf - {names} | zstd -T0 -q -f -o '{tz}'", shell=True,
                           check=True)
            tz.unlink()

        def tar_zstd_sync() -> None:
            # The same, made as durable as a bundle (builder fsyncs every file it writes).
            subprocess.run(f"tar -C '{mf.root}' -cf - {names} | zstd -T0 -q -f -o '{tz}' && sync '{tz}'",
                           shell=True, check=True)
            tz.unlink()

        contenders["tar|zstd"] = tar_zstd
        contenders["tar|zstd+sync"] = tar_zstd_sync
    t = median_interleaved(contenders, cfg.runs)
    if "tar|zstd" in t:
        ratio = t["tar|zstd"] / t["builder"]
        rows.append(Row(NAME, fig, gib_s(data, t["builder"]), gib_s(data, t["tar|zstd"]), ratio, ">= 0.8",
                        judge(ratio, ">= 0.8"),
                        f"{len(mf.entries)} model files, {data / GiB:.2f} GiB, {part_size(cfg)} parts, signed",
                        {"builder_s": t["builder"], "tar_zstd_s": t["tar|zstd"], "bytes": data}))
        ratio = t["tar|zstd+sync"] / t["builder"]
        rows.append(Row(NAME, "bundle creation vs tar | zstd -T0 + sync", gib_s(data, t["builder"]),
                        gib_s(data, t["tar|zstd+sync"]), ratio, "", "report",
                        "both outputs on disk (fsync/sync) when the command returns",
                        {"builder_s": t["builder"], "tar_zstd_sync_s": t["tar|zstd+sync"], "bytes": data}))
    else:
        rows.append(skipped(NAME, fig, "tar or zstd not installed", ">= 0.8"))

    _checked(_bundle_argv(p, out, part_size(cfg)))  # the bundle the verification reads
    files = _bundle_files(out)
    nparts = sum(1 for f in files if ".part" in f)
    size = sum(os.path.getsize(f) for f in files)
    warm([Path(f) for f in files])
    fig = "bundle verify (parts) vs openssl dgst"
    if have("openssl"):
        def verify() -> None:
            _checked(_verify_argv(p, out))

        def openssl() -> None:
            subprocess.run(["openssl", "dgst", "-sha256", *files], check=True, stdout=subprocess.DEVNULL)

        t = median_interleaved({"builder": verify, "openssl": openssl}, cfg.runs)
        ratio = t["openssl"] / t["builder"]
        rows.append(Row(NAME, fig, gib_s(size, t["builder"]), gib_s(size, t["openssl"]), ratio, ">= 1.5",
                        judge(ratio, ">= 1.5"),
                        f"`builder verify`: signature + {nparts} parts + {len(files) - nparts} files",
                        {"builder_s": t["builder"], "openssl_s": t["openssl"], "bytes": size}))
    else:
        rows.append(skipped(NAME, fig, "openssl not installed", ">= 1.5"))
    return rows


def _memory(cfg: Config, base: Path) -> list[Row]:
    size = 512 * MiB if cfg.quick else 4 * GiB
    big = base / "data" / "image-archive.tar"
    big.parent.mkdir()
    with open(big, "wb") as f:  # sparse: reads as zeros, costs no disk until the bundle copies it
        f.truncate(size)
    p = _project(base, {"image-archive.tar": big}, base / "hosts")
    out = base / "out"
    root = base / "hosts" / "spark-a" / "bundles"
    rows = []
    for fig, argv in (
        ("peak RSS: builder bundle", _bundle_argv(p, out, part_size(cfg))),
        ("peak RSS: builder verify", _verify_argv(p, out)),
        ("peak RSS: install (install.pyz)", _install_argv(p, out, root)),
    ):
        if "install" in fig and not docker_ok():
            rows.append(skipped(NAME, fig, "no Docker engine (the install checks the image in it)", "<= 200 MiB"))
            continue
        try:
            wall, rss = _checked(argv)
        except RuntimeError as e:
            rows.append(skipped(NAME, fig, str(e)[:200], "<= 200 MiB"))
            continue
        rows.append(Row(NAME, fig, f"{rss / MiB:.0f} MiB", "", None, "<= 200 MiB",
                        "pass" if rss <= MEM_LIMIT else "fail",
                        f"one {size / GiB:.1f} GiB file streamed ({wall:.1f} s)", {"rss_bytes": rss, "seconds": wall}))
    return rows
