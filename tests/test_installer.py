"""The offline installer, run as the hosts run it (``python3 install.pyz ...``) on local tmp roots.

Tests that load images or check image presence use this machine's Docker Engine (marker `docker`).
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder import installer
from builder.bundle import hostpkg
from builder.foundation import sign
from builder.installer import files as host_files
from builder.installer import pack
from builder.installer.errors import InstallError
from builder.installer.files import Writeback, write_all
from builder.installer.manifest import check_manifest, physical_files, release_files
from builder.installer.record import release_ok
from builder.installer.verify import verify_bundle
from tests.lib import bundlelib, factory, rlib
from tests.lib import bundlelib as bl
from tests.lib.bundlelib import bundle, install, run_installer
from tests.lib.hostedit import flip_in_place

SCRIPT = hostpkg.zipapp()


def local_hosts(base: Path) -> list[dict[str, Any]]:
    return bl.local_hosts(base / "host")


def snapshot(root: Path) -> dict[str, Any]:
    """Everything under root (files by content, links by target), ignoring the lock file."""
    return bundlelib.snapshot(root, skip=("state/install.lock",))


# --------------------------------------------------------------------------- fast tier


def test_install_pyz_is_a_deterministic_stdlib_zipapp() -> None:
    """builder.installer's and builder.core's modules, a builder/__init__.py of its own and a __main__.py,
    stored in sorted order with fixed times and modes; every module parses as python 3.8 and imports the
    standard library, builder.core and its own package only."""
    assert SCRIPT.startswith(b"#!/usr/bin/env python3\n")
    top = Path(installer.__file__).parent.parent
    with zipfile.ZipFile(io.BytesIO(SCRIPT)) as z:
        infos = z.infolist()
        names = [i.filename for i in infos]
        modules = sorted(f"builder/{f.relative_to(top).as_posix()}" for pkg in ("core", "installer")
                         for f in (top / pkg).glob("*.py"))
        assert names == ["__main__.py", *sorted(["builder/__init__.py", *modules])]
        for i in infos:
            assert i.date_time == (1980, 1, 1, 0, 0, 0) and i.compress_type == zipfile.ZIP_STORED, i.filename
            assert i.external_attr >> 16 == 0o100644, i.filename
        mods = set()
        for name in names:
            src = z.read(name)
            if name in modules:
                assert src == (top / name.split("/", 1)[1]).read_bytes(), name
            for node in ast.walk(ast.parse(src, feature_version=(3, 8))):
                if isinstance(node, ast.Import):
                    mods.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    mods.add(node.module)
        verifier = z.read("builder/core/minisign.py").decode()
    ours = {m for m in mods if m.split(".")[0] == "builder"}
    assert not {m.split(".")[0] for m in mods - ours} - set(sys.stdlib_module_names), mods
    assert all(m.startswith(("builder.core", "builder.installer")) for m in ours), ours
    assert "def verify_with_openssl" in verifier
    assert hostpkg.zipapp() == SCRIPT == pack.build(pack.sources())  # deterministic
    # the same bytes from another process, and from the zipapp itself
    made = subprocess.run([sys.executable, "-c", "import sys; from builder.installer import pack; "
                           "sys.stdout.buffer.write(pack.zipapp())"], capture_output=True, check=True)
    assert made.stdout == SCRIPT
    # no site-packages and no checkout on the path (-I -S): the zipapp alone carries what it imports
    alone = [sys.executable, "-I", "-S", str(bl.installer_file())]
    again = subprocess.run([*alone, "assemble"], capture_output=True, cwd="/", check=True)
    assert again.stdout == SCRIPT
    p = subprocess.run([*alone, "status", "--root", "/nonexistent/builder-root"], capture_output=True, text=True,
                       cwd="/")
    assert p.returncode == 0 and json.loads(p.stdout)["current"] is None


def test_first_install_needs_a_trusted_key(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path, hosts=local_hosts(tmp_path))
    d = bundle(p, tmp_path / "b")
    root = tmp_path / "host" / "builder"
    r = install(d, root)
    assert r.returncode == 2 and "no trusted key" in r.stderr and r.stderr.count("\n") == 1
    other = tmp_path / "o"
    other.mkdir()
    sign.generate_keypair(other / "k", other / "k.pub")
    r = install(d, root, "--trusted-key", str(other / "k.pub"))
    assert r.returncode == 1 and "not the trusted key" in r.stderr
    assert not (root / "trusted.pub").exists() and not (root / "current").exists()


def test_two_installs_never_interleave(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "state").mkdir(parents=True)
    fd = os.open(root / "state" / "install.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        r = run_installer("rollback", "--root", str(root), "--lock-timeout", "0.3")
        assert r.returncode == 1 and "holds the lock" in r.stderr
    finally:
        os.close(fd)
    r = run_installer("rollback", "--root", str(root))
    assert r.returncode == 1 and "no previous release" in r.stderr


# --------------------------------------------------------------------------- with a Docker Engine


@pytest.fixture
def dproj(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[bl.Project]:
    """The project with its tiny image; the image (an install may have loaded it again) leaves the engine after."""
    if not shutil.which("docker"):
        pytest.skip("no docker CLI")
    p = bl.make_project(tmp_path, hosts=local_hosts(tmp_path), docker_image=True, marker=request.node.nodeid)
    yield p
    _rmi(p.image_id)


def _rmi(image_id: str) -> None:
    subprocess.run(["docker", "image", "rm", "-f", image_id], capture_output=True)


@pytest.mark.docker
def test_install_rerun_upgrade_rollback(dproj: bl.Project, tmp_path: Path) -> None:
    p = dproj
    root = tmp_path / "host" / "builder"
    v1 = bundle(p, tmp_path / "v1", with_image=True, with_models=True, part_size=300_000)
    id1 = bl.manifest(v1)["bundle_id"]
    _rmi(p.image_id)  # the install must load it from the parts
    r = install(v1, root, "--trusted-key", str(p.pub), "--host", "spark-b")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["result"] == "installed"
    assert os.readlink(root / "current") == f"releases/{id1}"
    rec = json.loads((root / "state" / "applied.json").read_text())
    assert rec["bundle_id"] == id1 and rec["action"] == "install" and rec["previous_bundle_id"] is None
    assert rec["image"] == {
        "name": "tiny",
        "input_address": bl.manifest(v1)["image"]["input_address"],
        "image_id": p.image_id,
        "diff_ids": p.diff_ids,
    }
    assert rec["manifest_sha256"] == hashlib.sha256((v1 / "manifest.json").read_bytes()).hexdigest()
    assert {f["path"] for f in rec["files"]} == {
        "config.json",
        "install.pyz",
        "lane.py",
        "rank.env",
        "start.sh",
        "stop.sh",
    }
    for m in rec["models"]:
        st = os.stat(m["path"])
        assert (st.st_size, st.st_ino, st.st_mtime_ns) == (m["size"], m["inode"], m["mtime"])
        assert hashlib.sha256(Path(m["path"]).read_bytes()).hexdigest() == m["sha256"]
    assert sorted(Path(m["path"]).name for m in rec["models"]) == [
        "config.json",
        "tokenizer.json",
        "weights-r1of2.bin",
    ]
    assert subprocess.run(["docker", "image", "inspect", p.image_id], capture_output=True).returncode == 0
    rel = root / "releases" / id1
    assert os.access(rel / "start.sh", os.X_OK) and (rel / "manifest.json.minisig").is_file()
    assert not (rel / "image.tar").exists() and not list(rel.rglob("*.part*"))

    # a rerun of the same bundle changes nothing
    before = snapshot(root)
    r = install(v1, root, "--host", "spark-b")
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "unchanged", r.stderr
    assert "already installed" in r.stderr
    assert snapshot(root) == before

    # a new release of the lane (image already present: no archive needed)
    bl.relock(p, streams=3)
    v2 = bundle(p, tmp_path / "v2")
    id2 = bl.manifest(v2)["bundle_id"]
    r = install(v2, root)
    assert r.returncode == 0, r.stderr
    assert os.readlink(root / "current") == f"releases/{id2}"
    assert os.readlink(root / "previous") == f"releases/{id1}"
    assert json.loads((root / "state" / "applied.json").read_text())["previous_bundle_id"] == id1

    r = run_installer("rollback", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert os.readlink(root / "current") == f"releases/{id1}"
    assert os.readlink(root / "previous") == f"releases/{id2}"
    rec = json.loads((root / "state" / "applied.json").read_text())
    assert (rec["bundle_id"], rec["action"], rec["previous_bundle_id"]) == (id1, "rollback", id2)
    st = json.loads(run_installer("status", "--root", str(root)).stdout)
    assert st["consistent"] and st["current"] == id1 and st["previous"] == id2
    _rmi(p.image_id)


def _new_model_bytes(p: bl.Project, name: str, data: bytes) -> None:
    """The lane's model file ``name`` changed, locked again: a release whose file takes the same path."""
    (p.root / "models" / "demo" / name).write_bytes(data)
    files = {n: (p.root / "models" / "demo" / n).read_bytes() for n in bl.MODEL_FILES}
    factory.write_lock(p.root, image="tiny", model="demo-model", lane=bl.LANE, files=files, platform="linux/amd64")
    bl.write_record_for(p.root, p.image_id, p.diff_ids)


