"""`builder fetch` through the CLI: the model store, against a FAKE Hub (tests/lib/fakehub.py, real HTTP on
127.0.0.1) and real files on disk; the lock it reads is written by `builder lock` against the same Hub."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from builder.store import modelfetch as core
from builder.store import modelstore as store_mod
from builder.store.modelstore import ModelStore, Wanted
from tests.lib import clirun, factory
from tests.lib.fakehub import FakeHub

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "hf_fetchtesttoken0123456789"
BIG = bytes(range(256)) * 400  # 100 KiB, an LFS file
FILES = {"config.json": b'{"tiny": true}\n', "model.safetensors": BIG, "engram-r1of2.bin": b"\x07" * 5000}

PINS = factory.pins(models={"tiny": factory.model("org/tiny")})


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    with FakeHub(token=TOKEN) as h:
        h.add_repo("org/tiny", FILES, lfs={"model.safetensors", "engram-r1of2.bin"})
        yield h


@pytest.fixture
def proj(tmp_path: Path, hub: FakeHub) -> Path:
    p = tmp_path / "proj"
    p.mkdir()
    factory.write_pins(p, PINS)
    r = cli(p, hub, "lock", "tiny")
    assert r.returncode == 0, r.stderr
    return p


def cli(proj: Path, hub: FakeHub | None, *args: str, token: str | None = TOKEN,
        env_extra: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    extra = {"BUILDER_STORE": str(proj / "store"), "HF_HOME": str(proj / "hf-home"),
             "HF_ENDPOINT": hub.url if hub is not None else None, "HF_TOKEN": token, **(env_extra or {})}
    r = clirun.run(*args, pins=proj / "pins.toml", env=clirun.environment(extra, drop=("HF_", "BUILDER_")),
                   timeout=120)
    assert TOKEN not in r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr
    return r


def wanted(proj: Path, path: str) -> Wanted:
    lock = json.loads((proj / "pins.lock").read_text())["models"]["tiny"]
    f = next(f for f in lock["files"] if f["path"] == path)
    return Wanted(model="tiny", commit=lock["commit"], path=path, size=f["size"], sha256=f["sha256"])


def hf_snapshot(proj: Path, path: str) -> Path:
    """Where huggingface_hub keeps a file of the locked commit (HF_HOME=proj/hf-home)."""
    return proj / "hf-home" / "hub" / "models--org--tiny" / "snapshots" / wanted(proj, path).commit / path


def gets(hub: FakeHub, server: str) -> list[str]:
    return [r.path for r in hub.requests if r.method == "GET" and r.server == server]


def never_written(root: Path, secret: str) -> None:
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert secret.encode() not in p.read_bytes(), p


def test_fetch_downloads_through_huggingface_hub_into_its_cache_and_links_the_store(
        proj: Path, hub: FakeHub) -> None:
    hub.requests.clear()
    r = cli(proj, hub, "fetch", "tiny", "--json")
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(r.stdout)["downloaded"]) == sorted(f"tiny/{p}" for p in FILES)
    store = ModelStore(proj / "store")
    for p, data in FILES.items():
        w = wanted(proj, p)
        assert store.object_path(w.sha256).read_bytes() == data
        assert os.path.samefile(store.view_path(w), store.object_path(w.sha256))
        # one copy of the bytes: the HF cache's blob is the store's object (a hard link)
        assert hf_snapshot(proj, p).is_symlink() and os.path.samefile(hf_snapshot(proj, p), store.object_path(w.sha256))
    commit = wanted(proj, "config.json").commit
    # huggingface_hub's protocol: HEAD on resolve/ at the locked commit, with the token; the small file
    # from the Hub, the LFS files from the CDN the Hub redirects to, without the token
    hub.requests[:] = [x for x in hub.requests if x.path != "/api/agent-harnesses"]
    heads = sorted(x.path for x in hub.requests if x.method == "HEAD")
    assert heads == sorted(f"/org/tiny/resolve/{commit}/{p}" for p in FILES)
    assert all(x.authorization == f"Bearer {TOKEN}" for x in hub.requests if x.server == "hub")
    assert gets(hub, "hub") == [f"/org/tiny/resolve/{commit}/config.json"]
    lfs = [wanted(proj, p).sha256 for p in ("model.safetensors", "engram-r1of2.bin")]
    assert sorted(gets(hub, "cdn")) == sorted(f"/lfs/{sha}" for sha in lfs)
    assert all(x.authorization is None for x in hub.requests if x.server == "cdn")
    never_written(proj, TOKEN)
    hub.requests.clear()
    r = cli(proj, hub, "fetch", "--json", "tiny")
    assert r.returncode == 0 and len(json.loads(r.stdout)["present"]) == 3
    assert hub.requests == []


def test_what_builder_fetched_is_what_hf_cache_ls_and_scan_cache_dir_see(proj: Path, hub: FakeHub) -> None:
    from huggingface_hub import scan_cache_dir

    assert cli(proj, hub, "fetch", "tiny").returncode == 0
    info = scan_cache_dir(proj / "hf-home" / "hub")
    assert info.warnings == []
    [repo] = info.repos
    assert repo.repo_id == "org/tiny" and repo.repo_type == "model"
    [rev] = repo.revisions
    assert rev.commit_hash == wanted(proj, "config.json").commit
    assert sorted(f.file_name for f in rev.files) == sorted(FILES)
    assert rev.size_on_disk == sum(len(d) for d in FILES.values())
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_HOME"] = str(proj / "hf-home")
    if shutil.which("hf") is None:
        pytest.skip("huggingface_hub's `hf` CLI is not on PATH")
    ls = subprocess.run(["hf", "cache", "ls"], capture_output=True, text=True, env=env, timeout=120)
    assert ls.returncode == 0 and "org/tiny" in ls.stdout, ls.stdout + ls.stderr


OFFLINE_BY_BRANCH = """
import json
from huggingface_hub import hf_hub_download, snapshot_download
print(json.dumps([hf_hub_download("org/tiny", "model.safetensors", revision="main"),
                  snapshot_download("org/tiny", revision="main")]))
