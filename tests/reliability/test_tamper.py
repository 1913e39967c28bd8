"""One byte changed at random offsets: bundles at install time, patches, store entries, model files.

Already elsewhere: tests/test_bundle.py flips 220 offsets across a bundle (manifest, signature, parts,
bundled models) against `builder verify`; tests/test_installer.py refuses a handful of tampered
bundles with the host unchanged; tests/test_checks_fleet.py finds a corrupt model byte over ssh.
Here: the installer itself refuses 220 offsets across a bundle that carries the image archive, and
the host is byte-for-byte unchanged after each; patches against the lock; store objects and trees;
model files against the lock (bundle --with-models, lock --update) and the audit (local backend).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from builder.bundle import BundleOptions, load_bundle_inputs, make_bundle
from builder.errors import BuilderError, ConfigError, VerifyError
from builder.foundation.canon import sha256_tree
from builder.foundation.hashing import sha256_file
from builder.image import build as image
from builder.installer.errors import InstallError
from builder.installer.install import Admission, install
from builder.lock.lockfile import load_lock
from builder.store.content import Store
from tests.lib import auditlib, factory, rlib
from tests.lib import bundlelib as bl
from tests.lib.gitlib import Upstream


def flip_offsets(d: Path, n: int, seed: int) -> list[tuple[str, int]]:
    """Every file at least once, then offsets drawn alternately by size across the folder and by file."""
    rng = random.Random(seed)
    files = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    sizes = {f: (d / f).stat().st_size for f in files}
    total = sum(sizes.values())
    out = [(f, rng.randrange(sizes[f])) for f in files if sizes[f]]
    while len(out) < n:
        if len(out) % 2:
            f = rng.choice([f for f in files if sizes[f]])
            out.append((f, rng.randrange(sizes[f])))
            continue
        x = rng.randrange(total)
        for f in files:
            if x < sizes[f]:
                out.append((f, x))
                break
            x -= sizes[f]
    return out


def flip(path: Path, off: int, rng: random.Random) -> bytes:
    """XOR one bit of the byte at off; return the old byte (the file may be read-only)."""
    mode = path.stat().st_mode
    os.chmod(path, mode | 0o200)
    with open(path, "r+b") as f:
        f.seek(off)
        old = f.read(1)
        f.seek(off)
        f.write(bytes([old[0] ^ (1 << rng.randrange(8))]))
    os.chmod(path, mode)
    return old


def unflip(path: Path, off: int, old: bytes) -> None:
    mode = path.stat().st_mode
    os.chmod(path, mode | 0o200)
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(old)
    os.chmod(path, mode)


# --------------------------------------------------------------------------- bundles, at install time


@pytest.mark.docker
@pytest.mark.slow
def test_installer_refuses_220_offsets_across_a_bundle_with_its_image(tmp_path: Path) -> None:
    if not shutil.which("docker"):
        pytest.skip("no docker CLI")
    host = tmp_path / "host"
    hs = bl.local_hosts(host)
    p = bl.make_project(tmp_path, hosts=hs, docker_image=True, marker=f"tamper-{tmp_path}")
    try:
        ctx = load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)
        v1 = make_bundle(
            ctx, "spark-b", BundleOptions(key=p.key, out=tmp_path / "v1", with_image=True, with_models=True)
        ).path
        root = host / "builder"
        install(str(v1), str(root), Admission(trusted_key=p.pub.read_bytes()))
        bl.relock(p, streams=5)
        ctx = load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)
        v2 = make_bundle(
            ctx,
            "spark-b",
            BundleOptions(key=p.key, out=tmp_path / "v2", with_image=True, with_models=True, part_size=300_000),
        ).path
        files = {f.relative_to(v2).as_posix() for f in v2.rglob("*") if f.is_file()}
        assert {"manifest.json", "manifest.json.minisig"} <= files
        assert any(f.startswith("parts/image.tar.part") for f in files), files
        before = rlib.snapshot(root, skip=("state/install.lock",))
        models_before = rlib.snapshot(host / "models")
        rng = random.Random(rlib.kill_seed(31))
        hits: dict[str, int] = {}
        offsets = flip_offsets(v2, 220, seed=rlib.kill_seed(29))
        for rel, off in offsets:
            old = flip(v2 / rel, off, rng)
            try:
                with pytest.raises(InstallError) as e:
                    install(str(v2), str(root))
                rlib.assert_one_line(e.value)
                assert rlib.snapshot(root, skip=("state/install.lock",)) == before, (rel, off)
                assert rlib.snapshot(host / "models") == models_before, (rel, off)
            finally:
                unflip(v2 / rel, off, old)
            top = rel.split("/")[0] if not rel.startswith("parts/") else rel.split(".part")[0]
            hits[top] = hits.get(top, 0) + 1
        assert len(offsets) >= 220
        res = install(str(v2), str(root))  # restored: installs
        assert res["result"] == "installed"
        rlib.record_figures("tamper-install", {"offsets": len(offsets), "by_file": hits})
    finally:
        subprocess.run(["docker", "rmi", "-f", p.image_id], capture_output=True)


# --------------------------------------------------------------------------- patches against the lock


def _patch_project(base: Path) -> Path:
    up = Upstream(base, "up")
    up.commit({"README": "engine\n"}, "c1")
    up.push()
    root = base / "proj"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "0001-fix.patch").write_text(
        "diff --git a/README b/README\n--- a/README\n+++ b/README\n@@ -1 +1 @@\n-engine\n+engine (patched)\n"
    )
    (root / "images" / "demo").mkdir(parents=True)
    (root / "images" / "demo" / "Dockerfile").write_text("FROM scratch\n")
    factory.write_pins(root, factory.pins(
        sources={"engine": {"url": str(up.url), "ref": "main",
                            "patches": [{"file": "patches/0001-fix.patch", "reason": "mark the build"}]}},
        images={"demo": factory.image("images/demo", sources=["engine"])}))
    r = rlib.run_builder("--pins", str(root / "pins.toml"), "lock", cwd=root)
    assert r.returncode == 0, r.stderr
    return root


def test_image_refuses_a_patch_that_no_longer_matches_the_lock(tmp_path: Path) -> None:
    root = _patch_project(tmp_path)
    patch = root / "patches" / "0001-fix.patch"
    image.load_inputs(root / "pins.toml", root / "pins.lock", "demo")  # intact: accepted
    rng = random.Random(5)
    size = patch.stat().st_size
    for off in rng.sample(range(size), 40):
        old = flip(patch, off, rng)
        try:
            with pytest.raises(ConfigError) as e:
                image.build(root / "pins.toml", root / "pins.lock", root / ".cache" / "builder", "demo")
            msg = rlib.assert_one_line(e.value)
            assert "patches/0001-fix.patch changed since the lock" in msg, msg
        finally:
            unflip(patch, off, old)
    assert not (root / ".cache" / "builder" / "tmp").exists()  # refused before any build context
    # through the CLI: exit 2, one line naming the patch, nothing built
    flip(patch, 3, rng)
    r = rlib.run_builder("--pins", str(root / "pins.toml"), "image", "demo", cwd=root)
    rlib.assert_clean_cli(r, allowed=(2,))
    assert "0001-fix.patch" in r.stderr and not (root / ".cache" / "builder" / "images").exists()


def test_store_refuses_a_patch_blob_changed_in_the_store(tmp_path: Path) -> None:
    """Second line of defence: the patch's store object is re-hashed before it goes into a build context."""
    root = _patch_project(tmp_path)
    lp = load_lock(root / "pins.lock").sources["engine"].patches[0]
    store = Store(root / ".cache" / "builder")
    blob = store.put_file(root / lp.file, lp.sha256, "sources.engine.patches[0]")
    rng = random.Random(8)
    for off in rng.sample(range(blob.stat().st_size), 30):
        old = flip(blob, off, rng)
        try:
            with pytest.raises(VerifyError) as e:
                store.put_file(root / lp.file, lp.sha256, "sources.engine.patches[0]")
            assert "is corrupt" in rlib.assert_one_line(e.value)
        finally:
            unflip(blob, off, old)
    assert store.verified(lp.sha256, "patch") == blob