@pytest.mark.docker
def test_a_release_whose_model_file_changed_keeps_the_old_one_so_the_release_before_switches_back(
    dproj: bl.Project, tmp_path: Path
) -> None:
    """A model file has one path whatever the release, so v2 (config.json changed) replaces v1's when it
    installs; v1's file is kept (a hard link in the models folder's .builder-kept, its record entry beside
    it), and a switch back to v1 puts it back, atomically and vouched for without hashing: the rollback a
    deploy whose new model answers otherwise needs. Switching forward again finds v2's file kept in turn;
    a third release lets go of what neither it nor the one before names."""
    p = dproj
    root = tmp_path / "host" / "builder"
    v1 = bundle(p, tmp_path / "v1", with_image=True, with_models=True)
    id1 = bl.manifest(v1)["bundle_id"]
    assert install(v1, root, "--trusted-key", str(p.pub), "--host", "spark-b").returncode == 0
    cfg = next(m["path"] for m in bl.manifest(v1)["models"] if m["path"].endswith("/config.json"))
    old = hashlib.sha256(Path(cfg).read_bytes()).hexdigest()

    _new_model_bytes(p, "config.json", b'{"hidden": 16}\n')
    v2 = bundle(p, tmp_path / "v2", with_models=True)
    id2 = bl.manifest(v2)["bundle_id"]
    r = install(v2, root)
    assert r.returncode == 0, r.stderr
    assert Path(cfg).read_bytes() == b'{"hidden": 16}\n'
    kept_dir = Path(bl.manifest(v1)["paths"]["models"]) / ".builder-kept"
    assert (kept_dir / old).read_bytes() == bundlelib.MODEL_FILES["config.json"]

    # as a deploy's rollback does it: stage the old release (checked: its file goes back), then switch
    r = run_installer("stage", "--root", str(root), "--release", id1)
    assert r.returncode == 0, r.stderr
    r = run_installer("switch", "--root", str(root), "--to", id1, "--rollback")
    assert r.returncode == 0, r.stderr
    assert Path(cfg).read_bytes() == bundlelib.MODEL_FILES["config.json"]
    assert sorted(os.listdir(Path(cfg).parent)) == sorted(Path(m["path"]).name for m in bl.manifest(v1)["models"])
    assert os.stat(cfg).st_ino == os.stat(kept_dir / old).st_ino  # the kept file itself: nothing copied
    st = json.loads(run_installer("status", "--root", str(root)).stdout)
    assert st["consistent"] and st["current"] == id1, st

    r = run_installer("switch", "--root", str(root), "--to", id2)
    assert r.returncode == 0, r.stderr
    assert Path(cfg).read_bytes() == b'{"hidden": 16}\n'

    _new_model_bytes(p, "config.json", b'{"hidden": 32}\n')
    v3 = bundle(p, tmp_path / "v3", with_models=True)
    assert install(v3, root).returncode == 0
    names = set(os.listdir(kept_dir))
    v2_sha = hashlib.sha256(b'{"hidden": 16}\n').hexdigest()
    assert names == {v2_sha, f"{v2_sha}.json"}, names  # v1's let go; v2 (the previous release) kept
    # the model folder holds exactly the model's files: what is kept lives beside it
    assert ".builder-kept" not in os.listdir(Path(cfg).parent)
    _rmi(p.image_id)


