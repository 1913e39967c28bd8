"""A small project for bundle/ship/install tests: pins, a hand-written lock, an image record, a fleet, keys.

Everything lives under a tmp folder; nothing is contacted (the default fleet uses documentation
addresses, never reached). ``docker_image=True`` builds a tiny FROM-scratch image (static busybox
answering /health with httpd) in this machine's engine and records its real ImageID and DiffIDs.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.bundle import BundleOptions, hostpkg, load_bundle_inputs, make_bundle
from builder.foundation import sign
from builder.foundation.canon import pretty_json
from builder.image.imagerecord import ImageRecord, tag_for, write_record
from builder.image.plan import make_plan
from builder.inputs.pins import load_pins
from builder.installer.manifest import bundle_id_of, trusted_comment_for
from builder.lock.lockfile import load_lock
from tests.lib import factory, fleetlib, shipped

REPO = Path(__file__).resolve().parents[2]
LANE = "demo"
FLEET = "testfleet"
PORT = 18080

HTTPD = ["httpd", "-f", "-p", "{port}", "-h", "/www"]


def pins_doc(streams: int = 2, port: int = PORT) -> dict[str, Any]:
    """The project's pins: the tiny image, a local model and a two-rank lane serving it with httpd."""
    return factory.pins(
        images={"tiny": factory.image("images/tiny", platform="linux/amd64")},
        models={"demo-model": factory.model("demo/tiny-model", local="models/demo")},
        lanes={LANE: factory.lane(
            "tiny", ["demo-model"],
            serve={"tensor_parallel": 2, "context": 4096, "streams": streams, "port": port, "served_name": "demo"},
            env={"DEMO_FLAG": "1"},
            roles={"head": {"args": HTTPD, "ready": {"health": "/health"}},
                   "worker": {"args": HTTPD, "ready": {"running": True}}},
        )},
    )

MODEL_FILES = {
    "config.json": b'{"hidden": 8}\n',
    "tokenizer.json": b'{"vocab": ["a", "b"]}\n',
    "weights-r0of2.bin": bytes(range(256)) * 64,
    "weights-r1of2.bin": bytes(reversed(range(256))) * 64,
}