"""


def hf_offline(proj: Path) -> subprocess.CompletedProcess[str]:
    """huggingface_hub itself, offline, in a process of its own (it reads HF_HUB_OFFLINE when imported),
    asked for org/tiny by branch; a closed port as its endpoint, should it try the network."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(proj / "hf-home"), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    return subprocess.run([sys.executable, "-c", OFFLINE_BY_BRANCH], capture_output=True, text=True, env=env,
                          timeout=120)


def test_after_a_fetch_huggingface_hub_offline_finds_the_model_by_branch(proj: Path, hub: FakeHub) -> None:
    assert cli(proj, hub, "fetch", "tiny").returncode == 0
    commit = wanted(proj, "config.json").commit
    ref = proj / "hf-home" / "hub" / "models--org--tiny" / "refs" / "main"
    assert ref.read_bytes() == commit.encode()  # as huggingface_hub writes it: the commit, no newline
    r = hf_offline(proj)
    assert r.returncode == 0, r.stderr
    path, snap = json.loads(r.stdout)
    assert Path(path).read_bytes() == BIG and Path(snap) == hf_snapshot(proj, "config.json").parent
    # the ref is what it needs: without it, huggingface_hub offline cannot tell which snapshot is main;
    # a fetch of what the store already holds records it again
    ref.unlink()
    assert hf_offline(proj).returncode != 0
    r = cli(proj, None, "fetch", "--offline", "--json", "tiny")
    assert r.returncode == 0 and len(json.loads(r.stdout)["present"]) == len(FILES)
    assert ref.read_bytes() == commit.encode() and hf_offline(proj).returncode == 0
    # `builder lock --offline` of the model pinned @main: the commit and files the Hub gave
    online = json.loads((proj / "pins.lock").read_text())["models"]["tiny"]
    (proj / "pins.lock").unlink()
    r = cli(proj, None, "lock", "--offline", "tiny")
    assert r.returncode == 0, r.stderr
    offline = json.loads((proj / "pins.lock").read_text())["models"]["tiny"]
    assert (offline["revision"], offline["commit"], offline["source"]) == ("main", commit, "local")
    assert offline["files"] == online["files"]


def test_a_connection_cut_mid_file_resumes_from_what_was_written(tmp_path: Path, hub: FakeHub) -> None:
    """huggingface_hub writes a download in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB) and, when the link
    drops, asks for the rest from the last byte it wrote (an HTTP Range request), up to five times in a
    row without progress: a 25 MiB file whose every answer is cut after 12 MiB arrives in three."""
    from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE as CHUNK

    data = os.urandom(1 << 20) * 25
    hub.add_repo("org/big", {"w.safetensors": data}, lfs={"w.safetensors"})
    proj = tmp_path / "big"
    proj.mkdir()
    factory.write_pins(proj, factory.pins(models={"big": factory.model("org/big")}))
    assert cli(proj, hub, "lock", "big").returncode == 0
    hub.cut_after = 12 << 20
    hub.requests.clear()
    r = cli(proj, hub, "fetch", "big")
    assert r.returncode == 0, r.stderr
    sha = hashlib.sha256(data).hexdigest()
    got = [x.range for x in hub.requests if x.server == "cdn" and x.path == f"/lfs/{sha}"]
    assert got == [None, f"bytes={CHUNK}-", f"bytes={2 * CHUNK}-"] and hub.cuts == 2  # never from zero again
    obj = ModelStore(proj / "store").object_path(sha)
    assert hashlib.sha256(obj.read_bytes()).hexdigest() == sha
    assert not list((proj / "hf-home" / "hub").rglob("*.incomplete"))