@pytest.mark.docker
def test_rehash_places_again_a_file_changed_in_place_or_names_the_bundles_damage(
    dproj: bl.Project, tmp_path: Path
) -> None:
    p = dproj
    root = tmp_path / "host" / "builder"
    b = bundle(p, tmp_path / "b", with_image=True, with_models=True)
    assert install(b, root, "--trusted-key", str(p.pub), "--host", "spark-b").returncode == 0
    rec = json.loads((root / "state" / "applied.json").read_text())
    m = next(x for x in rec["models"] if x["path"].endswith("weights-r1of2.bin"))
    path = Path(m["path"])
    flip_in_place(path)
    r = install(b, root)  # the apply record's size, mtime and inode vouch for it: nothing is done
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "unchanged", r.stderr
    assert hashlib.sha256(path.read_bytes()).hexdigest() != m["sha256"]
    r = install(b, root, "--rehash")  # every file hashed: the changed one is placed again
    assert r.returncode == 0 and json.loads(r.stdout)["result"] != "unchanged", r.stderr
    assert f"placing model file {path}" in r.stderr
    assert hashlib.sha256(path.read_bytes()).hexdigest() == m["sha256"]
    r = install(b, root, "--rehash")
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "unchanged", r.stderr
    # the bundle's own copy damaged too: named, and nothing placed
    flip_in_place(path)
    entry = next(f for f in bl.manifest(b)["files"] if f["path"] == next(
        x["bundled"] for x in bl.manifest(b)["models"] if x["path"] == str(path)))
    flip_in_place(b / (entry.get("parts") or [entry])[0]["path"])
    r = install(b, root, "--rehash")
    assert r.returncode != 0 and entry["path"].split("/")[-1] in r.stderr, r.stderr
    assert hashlib.sha256(path.read_bytes()).hexdigest() != m["sha256"]  # (left as it was: nothing half-placed)


