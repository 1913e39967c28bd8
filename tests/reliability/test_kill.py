"""SIGKILL at random points: `builder lock`, store writes, `builder bundle`, `builder ship --to`.

Each loop runs BUILDER_KILL_RUNS times (default 10; the documented longer run in docs/reliability.md
uses 50) with kill points spread over one measured run (half of them over its last 40 %, where the
writing happens). After every kill: nothing partial is visible under a real name (the old bytes or
a complete, valid new result), and a rerun completes. The installer's own kill loop (10 and 50 runs,
previous release still current) is tests/test_installer.py; ship over ssh killed part-way and
resumed is tests/test_ship.py.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from builder.bundle import verify_dir
from builder.core.atomic import tmp_stem
from builder.foundation.canon import sha256_tree
from builder.foundation.hashing import sha256_file
from builder.installer.errors import InstallError
from builder.installer.verify import verify_bundle
from builder.lock.lockfile import check_lock, load_lock
from builder.store.content import Store
from tests.lib import bundlelib as bl
from tests.lib import clirun, factory, rlib
from tests.lib.gitlib import Upstream

pytestmark = pytest.mark.slow


def kill_delay(rng: random.Random, span: float) -> float:
    """Half the kills anywhere in a run, half in its last 60 % (where the writing happens); a few after."""
    if rng.random() < 0.5:
        return rng.uniform(0, span * 1.05)
    return rng.uniform(span * 0.4, span * 1.05)


def measure(argv: list[str], cwd: Path, reset: Callable[[], None] | None = None) -> float:
    """The longer of two full runs (the first may be warmed up less, or more, than the killed ones)."""
    spans = []
    for _ in range(2):
        if reset is not None:
            reset()
        spans.append(rlib.timed(argv, cwd=cwd))
    return max(spans)


# --------------------------------------------------------------------------- builder lock


def make_lock_project(base: Path) -> Path:
    """A project with a git source (file:// remote), a patch, a plain file and a local model (~24 MiB)."""
    up = Upstream(base, "up")
    up.commit({f"src{i}.txt": f"line {i}\n" * 200 for i in range(40)}, "c1")
    up.push()
    root = base / "proj"
    (root / "patches").mkdir(parents=True)
    (root / "patches" / "0001.patch").write_text("--- a/src0.txt\n+++ b/src0.txt\n")
    (root / "images" / "demo").mkdir(parents=True)
    (root / "images" / "demo" / "Dockerfile").write_text("FROM scratch\n")
    (root / "files").mkdir()
    tpl = b"{{ messages }}\n"
    (root / "files" / "t.jinja").write_bytes(tpl)
    m = root / "models" / "tiny"
    m.mkdir(parents=True)
    for i in range(6):
        (m / f"model-0000{i + 1}-of-00006.safetensors").write_bytes(bytes([i]) * (4 << 20))
    (root / "pins.toml").write_text(lock_pins(up.bare, tpl, "first reason"))
    return root


def lock_pins(bare: Path, tpl: bytes, reason: str, extra_model: bool = False) -> str:
    tiny = factory.model("org/tiny", "c" * 40, local="models/tiny")
    models = {"tiny": tiny} | ({"again": factory.model("org/again", "d" * 40, local="models/tiny")}
                               if extra_model else {})
    return factory.toml(factory.pins(
        sources={"engine": {"url": f"file://{bare}", "ref": "main",
                            "patches": [{"file": "patches/0001.patch", "reason": reason}]}},
        files={"t": {"url": "files/t.jinja", "sha256": hashlib.sha256(tpl).hexdigest()}},
        models=models,
        images={"demo": factory.image("images/demo", sources=["engine"], files=["t"])},
        lanes={"demo": factory.lane("demo", ["tiny"], serve={
            "tensor_parallel": 1, "context": 1024, "streams": 1, "port": 8000, "served_name": "tiny"})},
    ))


def test_lock_killed_at_random_points(tmp_path: Path) -> None:
    base = make_lock_project(tmp_path)
    bare = tmp_path / "up.git"
    assert rlib.run_builder("--pins", str(base / "pins.toml"), "lock", cwd=base).returncode == 0
    old = (base / "pins.lock").read_bytes()
    new_pins = lock_pins(bare, b"{{ messages }}\n", "second reason", extra_model=True)
    probe = tmp_path / "probe"

    def reset() -> None:
        shutil.rmtree(probe, ignore_errors=True)
        shutil.copytree(base, probe, symlinks=True)
        (probe / "pins.toml").write_text(new_pins)

    argv = [*clirun.ARGV, "--pins", "pins.toml", "lock"]
    span = measure(argv, probe, reset)
    rng = random.Random(rlib.kill_seed(7))
    outcomes = {"old": 0, "new": 0, "finished": 0}
    leftovers = 0
    reruns: list[float] = []
    for i in range(rlib.kill_runs()):
        work = tmp_path / f"k{i}"
        shutil.copytree(base, work, symlinks=True)
        if i % 2:  # half the runs also build the git mirror from nothing
            shutil.rmtree(work / ".cache", ignore_errors=True)
        (work / "pins.toml").write_text(new_pins)
        proc = rlib.start_killable(argv, cwd=work)
        time.sleep(kill_delay(rng, span))
        if not rlib.killpg(proc):
            outcomes["finished"] += 1
        data = (work / "pins.lock").read_bytes()
        if data == old:
            outcomes["old"] += 1
        else:  # anything else must be the complete new lock
            outcomes["new"] += 1
            res = check_lock(work / "pins.toml", work / "pins.lock")
            assert res.ok, res.problems
        leftovers += len(list(work.glob(f"{tmp_stem('pins.lock')}*")))
        t0 = time.monotonic()
        r = rlib.run_builder("--pins", "pins.toml", "lock", cwd=work)
        reruns.append(time.monotonic() - t0)
        assert r.returncode == 0, r.stderr
        assert check_lock(work / "pins.toml", work / "pins.lock").ok
        load_lock(work / "pins.lock")
        assert r.stderr.count("Traceback") == 0
        shutil.rmtree(work)
    rlib.record_figures(
        "lock",
        {
            "runs": rlib.kill_runs(),
            "span_s": round(span, 2),
            **outcomes,
            "tmp_files_left": leftovers,
            "rerun_max_s": round(max(reruns), 2),
        },
    )


# --------------------------------------------------------------------------- store writes

#: one store write as its own process (tests/lib/storeput.py)
STORE_PUT = [sys.executable, "-m", "tests.lib.storeput"]


def copier(src: Path) -> Callable[[Path], None]:
    def export(d: Path) -> None:
        shutil.copytree(src, d, dirs_exist_ok=True)

    return export


def rmtree_ro(path: Path) -> None:
    """Remove a store (objects are 0444 in 0755 folders; a killed writer may leave anything)."""
    for dirpath, dirs, _files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(dirpath, d), 0o755)
    shutil.rmtree(path)