# --------------------------------------------------------------------------- store entries


def test_store_objects_and_trees_refuse_any_changed_byte(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    src = tmp_path / "blob"
    src.write_bytes(os.urandom(200_000))
    digest = sha256_file(src)[0]
    obj = store.put_file(src, digest, "files.blob")
    tree = tmp_path / "tree"
    for i in range(20):
        (tree / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (tree / f"d{i % 3}" / f"f{i}").write_bytes(os.urandom(3000))
    tsha = sha256_tree(tree)

    def export(d: Path) -> None:
        shutil.copytree(tree, d, dirs_exist_ok=True)

    tdir = store.put_tree(tsha, export, "sources.x")
    rng = random.Random(3)
    for off in rng.sample(range(obj.stat().st_size), 100):
        old = flip(obj, off, rng)
        try:
            with pytest.raises(VerifyError) as e:
                store.verified(digest, "files.blob")
            assert "files.blob: store entry" in rlib.assert_one_line(e.value)
        finally:
            unflip(obj, off, old)
    tfiles = sorted(p for p in tdir.rglob("*") if p.is_file())
    for _ in range(100):
        f = rng.choice(tfiles)
        off = rng.randrange(f.stat().st_size)
        old = flip(f, off, rng)
        try:
            with pytest.raises(VerifyError) as e:
                store.verified_tree(tsha, "sources.x")
            assert "sources.x: store tree" in rlib.assert_one_line(e.value)
        finally:
            unflip(f, off, old)
    assert store.verified(digest, "files.blob") == obj and store.verified_tree(tsha, "sources.x") == tdir
    # `builder gc --verify` drops a corrupt object even when the lock still names it
    flip(obj, 0, rng)
    rep = store.gc({digest}, {tsha}, set(), verify=True)
    assert f"objects/{digest}" in rep.removed and not obj.exists()


# --------------------------------------------------------------------------- model files against the lock


def test_bundle_with_models_refuses_a_model_file_changed_since_the_lock(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    ctx = load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)
    out = tmp_path / "b"
    rng = random.Random(21)
    mdir = p.root / "models" / "demo"
    names = ["config.json", "tokenizer.json", "weights-r1of2.bin"]  # what rank 1 carries
    for i in range(30):
        f = mdir / names[i % len(names)]
        off = rng.randrange(f.stat().st_size)
        old = flip(f, off, rng)
        try:
            with pytest.raises(VerifyError) as e:
                make_bundle(ctx, "spark-b", BundleOptions(key=p.key, out=out, with_models=True))
            msg = rlib.assert_one_line(e.value)
            # named with the lock's hash: on its import into the model store, or (once imported, as
            # the store's object is a link to it) as the store's copy changed behind builder's back
            assert f.name in msg and "the lock says" in msg, msg
            assert not out.exists() and not [x for x in tmp_path.iterdir() if x.name.startswith(".tmp-")]
        finally:
            unflip(f, off, old)
    assert make_bundle(ctx, "spark-b", BundleOptions(key=p.key, out=out, with_models=True)).files > 0


def test_lock_update_reports_a_changed_model_file(tmp_path: Path) -> None:
    """`lock --check` does not re-hash model files; `--update` does, and reports the move."""
    root = tmp_path / "proj"
    m = root / "models" / "tiny"
    m.mkdir(parents=True)
    (m / "config.json").write_text("{}\n")
    (m / "w.bin").write_bytes(b"\x01" * 5000)
    factory.write_pins(root, factory.pins(models={"tiny": factory.model("org/tiny", "c" * 40, local="models/tiny")}))
    assert rlib.run_builder("--pins", str(root / "pins.toml"), "lock", cwd=root).returncode == 0
    before = json.loads((root / "pins.lock").read_text())["models"]["tiny"]["files"]
    old = flip(m / "w.bin", 1234, random.Random(1))
    assert old
    r = rlib.run_builder("--pins", str(root / "pins.toml"), "lock", "--update", "tiny", "--json", cwd=root)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [x["input"] for x in out["moved"]] == ["models.tiny"], out
    after = json.loads((root / "pins.lock").read_text())["models"]["tiny"]["files"]
    changed = [a["path"] for a, b in zip(before, after, strict=True) if a["sha256"] != b["sha256"]]
    assert changed == ["w.bin"]
    assert after[1]["sha256"] == hashlib.sha256((m / "w.bin").read_bytes()).hexdigest()


@pytest.mark.slow
def test_audit_full_mode_names_every_model_file_with_a_changed_byte(tmp_path: Path) -> None:
    """The audit (testinfra, local backend) against the lock: one flipped byte per file, each named."""
    paths = auditlib.make_project(tmp_path / "proj", tp=1)
    mroot = tmp_path / "m" / "tiny"
    mroot.mkdir(parents=True)
    for rel, data in auditlib.MODEL_FILES.items():
        (mroot / rel).write_bytes(data)
    hosts = [auditlib.local_host(tmp_path)]
    (paths["hosts"] / "l.toml").write_text(auditlib.fleet_toml("l", hosts, expect={"docker": False, "gpu_count": 0}))

    def audit() -> tuple[int, dict[str, Any], str]:
        r = rlib.run_builder(
            "--pins",
            str(paths["pins"]),
            "audit",
            "--fleet",
            "l",
            "--json",
            "--only",
            "models",
            "--mode",
            "full",
            "--checks",
            str(rlib.REPO / "checks"),
            cwd=paths["pins"].parent,
        )
        assert "Traceback" not in r.stderr
        return r.returncode, json.loads(r.stdout), r.stderr

    rc, data, err = audit()
    assert rc == 0, err
    rng = random.Random(4)
    for _ in range(2):
        flipped = []
        for rel in auditlib.MODEL_FILES:
            f = mroot / rel
            off = rng.randrange(f.stat().st_size)
            flipped.append((f, off, flip(f, off, rng)))
        rc, data, err = audit()
        assert rc == 1, err
        msg = data["hosts"]["me"]["checks"]["models::content"]["message"]
        for f, _, _ in flipped:
            assert str(f) in msg, msg
        for f, off, old in flipped:
            unflip(f, off, old)
    assert audit()[0] == 0


def test_errors_here_are_builder_errors() -> None:
    assert issubclass(VerifyError, BuilderError) and issubclass(ConfigError, BuilderError)