@pytest.mark.docker
def test_refusals_leave_the_host_untouched(dproj: bl.Project, tmp_path: Path) -> None:
    p = dproj
    root = tmp_path / "host" / "builder"
    v1 = bundle(p, tmp_path / "v1", with_image=True, with_models=True)
    assert install(v1, root, "--trusted-key", str(p.pub)).returncode == 0
    bl.relock(p, streams=5)
    v2 = bundle(p, tmp_path / "v2", with_image=True, with_models=True, part_size=200_000)
    before = snapshot(root)
    models_before = snapshot(tmp_path / "host" / "models")

    def refused(why: str, code: int = 1, *extra: str) -> None:
        r = install(v2, root, *extra)
        assert r.returncode == code, (why, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
        assert snapshot(root) == before, why
        assert snapshot(tmp_path / "host" / "models") == models_before, why

    part = v2 / "parts" / "image.tar.part0001"
    data = part.read_bytes()
    part.write_bytes(data[:1000] + bytes([data[1000] ^ 0x10]) + data[1001:])
    refused("flipped byte in an image part")
    part.write_bytes(data[:-5])
    refused("truncated part")
    part.write_bytes(data)
    (v2 / "parts" / "junk").write_bytes(b"x")
    refused("extra file")
    (v2 / "parts" / "junk").unlink()
    sig = (v2 / "manifest.json.minisig").read_bytes()
    (v2 / "manifest.json.minisig").unlink()
    refused("missing signature")
    (v2 / "manifest.json.minisig").write_bytes(sig.replace(b"builder secret key", b"builder secret kez"))
    refused("changed untrusted comment")
    (v2 / "manifest.json.minisig").write_bytes(sig)
    refused("too little disk", 1, "--reserve", str(10**18))
    refused("bundle for another host", 2, "--host", "spark-a")
    assert install(v2, root).returncode == 0  # intact again: accepted


@pytest.mark.docker
def test_image_missing_without_archive_is_refused(dproj: bl.Project, tmp_path: Path) -> None:
    root = tmp_path / "host" / "builder"
    d = bundle(dproj, tmp_path / "b", with_models=True)
    _rmi(dproj.image_id)
    r = install(d, root, "--trusted-key", str(dproj.pub))
    assert r.returncode == 1 and "carries no image" in r.stderr
    assert not (root / "current").exists() and not (tmp_path / "host" / "models").exists()


@pytest.mark.docker
def test_missing_model_is_refused_unless_bundled(dproj: bl.Project, tmp_path: Path) -> None:
    root = tmp_path / "host" / "builder"
    d = bundle(dproj, tmp_path / "b")
    r = install(d, root, "--trusted-key", str(dproj.pub))
    assert r.returncode == 1 and "config.json: missing" in r.stderr
    mdir = tmp_path / "host" / "models" / "demo-model"
    mdir.mkdir(parents=True)
    for n in ("config.json", "tokenizer.json", "weights-r1of2.bin"):
        (mdir / n).write_bytes(bl.MODEL_FILES[n])
    assert not (root / "trusted.pub").exists()  # a failed first install does not pin the key
    assert install(d, root, "--trusted-key", str(dproj.pub)).returncode == 0
    rec = json.loads((root / "state" / "applied.json").read_text())
    assert sorted(m["path"] for m in rec["models"]) == sorted(
        str(mdir / n) for n in ("config.json", "tokenizer.json", "weights-r1of2.bin")
    )
    (mdir / "tokenizer.json").write_bytes(b"changed")
    r = install(d, root)  # the same bundle, but a model file drifted: refused, not "unchanged"
    assert r.returncode == 1 and "tokenizer.json: 7 bytes, expected 22" in r.stderr


def _kill_iterations(p: bl.Project, tmp_path: Path, n: int, seed: int) -> None:
    """Install v1; then n times: copy the host, install v2, SIGKILL it at a random point, check, rerun."""
    base_root = tmp_path / "host" / "builder"
    v1 = bundle(p, tmp_path / "v1", with_image=True, with_models=True, part_size=150_000)
    id1 = bl.manifest(v1)["bundle_id"]
    assert install(v1, base_root, "--trusted-key", str(p.pub)).returncode == 0
    bl.relock(p, streams=7)
    v2 = bundle(p, tmp_path / "v2", with_image=True, with_models=True, part_size=150_000)
    id2 = bl.manifest(v2)["bundle_id"]
    # how long does a full v2 install take here?
    probe = tmp_path / "probe"
    shutil.copytree(base_root, probe, symlinks=True)
    _rmi(p.image_id)
    t0 = time.monotonic()
    assert install(v2, probe).returncode == 0
    span = time.monotonic() - t0
    rng = random.Random(seed)
    outcomes = {"old": 0, "new": 0}
    for i in range(n):
        root = tmp_path / f"r{i}"
        shutil.copytree(base_root, root, symlinks=True)
        _rmi(p.image_id)
        proc = subprocess.Popen(
            [sys.executable, "-I", str(bl.installer_file()), "install", str(v2), "--root", str(root)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            start_new_session=True,
        )
        time.sleep(rng.uniform(0, span * 1.2))  # a few land after the end: the rerun is then a no-op
        rlib.killpg(proc)  # python and whatever it started (docker load)
        cur = os.readlink(root / "current")
        assert cur in (f"releases/{id1}", f"releases/{id2}"), cur
        outcomes["old" if cur.endswith(id1) else "new"] += 1
        visible = {x.name for x in (root / "releases").iterdir() if not x.name.startswith(".tmp-")}
        assert visible <= {id1, id2}
        if id2 in visible:  # a release that is visible is complete
            m, mb, _ = verify_bundle(str(v2), None, insecure=True, hashes=False)
            assert release_ok(str(root / "releases" / id2), m, mb)
        if cur.endswith(id1):
            assert release_ok(str(root / "releases" / id1), *_manifest_pair(v1))
        r = install(v2, root)
        assert r.returncode == 0, r.stderr
        assert os.readlink(root / "current") == f"releases/{id2}"
        assert os.readlink(root / "previous") == f"releases/{id1}"
        rec = json.loads((root / "state" / "applied.json").read_text())
        assert rec["bundle_id"] == id2 and rec["previous_bundle_id"] == id1
        assert not [x for x in (root / "releases").iterdir() if x.name.startswith(".tmp-")]
        shutil.rmtree(root)
    print(f"kill outcomes: {outcomes} (seed {seed}, install span {span:.2f} s)")


def _manifest_pair(d: Path) -> tuple[dict[str, Any], bytes]:
    m, mb, _ = verify_bundle(str(d), None, insecure=True, hashes=False)
    return m, mb


@pytest.mark.docker
def test_install_killed_at_random_points(dproj: bl.Project, tmp_path: Path) -> None:
    _kill_iterations(dproj, tmp_path, 10, seed=int(os.environ.get("BUILDER_KILL_SEED", "1234")))
    _rmi(dproj.image_id)


@pytest.mark.docker
@pytest.mark.slow
def test_install_killed_50_times(dproj: bl.Project, tmp_path: Path) -> None:
    _kill_iterations(dproj, tmp_path, 50, seed=int(os.environ.get("BUILDER_KILL_SEED", "99")))
    _rmi(dproj.image_id)


# --------------------------------------------------------------------------- property: the manifest parser

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=5),
    max_leaves=20,
)


