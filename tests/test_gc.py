"""`builder gc`: what the lock refers to stays, the rest goes; `--dry-run` removes nothing.

A copy of the shipped project with its own store, filled through the real store API (the engine
tree exported from the real git bundle) plus entries no lock names; then the real CLI.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from builder.foundation.canon import file_lock
from builder.lock import gitsrc
from builder.lock.lockfile import load_lock
from builder.store.content import Store
from tests.lib.shipped import PATCH_REL, builder, copy_project, plan_of, relock


def snapshot(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


class Filled:
    """A project copy and a store holding what its lock names plus strays."""

    def __init__(self, tmp: Path) -> None:
        self.root = copy_project(tmp / "proj")
        self.store_root = tmp / "store"
        self.store = Store(self.store_root)
        self.refresh()

    def refresh(self) -> None:
        lock = load_lock(self.root / "pins.lock")
        self.lock = lock
        src = lock.sources["demo-engine"]
        for p in src.patches:
            self.store.put_file(self.root / p.file, p.sha256, p.file)
        f = lock.files["demo-chat-template"]
        self.store.put_file(self.root / f.url, f.sha256, "files.demo-chat-template")
        url = gitsrc.source_url(src.url, self.root)

        def export(d: Path) -> None:
            mirror = gitsrc.ensure_mirror(url, self.store_root / "git", offline=True, name="demo-engine")
            gitsrc.export_tree(mirror, src.commit, d)

        self.store.put_tree(src.tree_sha256, export, "sources.demo-engine")
        self.address = plan_of(self.root)["input_address"]
        (self.store_root / "images").mkdir(exist_ok=True)
        (self.store_root / "images" / f"{self.address}.json").write_text("{}\n")

    def add_strays(self) -> set[str]:
        stray = b"an old patch nobody pins any more\n"
        sha = hashlib.sha256(stray).hexdigest()
        (self.store.tmp).mkdir(parents=True, exist_ok=True)
        src = self.store.tmp.parent / "stray.in"
        src.write_bytes(stray)
        self.store.put_file(src, sha, "stray")
        src.unlink()
        old_tree = self.store.trees / ("e" * 64)
        (old_tree / "src").mkdir(parents=True)
        (old_tree / "src" / "main.zig").write_text("old\n")
        (old_tree / "src" / "main.zig").chmod(0o444)
        (old_tree / "src").chmod(0o555)  # read-only folders, as exported trees may be
        (self.store_root / "images" / ("d" * 64 + ".json")).write_text("{}\n")
        leftover = self.store.tmp / f"stage-{dead_pid()}-abc"
        leftover.mkdir()
        (leftover / "blob").write_bytes(b"half")
        return {f"objects/{sha}", f"trees/{'e' * 64}", f"images/{'d' * 64}.json"}

    def gc(self, *args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
        return builder(self.root, "gc", "--json", *args, store=self.store_root, env=env)

    def referenced(self) -> set[str]:
        src = self.lock.sources["demo-engine"]
        return {
            *(f"objects/{p.sha256}" for p in src.patches),
            f"objects/{self.lock.files['demo-chat-template'].sha256}",
            f"trees/{src.tree_sha256}",
            f"images/{self.address}.json",
        }


@pytest.fixture
def filled(tmp_path: Path) -> Filled:
    return Filled(tmp_path)


def present(f: Filled) -> set[str]:
    out: set[str] = set()
    for folder in ("objects", "trees", "images"):
        d = f.store_root / folder
        if d.is_dir():
            out |= {f"{folder}/{p.name}" for p in d.iterdir()}
    return out


def test_dry_run_removes_nothing_then_gc_removes_only_strays(filled: Filled) -> None:
    strays = filled.add_strays()
    assert present(filled) == filled.referenced() | strays
    before = snapshot(filled.store_root)

    dry = filled.gc("--dry-run")
    assert dry.rc == 0, dry.err
    d = dry.json()
    assert d["dry_run"] is True and set(d["removed"]) == strays
    assert d["kept"] == len(filled.referenced()) and d["freed_bytes"] > 0
    assert snapshot(filled.store_root) == before  # nothing removed, not even tmp
    assert "would remove 3" in dry.err

    real = filled.gc()
    assert real.rc == 0, real.err
    r = real.json()
    assert set(r["removed"]) == strays and r["kept"] == len(filled.referenced()) and r["dry_run"] is False
    assert present(filled) == filled.referenced()
    assert list(filled.store.tmp.iterdir()) == []  # a killed writer's staging went too
    assert (filled.store_root / "git").is_dir()  # the mirror cache is not the store's to collect
    # what stays is still good: the tree verifies, the objects verify
    src = filled.lock.sources["demo-engine"]
    filled.store.verified_tree(src.tree_sha256, "sources.demo-engine")
    for p in src.patches:
        filled.store.verified(p.sha256, p.file)

    again = filled.gc()
    assert again.rc == 0 and again.json()["removed"] == []


def test_verify_removes_corrupt_entries(filled: Filled) -> None:
    sha = filled.lock.files["demo-chat-template"].sha256
    obj = filled.store.object_path(sha)
    obj.chmod(0o644)
    obj.write_bytes(b"{{ not the template }}\n")
    plain = filled.gc()
    assert plain.rc == 0 and plain.json()["removed"] == []  # without --verify bytes are not re-read
    r = filled.gc("--verify")
    assert r.rc == 0 and r.json()["removed"] == [f"objects/{sha}"]
    assert not obj.exists()


def test_keeps_what_other_locks_refer_to(filled: Filled, tmp_path: Path) -> None:
    old_lock = tmp_path / "old.lock"
    old_lock.write_bytes((filled.root / "pins.lock").read_bytes())
    old_patch = filled.lock.sources["demo-engine"].patches[0].sha256
    p = filled.root / PATCH_REL
    p.write_text(p.read_text().replace("Subject: [PATCH] ", "Subject: [PATCH]  ", 1))
    relock(filled.root)
    filled.refresh()
    new_patch = filled.lock.sources["demo-engine"].patches[0].sha256
    assert new_patch != old_patch
    kept = filled.gc("--dry-run", env={"BUILDER_KEEP_LOCKS": str(old_lock)}).json()
    assert f"objects/{old_patch}" not in kept["removed"]
    r = filled.gc().json()
    assert f"objects/{old_patch}" in r["removed"] and f"objects/{new_patch}" not in r["removed"]
    assert filled.store.has(new_patch) and not filled.store.has(old_patch)


def test_missing_lock_is_one_line(filled: Filled) -> None:
    (filled.root / "pins.lock").unlink()
    before = snapshot(filled.store_root)
    r = filled.gc()
    assert r.rc == 2 and len(r.err_lines) == 1 and "no lock file" in r.err
    assert snapshot(filled.store_root) == before


@pytest.mark.parametrize("case", ["pins that do not parse", "pins that do not validate",
                                  "a kept lock that does not parse"])
def test_inputs_it_cannot_read_change_nothing(filled: Filled, tmp_path: Path, case: str) -> None:
    """gc keeps what the pins and the locks name: one it cannot read is refused (exit 2, one line naming
    the file) before anything is removed, dry run or not; the image record and provenance stay."""
    filled.add_strays()
    _provenance(filled, filled.address)
    env = None
    if case == "pins that do not parse":
        bad = filled.root / "pins.toml"
        bad.write_text(bad.read_text() + "\n[images.demo\n")
    elif case == "pins that do not validate":
        bad = filled.root / "pins.toml"
        bad.write_text(bad.read_text() + "\n[nonsense]\nx = 1\n")
    else:
        bad = tmp_path / "old.lock"
        bad.write_text("{ not json")
        env = {"BUILDER_KEEP_LOCKS": str(bad)}
    before = snapshot(filled.store_root)
    for args in (("--dry-run",), ()):
        r = filled.gc(*args, env=env)
        assert r.rc == 2, (args, r.err)
        assert len(r.err_lines) == 1 and str(bad) in r.err and "Traceback" not in r.err, r.err
        assert r.out == "" and snapshot(filled.store_root) == before


def test_empty_store(tmp_path: Path) -> None:
    root = copy_project(tmp_path / "proj")
    r = builder(root, "gc", "--json", store=tmp_path / "none")
    assert r.rc == 0 and r.json()["removed"] == []
    assert not (tmp_path / "none").exists()


# --------------------------------------------------------------------------- beside an image record
# `builder gc` and what lies beside an image record: its provenance folder and its push lock go with the
# record (kept while a lock refers to the image, removed otherwise); a push lock held right now stays.


def _provenance(f: Filled, address: str) -> Path:
    d = f.store_root / "provenance" / address
    d.mkdir(parents=True, exist_ok=True)
    for name in ("sbom.cdx.json", "provenance.intoto.json"):
        (d / name).write_text("{}\n")
    return d


def _push_lock(f: Filled, address: str) -> Path:
    p = f.store_root / "locks" / f"push-{address}.lock"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.touch()
    return p


def test_provenance_and_push_locks_go_with_their_image(tmp_path: Path) -> None:
    f = Filled(tmp_path)
    live, stray, held = f.address, "d" * 64, "c" * 64
    keep = [_provenance(f, live), _push_lock(f, live)]
    gone = [_provenance(f, stray), _push_lock(f, stray)]
    busy = _push_lock(f, held)
    other = f.store_root / "locks" / "something-else.lock"  # not a push lock: not gc's
    other.touch()
    before = snapshot(f.store_root)

    dry = f.gc("--dry-run")
    assert dry.rc == 0, dry.err
    assert {f"provenance/{stray}", f"locks/push-{stray}.lock", f"locks/push-{held}.lock"} <= set(
        dry.json()["removed"])
    assert snapshot(f.store_root) == before

    fd = os.open(busy, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a push of that image under way
        r = f.gc()
    finally:
        os.close(fd)
    assert r.rc == 0, r.err
    removed = set(r.json()["removed"])
    assert {f"provenance/{stray}", f"locks/push-{stray}.lock"} <= removed
    assert not any(live in x for x in removed) and f"locks/push-{held}.lock" not in removed
    assert all(p.exists() for p in keep) and not any(p.exists() for p in gone)
    assert busy.exists() and other.exists()

    again = f.gc()
    assert again.rc == 0 and again.json()["removed"] == [f"locks/push-{held}.lock"]  # no longer held
    assert not busy.exists() and all(p.exists() for p in keep)


def test_a_push_lock_removed_while_a_pusher_waits_for_it_is_never_held_twice(tmp_path: Path) -> None:
    """gc removes a push lock nobody holds, holding it itself meanwhile (_unlink_unheld). A pusher that
    opened the file just before waits on it; once it has the lock it must not hold a removed file while
    a second pusher locks a new one of that name."""
    path = tmp_path / "locks" / "push-x.lock"
    path.parent.mkdir()
    path.touch()
    events: list[str] = []
    gc_fd = os.open(path, os.O_RDWR)
    fcntl.flock(gc_fd, fcntl.LOCK_EX)  # gc has it (nobody else did)

    def pusher(name: str, hold: float) -> None:
        with file_lock(path):
            events.append(f"{name} in")
            time.sleep(hold)
            events.append(f"{name} out")

    first = threading.Thread(target=pusher, args=("first", 1.0))
    first.start()
    time.sleep(0.5)  # the first pusher has opened the file and waits on gc's hold of it
    path.unlink()  # gc removes it, then lets go
    os.close(gc_fd)
    while "first in" not in events:
        time.sleep(0.01)
    second = threading.Thread(target=pusher, args=("second", 0.0))
    second.start()
    first.join(10)
    second.join(10)
    assert events == ["first in", "first out", "second in", "second out"]
    assert path.exists()