def test_a_link_that_brings_nothing_fails_naming_each_file_and_leaves_nothing(proj: Path, hub: FakeHub) -> None:
    hub.cut_after = 0  # every answer of a file is cut before its first byte
    r = cli(proj, hub, "fetch", "tiny", "--jobs", "3")
    assert r.returncode == 1
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert sorted(e.split(":")[2].strip() for e in errors) == sorted(FILES), r.stderr
    assert all(e.startswith("error: models.tiny: ") for e in errors)
    objects = proj / "store" / "models" / "objects"
    assert not objects.exists() or not list(objects.iterdir())
    blobs = proj / "hf-home" / "hub" / "models--org--tiny" / "blobs"
    assert not blobs.exists() or not list(blobs.iterdir())  # huggingface_hub removed its partial files


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
    # gone from the HF cache too: huggingface_hub would hand the same bytes back next time
    snap = hf_snapshot(proj, "model.safetensors")
    assert not snap.exists() and not snap.is_symlink()
    blobs = snap.parents[2] / "blobs"
    assert all(p.read_bytes() != BIG[:-1] + b"\x00" for p in blobs.iterdir())
    hub.repos["org/tiny"].files["model.safetensors"] = BIG  # the Hub fixed: the next fetch takes it
    assert cli(proj, hub, "fetch", "tiny").returncode == 0
    assert store.object_path(w.sha256).read_bytes() == BIG


def test_a_revision_gone_from_the_hub_and_a_missing_token(proj: Path, hub: FakeHub) -> None:
    hub.add_repo("org/tiny", {"other.bin": b"x"})  # main moved on; the locked commit is gone
    r = cli(proj, hub, "fetch", "tiny")
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 3 and all("HTTP 404 from the Hub" in e for e in errors), r.stderr
    assert any(e.startswith("error: models.tiny: config.json: org/tiny@") for e in errors)
    r = cli(proj, hub, "fetch", "tiny", token=None)  # the Hub wants a token, and none is given
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 1 and len(errors) == 3 and all("HTTP 401 from the Hub" in e for e in errors), r.stderr