def _valid_manifest() -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="bt-hyp-"))
    try:
        p = bl.make_project(base)
        d = bundle(p, base / "b", with_models=True, part_size=5000)
        return bl.manifest(d)
    finally:
        shutil.rmtree(base, ignore_errors=True)


_VALID: dict[str, Any] = {}


def _mutate(m: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(m))
    node: Any = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _paths(obj: Any, prefix: list[Any]) -> list[list[Any]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, [*prefix, k])
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, [*prefix, i])
    return out


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_manifest_parser_never_crashes(data: st.DataObject) -> None:
    if not _VALID:
        _VALID.update(_valid_manifest())
    if data.draw(st.booleans()):
        obj: Any = data.draw(_json)
    else:
        paths = _paths(_VALID, [])
        where = data.draw(st.sampled_from(paths))
        obj = _mutate(_VALID, where, data.draw(_json))
    try:
        m = check_manifest(obj)
    except InstallError as e:
        assert "\n" not in str(e) and str(e).startswith("manifest.json: ")
    else:
        assert isinstance(m, dict)
        physical_files(m)
        release_files(m)


@pytest.mark.docker
def test_install_links_model_files_it_moves_from_incoming_and_copies_the_rest(
    dproj: bl.Project, tmp_path: Path
) -> None:
    """--remove-source from incoming/ on the models' file system: each model file is hard-linked into
    place and hashed there, not written again (link + remove = rename); without --remove-source, or
    for a file that something else also links, it is copied."""
    root = tmp_path / "host" / "builder"
    out = bundle(dproj, tmp_path / "b", with_models=True)
    models = bl.manifest(out)["models"]
    assert all(os.stat(out / m["bundled"]).st_nlink > 1 for m in models)  # links into the store
    r = install(out, root, "--trusted-key", str(dproj.pub))  # the bundle stays: copies
    assert r.returncode == 0, r.stderr
    for m in models:
        assert os.stat(m["path"]).st_nlink == 1 and not os.path.samefile(m["path"], out / m["bundled"])
    shutil.rmtree(tmp_path / "host" / "models")
    shutil.rmtree(root / "releases")
    (root / "current").unlink()
    (root / "state" / "applied.json").unlink()

    inc = root / "incoming" / "usb"
    shutil.copytree(out, inc)  # as `cp -r` from the sneakernet disk: one name per file
    inodes = {m["path"]: os.stat(inc / m["bundled"]).st_ino for m in models}
    r = install(inc, root, "--remove-source")
    assert r.returncode == 0, r.stderr
    assert not inc.exists()
    for m in models:
        st = os.stat(m["path"])
        assert st.st_ino == inodes[m["path"]] and st.st_nlink == 1 and st.st_mode & 0o777 == 0o644
        assert hashlib.sha256(Path(m["path"]).read_bytes()).hexdigest() == m["sha256"]
    rec = json.loads((root / "state" / "applied.json").read_text())
    assert {m["path"]: m["inode"] for m in rec["models"]} == inodes  # fast mode's record: the placed inode