@dataclass
class Project:
    root: Path
    key: Path
    pub: Path
    image_id: str
    diff_ids: list[str]
    hosts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pins(self) -> Path:
        return self.root / "pins.toml"

    @property
    def store(self) -> Path:
        return self.root / ".cache" / "builder"

    def out(self, host: str) -> Path:
        return self.root / "out" / "bundles" / FLEET / host

    def cli(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 600, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        p = shipped.run_cli(self.root, *args, env=env, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"builder {' '.join(args)}: exit {p.returncode}: {p.stderr}")
        return p


def fleet_toml(
    hosts: list[dict[str, Any]], *, ssh_config: str | None = None, trusted_key: str | None = None, lane: str = LANE,
    registry: str | None = None,
) -> str:
    """The test fleet over `hosts` (dicts of host keys, as DEFAULT_HOSTS): no GPU, no NVIDIA runtime;
    ``registry``: its `fleet.registry`."""
    rows = [factory.host(**{"fabric": {}, "paths": {}, **h, "expect": {"gpu_count": 0, "nvidia_runtime": False}})
            for h in hosts]
    return factory.toml(factory.fleet(FLEET, lane, rows, ssh_config=ssh_config, trusted_key=trusted_key,
                                      registry=registry))


DEFAULT_HOSTS: list[dict[str, Any]] = [
    {
        "name": "spark-a",
        "ssh": "spark@192.0.2.10",
        "rank": 0,
        "role": "head",
        "address": "192.0.2.10",
        "fabric": {
            "rails": ["198.51.100.1"],
            "interfaces": ["enp1s0f0np0"],
            "rdma_devices": ["rocep1s0f0"],
            "gid_index": 3,
        },
        "paths": factory.HOST_PATHS,
    },
    {
        "name": "spark-b",
        "ssh": "spark@192.0.2.11",
        "rank": 1,
        "role": "worker",
        "address": "192.0.2.11",
        "fabric": {"rails": ["198.51.100.2"], "interfaces": ["enp1s0f0np0"], "rdma_devices": ["rocep1s0f0"]},
        "paths": factory.HOST_PATHS,
    },
]


def build_tiny_image(marker: str) -> tuple[str, list[str]]:
    """A FROM-scratch busybox image serving /www/health; ``marker`` makes its ImageID unique."""
    tag = f"builder-test-bundle:{hashlib.sha256(marker.encode()).hexdigest()[:12]}"
    image_id = fleetlib.tiny_image(tag, files={"/www/health": b"ok\n", "/www/marker": marker.encode()})
    out = subprocess.run(
        ["docker", "image", "inspect", "-f", "{{json .RootFS.Layers}}", image_id],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return image_id, json.loads(out)


def write_lock(root: Path) -> None:
    factory.write_lock(root, image="tiny", model="demo-model", lane=LANE, files=MODEL_FILES, platform="linux/amd64")


def write_record_for(root: Path, image_id: str, diff_ids: list[str]) -> None:
    pins = load_pins(root / "pins.toml")
    lock = load_lock(root / "pins.lock")
    plan = make_plan(pins, lock, "tiny", root)
    write_record(
        root / ".cache" / "builder",
        ImageRecord(
            name="tiny",
            input_address=plan.address,
            image_id=image_id,
            diff_ids=diff_ids,
            tag=tag_for("tiny", plan.address),
            lock_hash=plan.lock_hash,
            platform="linux/amd64",
            source_date_epoch=0,
        ),
    )


def set_pins(root: Path, *, streams: int = 2, port: int = PORT) -> None:
    factory.write_pins(root, pins_doc(streams, port))


def make_project(
    base: Path,
    *,
    hosts: list[dict[str, Any]] | None = None,
    docker_image: bool = False,
    marker: str = "",
    ssh_config: str | None = None,
    streams: int = 2,
    port: int = PORT,
) -> Project:
    root = base / "proj"
    (root / "images" / "tiny").mkdir(parents=True)
    (root / "images" / "tiny" / "Dockerfile").write_text("FROM scratch\n")
    mdir = root / "models" / "demo"
    mdir.mkdir(parents=True)
    for n, b in MODEL_FILES.items():
        (mdir / n).write_bytes(b)
    set_pins(root, streams=streams, port=port)
    hs = hosts if hosts is not None else DEFAULT_HOSTS
    (root / "hosts").mkdir()
    (root / "hosts" / "test.toml").write_text(fleet_toml(hs, ssh_config=ssh_config))
    write_lock(root)
    if docker_image:
        image_id, diff_ids = build_tiny_image(marker or str(base))
    else:
        image_id = "sha256:" + hashlib.sha256(b"not a real image " + marker.encode()).hexdigest()
        diff_ids = ["sha256:" + hashlib.sha256(b"layer").hexdigest()]
    write_record_for(root, image_id, diff_ids)
    keys = base / "keys"
    keys.mkdir()
    sign.generate_keypair(keys / "builder.key", keys / "builder.pub")
    return Project(
        root=root,
        key=keys / "builder.key",
        pub=keys / "builder.pub",
        image_id=image_id,
        diff_ids=diff_ids,
        hosts=hs,
    )


def relock(p: Project, *, streams: int) -> None:
    """Change the lane's serve settings and rewrite the lock (a new release of the same image)."""
    set_pins(p.root, streams=streams)
    write_lock(p.root)
    write_record_for(p.root, p.image_id, p.diff_ids)


@functools.cache
def installer_file() -> Path:
    """This checkout's install.pyz, written once per test process to a folder of its own outside the
    checkout: what a host runs (``python3 install.pyz COMMAND ...``)."""
    d = Path(tempfile.mkdtemp(prefix="builder-install-pyz-"))
    atexit.register(shutil.rmtree, d, True)
    path = d / hostpkg.NAME
    path.write_bytes(hostpkg.zipapp())
    path.chmod(0o755)
    return path


def tree_bytes(d: Path) -> dict[str, tuple[bytes, int]]:
    """path -> (bytes, mode) of every file under d (for determinism checks)."""
    out = {}
    for dirpath, _dirs, files in os.walk(d):
        for fn in files:
            full = Path(dirpath) / fn
            out[full.relative_to(d).as_posix()] = (full.read_bytes(), full.stat().st_mode & 0o7777)
    return out


def manifest(d: Path) -> dict[str, Any]:
    return json.loads((d / "manifest.json").read_bytes())


def resign(d: Path, key: Path, obj: dict[str, Any], *, fix_id: bool = True) -> None:
    """Rewrite a bundle's manifest (recomputing its id) and sign it again with the real key."""
    if fix_id:
        obj["bundle_id"] = bundle_id_of(obj)
    data = pretty_json(obj)
    (d / "manifest.json").write_bytes(data)
    (d / "manifest.json.minisig").write_text(
        sign.sign(data, sign.load_secret_key(key), trusted_comment_for(obj))
    )


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Everything under root by content (files by sha256, links by target)."""
    out: dict[str, Any] = {}
    if not root.exists():
        return out
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            full = Path(dirpath) / n
            rel = full.relative_to(root).as_posix()
            if rel in skip:
                continue
            if full.is_symlink():
                out[rel] = ("link", os.readlink(full))
            elif full.is_file():
                out[rel] = ("file", hashlib.sha256(full.read_bytes()).hexdigest())
            else:
                out[rel] = ("dir",)
    return out


def local_hosts(host: Path, *, bundles: str = "builder", connection: str | None = None) -> list[dict[str, Any]]:
    """DEFAULT_HOSTS with every host's models, Engram and bundles folders under the local folder `host`."""
    hs: list[dict[str, Any]] = json.loads(json.dumps(DEFAULT_HOSTS))
    for h in hs:
        if connection is not None:
            h["connection"] = connection
        h["paths"] = {"models": str(host / "models"), "engram": str(host / "engram"), "bundles": str(host / bundles)}
    return hs


def run_installer(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """python3 install.pyz ARGS, isolated from this checkout (-I, cwd=/)."""
    return subprocess.run(
        [sys.executable, "-I", str(installer_file()), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )


def bundle(p: Project, out: Path, host: str = "spark-b", **kw: Any) -> Path:
    """The project's bundle for `host` in `out` (BundleOptions' `kw`), signed with its key."""
    ctx = load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)
    return make_bundle(ctx, host, BundleOptions(key=p.key, out=out, **kw)).path


def install(bdir: Path, root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """The installer's `install` of a bundle folder into `root` (`extra`: its flags)."""
    return run_installer("install", str(bdir), "--root", str(root), *extra)