def test_hf_hub_offline_downloads_nothing_and_says_so(proj: Path, hub: FakeHub) -> None:
    hub.requests.clear()
    r = cli(proj, hub, "fetch", "tiny", env_extra={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1 and r.stderr.count("HF_HUB_OFFLINE is set") == 3, r.stderr
    assert hub.requests == []


def test_the_hf_cache_is_where_huggingface_hub_puts_it_with_xdg_cache_home(proj: Path, hub: FakeHub) -> None:
    """XDG_CACHE_HOME without HF_HOME: huggingface_hub caches under $XDG_CACHE_HOME/huggingface/hub, and
    builder (fetch --offline, lock --offline) looks there, not in ~/.cache."""
    xdg = proj / "xdg"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_"))}
    env.update(XDG_CACHE_HOME=str(xdg), HF_ENDPOINT=hub.url, HF_TOKEN=TOKEN)
    w = wanted(proj, "model.safetensors")
    code = ("import sys\nfrom huggingface_hub import hf_hub_download\n"
            "print(hf_hub_download('org/tiny', 'model.safetensors', revision=sys.argv[1]))\n")
    got = subprocess.run([sys.executable, "-c", code, w.commit], capture_output=True, text=True, env=env, timeout=120)
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()).is_relative_to(xdg / "huggingface" / "hub")
    hub.requests.clear()
    base: dict[str, str | None] = {"HF_HOME": None, "XDG_CACHE_HOME": str(xdg)}
    r = cli(proj, None, "fetch", "tiny", "--offline", "--json", token=None, env_extra=base)
    assert r.returncode == 1  # the two files huggingface_hub did not download are missing
    rep = json.loads(r.stdout)
    assert rep["imported"] == ["tiny/model.safetensors"], r.stderr
    assert sorted(rep["missing"]) == ["tiny/config.json", "tiny/engram-r1of2.bin"]
    assert hub.requests == []
    assert os.path.samefile(ModelStore(proj / "store").object_path(w.sha256), got.stdout.strip())
    # `builder lock --offline` asks the same one place (builder.lock.hf.hub_cache)
    env.pop("HF_ENDPOINT")
    code = "from builder.lock import hf\nprint(hf.hub_cache_dirs()[0])\n"
    dirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert dirs.stdout.strip() == str(xdg / "huggingface" / "hub"), dirs.stderr


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
    env = clirun.environment({"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}, drop=("HF_", "BUILDER_"))
    store = tmp_path / "store"  # same file system as the checkout? link; else copy: both are right
    r = clirun.run("fetch", "demo", "--offline", "--json", pins=ROOT / "pins.toml", store=store, env=env,
                   timeout=120)
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


@pytest.fixture(params=["store", "hf-cache"])
def small_disk(request: pytest.FixtureRequest, proj: Path) -> Iterator[Path]:
    """The model store, or the HF cache huggingface_hub downloads into, on a 64 KiB tmpfs: the 100 KiB
    LFS file fills it (a real ENOSPC), while being downloaded or while copied into the store."""
    folder = proj / "store" / "models" if request.param == "store" else proj / "hf-home" / "hub"
    folder.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_disk_that_fills_mid_download(proj: Path, hub: FakeHub, small_disk: Path) -> None:
    r = cli(proj, hub, "fetch", "tiny")
    assert r.returncode == 1
    # (the files are fetched at once, so each that could not be written is named, one line each)
    err = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert any(e.startswith("error: models.tiny: model.safetensors: ") and "No space left" in e for e in err), r.stderr
    assert all(e.startswith("error: models.tiny: ") for e in err), r.stderr
    store = ModelStore(proj / "store")
    w = wanted(proj, "model.safetensors")  # nothing under a real name: no object, no view
    assert not store.object_path(w.sha256).exists() and not store.view_path(w).exists()
    assert not any(p.is_file() for p in (store.root / "tmp").glob("*"))  # nothing half-copied is left
    assert not list((proj / "hf-home").rglob("*.incomplete"))  # nor half-downloaded
    for path, data in FILES.items():  # what was stored is whole
        obj = store.object_path(wanted(proj, path).sha256)
        assert not obj.exists() or obj.read_bytes() == data


def test_a_download_is_hashed_as_it_lands_and_not_read_again(tmp_path: Path, hub: FakeHub,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes huggingface_hub writes are hashed behind it (builder.store.hub._Follower): the store
    takes the file without a second full read; a small file (no LFS sha256 to find it by) is read once."""
    import huggingface_hub.constants as hc

    data = os.urandom(1 << 20) * 24
    other = os.urandom(1 << 20) * 2
    commit = hub.add_repo("org/big", {"w.safetensors": data, "v.safetensors": other, "c.json": b"{}"},
                          lfs={"w.safetensors", "v.safetensors"})
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    read: list[str] = []
    real = store_mod.sha256_file
    monkeypatch.setattr(store_mod, "sha256_file", lambda p, **kw: (read.append(Path(p).name), real(p, **kw))[1])
    store = ModelStore(tmp_path / "store")
    sha = hashlib.sha256(data).hexdigest()
    w = Wanted(model="big", commit=commit, path="w.safetensors", size=len(data), sha256=sha)
    small = Wanted(model="big", commit=commit, path="c.json", size=2, sha256=hashlib.sha256(b"{}").hexdigest())
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    got = core.download(store, "org/big", w)
    core.download(store, "org/big", small)
    assert len(read) == 1 and read != [sha], read  # the small file alone was read whole
    assert os.path.samefile(got, store.object_path(sha)) and store.vouched(w)
    assert hashlib.sha256(store.object_path(sha).read_bytes()).hexdigest() == sha
    # what finds the download in flight is huggingface_hub's own cache scan (its incomplete files): where
    # it lists none, the file is read whole once it has arrived
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "scan_cache_dir",
                        lambda *_a, **_k: SimpleNamespace(incomplete_files=frozenset()))
    osha = hashlib.sha256(other).hexdigest()
    core.download(store, "org/big", Wanted(model="big", commit=commit, path="v.safetensors", size=len(other),
                                           sha256=osha))
    assert read[1:] == [osha] and store.object_path(osha).read_bytes() == other