def check_store(store: Path) -> tuple[int, int]:
    """Every visible entry is complete and verified; returns (objects, trees)."""
    objs = sorted((store / "objects").iterdir()) if (store / "objects").is_dir() else []
    for p in objs:
        assert p.is_file() and sha256_file(p)[0] == p.name, f"partial object visible: {p.name}"
    trees = sorted((store / "trees").iterdir()) if (store / "trees").is_dir() else []
    for t in trees:
        assert sha256_tree(t) == t.name, f"partial tree visible: {t.name}"
    return len(objs), len(trees)


def test_store_writes_killed_at_random_points(tmp_path: Path) -> None:
    blob = tmp_path / "blob.bin"
    with open(blob, "wb") as f:
        for i in range(48):
            f.write(hashlib.sha256(str(i).encode()).digest() * (1 << 15))  # 48 MiB, not all one byte
    blob_sha = sha256_file(blob)[0]
    tree = tmp_path / "tree"
    for i in range(400):
        d = tree / f"d{i % 20}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i}.bin").write_bytes(bytes([i % 256]) * 40000)
    tree_sha = sha256_tree(tree)
    spans = {}
    for mode, src, digest in (("file", blob, blob_sha), ("tree", tree, tree_sha)):
        probe = tmp_path / f"probe-{mode}"
        spans[mode] = rlib.timed([*STORE_PUT, str(probe), mode, str(src), digest], cwd=tmp_path)
        shutil.rmtree(probe, ignore_errors=True)
    rng = random.Random(rlib.kill_seed(11))
    figures: dict[str, int] = {"complete_after_kill": 0, "absent_after_kill": 0, "staging_left": 0}
    for i in range(rlib.kill_runs()):
        for mode, src, digest in (("file", blob, blob_sha), ("tree", tree, tree_sha)):
            store = tmp_path / f"s{i}-{mode}"
            proc = rlib.start_killable([*STORE_PUT, str(store), mode, str(src), digest], cwd=tmp_path)
            time.sleep(kill_delay(rng, spans[mode]))
            rlib.killpg(proc)
            n_obj, n_tree = check_store(store)
            figures["complete_after_kill" if n_obj + n_tree else "absent_after_kill"] += 1
            if (store / "tmp").is_dir():
                figures["staging_left"] += len(list((store / "tmp").iterdir()))
            # the next writer completes; `builder image` and `builder gc` clean staging under the lock
            s = Store(store)
            if mode == "file":
                s.put_file(src, digest, "blob")
                assert s.verified(digest, "blob").is_file()
            else:
                s.put_tree(digest, copier(src), "tree")
                assert s.verified_tree(digest, "tree").is_dir()
            with s.locked():
                s.clean_tmp()
            assert not (store / "tmp").exists() or not list((store / "tmp").iterdir())
            assert check_store(store) == ((1, 0) if mode == "file" else (0, 1))
            rmtree_ro(store)
    rlib.record_figures(
        "store",
        {
            "runs": rlib.kill_runs() * 2,
            **figures,
            "span_file_s": round(spans["file"], 2),
            "span_tree_s": round(spans["tree"], 2),
        },
    )


