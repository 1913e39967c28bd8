"""`builder fetch` through the CLI: the model store, against a FAKE Hub (tests/fakehub.py, real HTTP on
127.0.0.1) and real files on disk; the lock it reads is written by `builder lock` against the same Hub."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakehub import FakeHub  # noqa: E402

from builder.models.store import ModelStore, Wanted  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "hf_fetchtesttoken0123456789"
BIG = bytes(range(256)) * 400  # 100 KiB, an LFS file
FILES = {"config.json": b'{"tiny": true}\n', "model.safetensors": BIG, "engram-r1of2.bin": b"\x07" * 5000}

PINS = """format = 1

[models.tiny]
repo = "org/tiny"
revision = "main"
"""


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    with FakeHub(token=TOKEN) as h:
        h.add_repo("org/tiny", FILES, lfs={"model.safetensors", "engram-r1of2.bin"})
        yield h


@pytest.fixture
def proj(tmp_path: Path, hub: FakeHub) -> Path:
    p = tmp_path / "proj"
    p.mkdir()
    (p / "pins.toml").write_text(PINS)
    r = cli(p, hub, "lock", "tiny")
    assert r.returncode == 0, r.stderr
    return p


def cli(proj: Path, hub: FakeHub | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "BUILDER_"))}
    env.update(BUILDER_STORE=str(proj / "store"), HF_HOME=str(proj / "hf-home"), NO_COLOR="1")
    if hub is not None:
        env.update(HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN)
    r = subprocess.run([sys.executable, "-m", "builder", "--pins", str(proj / "pins.toml"), *args],
                       capture_output=True, text=True, env=env, timeout=120)
    assert TOKEN not in r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    return r


def wanted(proj: Path, path: str) -> Wanted:
    lock = json.loads((proj / "pins.lock").read_text())["models"]["tiny"]
    f = next(f for f in lock["files"] if f["path"] == path)
    return Wanted(model="tiny", commit=lock["commit"], path=path, size=f["size"], sha256=f["sha256"])


def resolves(hub: FakeHub) -> list[str]:
    return [r.path for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]


def test_fetch_stores_each_file_once_verified_and_a_second_fetch_sends_nothing(proj: Path, hub: FakeHub) -> None:
    hub.requests.clear()
    r = cli(proj, hub, "fetch", "tiny", "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(r.stdout)["downloaded"]) == sorted(f"tiny/{p}" for p in FILES)
    store = ModelStore(proj / "store")
    for p, data in FILES.items():
        w = wanted(proj, p)
        assert store.object_path(w.sha256).read_bytes() == data
        assert os.path.samefile(store.view_path(w), store.object_path(w.sha256))
    assert sorted(resolves(hub)) == sorted(f"/org/tiny/resolve/{wanted(proj, p).commit}/{p}" for p in FILES)
    hub.requests.clear()
    r = cli(proj, hub, "fetch", "--json", "tiny")
    assert r.returncode == 0 and len(json.loads(r.stdout)["present"]) == 3
    assert resolves(hub) == []


def test_a_cut_download_resumes_where_it_stopped(proj: Path, hub: FakeHub) -> None:
    hub.cut_after = 30_000
    r = cli(proj, hub, "fetch", "tiny", "--jobs", "1")
    assert r.returncode == 1 and "model.safetensors" in r.stderr and hub.cuts >= 1
    w = wanted(proj, "model.safetensors")
    store = ModelStore(proj / "store")
    assert not store.object_path(w.sha256).exists()  # a partial file is never taken as whole
    assert 0 < store.partial_path(w.sha256).stat().st_size < len(BIG)
    hub.cut_after = None
    hub.requests.clear()
    r = cli(proj, hub, "fetch", "tiny")
    assert r.returncode == 0, r.stderr
    got = [x for x in hub.requests if x.path.endswith("/model.safetensors") and x.method == "GET"]
    assert got and got[0].range is not None and got[0].range.startswith("bytes=") and got[0].range != "bytes=0-"
    assert store.object_path(w.sha256).read_bytes() == BIG
    assert not store.partial_path(w.sha256).exists()


def test_bytes_that_are_not_the_locked_ones_are_removed_and_named(proj: Path, hub: FakeHub) -> None:
    hub.repos["org/tiny"].files["model.safetensors"] = BIG[:-1] + b"\x00"  # same commit, other bytes
    r = cli(proj, hub, "fetch", "tiny")
    assert r.returncode == 1
    lines = [x for x in r.stderr.splitlines() if "model.safetensors" in x]
    assert len(lines) == 1 and "models.tiny: model.safetensors" in lines[0] and "removed" in lines[0]
    store = ModelStore(proj / "store")
    w = wanted(proj, "model.safetensors")
    assert not store.object_path(w.sha256).exists() and not store.partial_path(w.sha256).exists()
    assert not list((store.root / "objects").glob(f"{w.sha256}*"))


def test_a_revision_gone_from_the_hub_and_a_missing_token(proj: Path, hub: FakeHub) -> None:
    hub.add_repo("org/tiny", {"other.bin": b"x"})  # main moved on; the locked commit is gone
    r = cli(proj, hub, "fetch", "tiny")
    assert r.returncode == 1 and "models.tiny: config.json" in r.stderr and "404" in r.stderr
    r = cli(proj, None, "fetch", "tiny")  # no HF_ENDPOINT, no token: nothing reachable here
    assert r.returncode == 1 and r.stderr.count("models.tiny:") >= 3


def test_offline_lists_what_is_missing(proj: Path, hub: FakeHub) -> None:
    r = cli(proj, hub, "fetch", "tiny", "--offline")
    assert r.returncode == 1
    assert r.stderr.count("not in the store and --offline was given") == 3
    hub.requests.clear()
    assert cli(proj, hub, "fetch", "tiny").returncode == 0
    assert cli(proj, hub, "fetch", "tiny", "--offline").returncode == 0


def test_a_store_file_changed_behind_builders_back(proj: Path, hub: FakeHub) -> None:
    assert cli(proj, hub, "fetch", "tiny").returncode == 0
    store = ModelStore(proj / "store")
    w = wanted(proj, "model.safetensors")
    obj = store.object_path(w.sha256)

    def tamper() -> None:
        os.chmod(obj, 0o644)
        with open(obj, "r+b") as f:
            f.write(b"\xff")

    tamper()
    r = cli(proj, hub, "fetch", "tiny", "--verify")  # named, removed, fetched again
    assert r.returncode == 0 and "models.tiny: model.safetensors" in r.stderr
    assert "changed behind builder's back" in r.stderr
    assert hashlib.sha256(obj.read_bytes()).hexdigest() == w.sha256
    tamper()
    r = cli(proj, hub, "fetch", "tiny", "--verify", "--offline")  # named, removed, and nothing to fetch with
    assert r.returncode == 1 and "models.tiny: model.safetensors" in r.stderr and "changed" in r.stderr
    assert not obj.exists()


def test_the_demo_lanes_local_files_are_imported_by_hard_link(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "BUILDER_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    store = tmp_path / "store"  # same file system as the checkout? link; else copy: both are right
    r = subprocess.run([sys.executable, "-m", "builder", "--pins", str(ROOT / "pins.toml"), "--store", str(store),
                        "fetch", "demo", "--offline", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["imported"]) == 8
    lock = json.loads((ROOT / "pins.lock").read_text())["models"]["demo-tiny"]
    src = ROOT / "models/hf-cache/models--builder-demo--tiny/snapshots" / lock["commit"] / "config.json"
    view = store / "models/views/demo-tiny" / lock["commit"] / "config.json"
    assert view.read_bytes() == src.read_bytes()
    if os.stat(src).st_dev == os.stat(tmp_path).st_dev:
        assert os.path.samefile(view, src)


def test_a_symlinked_snapshot_is_imported_as_the_file_it_names(tmp_path: Path) -> None:
    """An HF cache's snapshot is symbolic links to its blobs: the store links the blob, never the link."""
    import hashlib

    from builder.models.store import ModelStore, Wanted

    blob = tmp_path / "hf" / "blobs" / "abc"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"weights" * 1000)
    snap = tmp_path / "hf" / "snapshots" / ("c" * 40) / "w.bin"
    snap.parent.mkdir(parents=True)
    snap.symlink_to("../../blobs/abc")
    data = blob.read_bytes()
    w = Wanted(model="m", commit="c" * 40, path="w.bin", size=len(data), sha256=hashlib.sha256(data).hexdigest())
    store = ModelStore(tmp_path / "store")
    assert store.import_file(snap, w) == "linked"
    obj = store.object_path(w.sha256)
    assert not obj.is_symlink() and os.path.samefile(obj, blob)
    dest = tmp_path / "bundle" / "w.bin"
    assert store.place(w, dest) == "linked" and not dest.is_symlink() and os.path.samefile(dest, blob)


@pytest.fixture
def small_store(proj: Path) -> Iterator[Path]:
    """The model store on a 64 KiB tmpfs: the 100 KiB LFS file fills it mid-download (a real ENOSPC)."""
    store = proj / "store"
    models = store / "models"
    models.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(models)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield store
    finally:
        subprocess.run(["umount", "-l", str(models)], check=False)


def test_a_disk_that_fills_mid_download(proj: Path, hub: FakeHub, small_store: Path) -> None:
    r = cli(proj, hub, "fetch", "tiny")
    assert r.returncode != 0
    # (the files are fetched at once, so each that could not be written is named, one line each)
    err = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert any("models.tiny: model.safetensors:" in e and "No space left" in e for e in err), r.stderr
    assert all(e.startswith("error: models.tiny: ") for e in err), r.stderr
    for path in FILES:  # nothing under a real name: no object, no view
        w = wanted(proj, path)
        assert not ModelStore(small_store).object_path(w.sha256).exists(), path
        assert not (small_store / "models" / "views" / "tiny" / w.commit / path).exists(), path