@pytest.mark.docker
def test_a_changed_model_file_in_incoming_is_refused_and_not_placed(dproj: bl.Project, tmp_path: Path) -> None:
    root = tmp_path / "host" / "builder"
    out = bundle(dproj, tmp_path / "b", with_models=True)
    inc = root / "incoming" / "usb"
    shutil.copytree(out, inc)
    m = next(m for m in bl.manifest(out)["models"] if m["path"].endswith("tokenizer.json"))
    data = bytearray((inc / m["bundled"]).read_bytes())
    data[0] ^= 1  # same size: only the hash can tell
    (inc / m["bundled"]).write_bytes(bytes(data))
    r = install(inc, root, "--trusted-key", str(dproj.pub), "--remove-source")
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].endswith("sha256 mismatch (changed file)"), r.stderr
    assert m["bundled"] in r.stderr
    assert inc.is_dir() and not (root / "current").exists()
    assert not [p for p in (tmp_path / "host" / "models").rglob("*") if p.is_file()]


def test_writeback_is_started_behind_the_writes_and_the_bytes_are_whole(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """write_all with a Writeback: every byte lands in the file, and the disk is asked to start
    writing each WRITEBACK_STEP once it is written (in order, no range twice, none not yet written)."""
    started: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        started.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(host_files, "WRITEBACK_STEP", 1 << 20)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    data = random.Random(7).randbytes(5 * (1 << 20) + 12345)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        wb = Writeback(fd)
        view = memoryview(data)
        for at in range(0, len(data), 300_000):
            write_all(fd, view[at : at + 300_000], wb)
            assert sum(n for _, n in started) <= at + 300_000
        os.fsync(fd)
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    assert started and started[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(started, started[1:], strict=False))
    assert all(n >= 1 << 20 for _, n in started)
    assert len(data) - sum(n for _, n in started) < (1 << 20) + 300_000


def test_a_damaged_release_is_replaced_and_its_path_never_lacks_one(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from builder.core import atomic
    from builder.installer import release as host_release
    from builder.installer.root import Root
    bid, body = "b" * 64, b"PORT=8000\n"
    manifest = {"bundle_id": bid, "image": {"archive": "image.tar"}, "models": [],
                "files": [{"path": "launch/rank.env", "mode": "0644", "size": len(body),
                           "sha256": hashlib.sha256(body).hexdigest()}]}
    bundle_dir = tmp_path / "incoming"
    (bundle_dir / "launch").mkdir(parents=True)
    (bundle_dir / "launch" / "rank.env").write_bytes(body)
    r = Root(str(tmp_path / "root"))
    final = Path(r.release(bid))
    (final / "launch").mkdir(parents=True)
    (final / "launch" / "rank.env").write_bytes(b"PORT=9999\n")  # damaged: another content
    seen: list[bytes] = []
    rmtree = shutil.rmtree

    def watch(path: str, *a: Any, **k: Any) -> None:  # what the release path holds while the old one goes
        if os.path.basename(path).startswith(atomic.tmp_stem(final) + "old-"):
            seen.append((final / "launch" / "rank.env").read_bytes())
        rmtree(path, *a, **k)

    monkeypatch.setattr(atomic.shutil, "rmtree", watch)
    host_release.stage_release(r, str(bundle_dir), manifest, b"{}", b"", link=True)
    assert seen == [body]  # the new release was already in place when the old one was removed
    assert (final / "launch" / "rank.env").read_bytes() == body and (final / "manifest.json").read_bytes() == b"{}"
    assert sorted(os.listdir(r.releases)) == [bid]  # nothing left aside