# --------------------------------------------------------------------------- builder bundle


def parted_bundle_args(p: Any) -> list[str]:
    """`builder bundle spark-b` with its models, in 1 KiB parts (many files: many points to kill at)."""
    return ["--pins", str(p.pins), "bundle", "spark-b", "--key", str(p.key), "--with-models", "--part-size", "1KiB"]


def test_bundle_killed_at_random_points(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    args = parted_bundle_args(p)
    r = rlib.run_builder(*args, cwd=p.root)
    assert r.returncode == 0, r.stderr
    out = p.out("spark-b")
    id1 = bl.manifest(out)["bundle_id"]
    v1 = tmp_path / "v1"
    shutil.copytree(out, v1)
    bl.relock(p, streams=7)

    def reset() -> None:
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(v1, out)

    span = measure([*clirun.ARGV, *args], p.root, reset)
    id2 = bl.manifest(out)["bundle_id"]
    assert id2 != id1
    rng = random.Random(rlib.kill_seed(13))
    outcomes = {"old": 0, "new": 0, "absent": 0}
    for _ in range(rlib.kill_runs()):
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(v1, out)
        proc = rlib.start_killable([*clirun.ARGV, *args], cwd=p.root)
        time.sleep(kill_delay(rng, span))
        rlib.killpg(proc)
        if not out.exists():  # killed between moving the old folder aside and the new one in
            outcomes["absent"] += 1
        else:
            got = verify_dir(out, p.pub)["bundle_id"]  # whatever is there is complete and signed
            assert got in (id1, id2)
            outcomes["old" if got == id1 else "new"] += 1
        r = rlib.run_builder(*args, "--json", cwd=p.root)
        assert r.returncode == 0, r.stderr
        assert verify_dir(out, p.pub)["bundle_id"] == id2
        assert not [x for x in out.parent.iterdir() if x.name.startswith(".tmp-")]
    rlib.record_figures("bundle", {"runs": rlib.kill_runs(), "span_s": round(span, 2), **outcomes})


# --------------------------------------------------------------------------- builder ship --to (sneakernet)


def test_ship_to_folder_killed_at_random_points(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    r = rlib.run_builder(*parted_bundle_args(p), cwd=p.root)
    assert r.returncode == 0, r.stderr
    bid = bl.manifest(p.out("spark-b"))["bundle_id"]
    usb = tmp_path / "usb"
    args = ["--pins", str(p.pins), "ship", "spark-b", "--to", str(usb), "--key", str(p.pub)]
    span = measure([*clirun.ARGV, *args], p.root, lambda: shutil.rmtree(usb, ignore_errors=True))
    rng = random.Random(rlib.kill_seed(17))
    outcomes = {"complete": 0, "incomplete_refused": 0}
    dest = usb / bl.FLEET / "spark-b"
    for _ in range(rlib.kill_runs()):
        shutil.rmtree(usb, ignore_errors=True)
        proc = rlib.start_killable([*clirun.ARGV, *args], cwd=p.root)
        time.sleep(kill_delay(rng, span))
        rlib.killpg(proc)
        if dest.exists():
            # a cut copy may be incomplete, but never passes as a bundle: the installer refuses it
            try:
                assert verify_dir(dest, p.pub)["bundle_id"] == bid
                outcomes["complete"] += 1
            except Exception as e:  # noqa: BLE001
                rlib.assert_one_line(e)
                outcomes["incomplete_refused"] += 1
                try:
                    verify_bundle(str(dest), p.pub.read_bytes())
                except InstallError as e2:
                    rlib.assert_one_line(e2)
                else:
                    raise AssertionError("the installer accepted a copy the verifier refused") from None
        else:
            outcomes["incomplete_refused"] += 1
        r = rlib.run_builder(*args, "--json", cwd=p.root)
        assert r.returncode == 0, r.stderr
        assert verify_dir(dest, p.pub)["bundle_id"] == bid
        assert not [x for x in dest.parent.iterdir() if x.name.startswith(".tmp-")]
    rlib.record_figures("ship-to", {"runs": rlib.kill_runs(), "span_s": round(span, 2), **outcomes})
