"""`builder gc` and what lies beside an image record: its provenance folder and its push lock go with the
record (kept while a lock refers to the image, removed otherwise); a push lock held right now stays."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from tests.test_gc import Filled, snapshot


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
