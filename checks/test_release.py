"""Release: the apply record matches this host, fleet, lane, rank, lock and image; launch files unchanged."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from checklib import (
    Cmd,
    Concern,
    cat,
    expected_image,
    or_skip,
    read_applied,
    release_files,
    release_files_command,
    require,
    run,
)

from builder.hostscripts import shown
from builder.installer.manifest import release_files as manifest_files

LAUNCH_FILES = ("start.sh", "stop.sh", "rank.env")


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """The apply record, the release's manifest and the hashes of the files the record names."""
    return [cat(expect["applied_path"]), cat(f"{expect['current_path']}/manifest.json"), release_files_command(expect)]


CONCERN = Concern(name="release", order=20, phase="preflight", containers=False, prefetch=planned)


@pytest.fixture(scope="module")
def record(host: Any, expect: dict[str, Any]) -> dict[str, Any]:
    rec, why = read_applied(host, expect)
    if rec is None:
        if expect.get("lock_hash") is None:
            pytest.skip(f"{why}; and no lock to expect a release from ({expect.get('lock_reason')})")
        pytest.fail(f"apply record: expected {expect['applied_path']}, found none ({why})")
    return rec


def test_record_identity(record: dict[str, Any], expect: dict[str, Any]) -> None:
    h = expect["host"]
    want = {"host": h["name"], "fleet": expect["fleet"], "lane": expect["lane"], "rank": h["rank"]}
    for k, v in want.items():
        assert record.get(k) == v, f"apply record {k}: expected {v!r}, found {record.get(k)!r}"


def test_record_lock(record: dict[str, Any], expect: dict[str, Any]) -> None:
    want = or_skip(expect.get("lock_hash"), expect.get("lock_reason") or "no lock")
    assert record.get("lock_hash") == want, (
        f"apply record lock_hash: expected {want[:16]}, found {str(record.get('lock_hash'))[:16]}"
    )


def test_record_image(record: dict[str, Any], expect: dict[str, Any]) -> None:
    img = expected_image(expect)
    got = record.get("image") or {}
    for k in ("input_address", "image_id", "diff_ids"):
        assert got.get(k) == img[k], (
            f"apply record image.{k}: expected {str(img[k])[:80]}, found {str(got.get(k))[:80]}"
        )


def test_manifest_hash(host: Any, record: dict[str, Any], expect: dict[str, Any]) -> None:
    want = require(
        record.get("manifest_sha256"), "apply record: expected manifest_sha256 (the manifest's hash), found none"
    )
    path = f"{expect['current_path']}/manifest.json"
    r = run(host, *cat(path))
    assert r.rc == 0, f"{path}: expected present, found absent"
    got = hashlib.sha256(r.stdout_bytes).hexdigest()
    assert got == want, f"{path} sha256: expected {want[:16]}, found {got[:16]}"
    manifest = json.loads(r.stdout_bytes)
    if isinstance(manifest, dict) and "bundle_id" in manifest:
        assert manifest["bundle_id"] == record.get("bundle_id"), (
            f"manifest bundle_id: expected {record.get('bundle_id')}, found {manifest['bundle_id']}"
        )


def test_launch_files_unchanged(host: Any, record: dict[str, Any], expect: dict[str, Any]) -> None:
    """The release's files against the signed manifest's own entries (test_manifest_hash checks that
    manifest against the apply record), and the record's list against the manifest's: an edit of a
    launch file and of its entry in the record together is still found."""
    rec_files = require(
        record.get("files"), f"apply record: expected files (the release files, {', '.join(LAUNCH_FILES)}), found none"
    )
    cur = expect["current_path"]
    mpath = f"{cur}/manifest.json"
    r = run(host, *cat(mpath))
    assert r.rc == 0, f"{mpath}: expected present, found absent"
    try:
        files = [{"path": str(f["path"]), "size": f["size"], "sha256": f["sha256"]}
                 for f in manifest_files(json.loads(r.stdout_bytes))]
    except (ValueError, KeyError, TypeError):
        pytest.fail(f"{mpath}: expected a bundle manifest, found one that cannot be read", pytrace=False)
    require(files, f"{mpath}: expected files (the release files, {', '.join(LAUNCH_FILES)}), found none")
    paths = [f"{cur}/{f['path']}" for f in files]
    got = release_files(host, expect, paths)
    bad = []
    for f, p in zip(files, paths, strict=True):
        g = got.get(p, {})
        if "error" in g:
            bad.append(f"{f['path']}: expected present, found {g['error']}")
        elif g.get("size") != f["size"] or g.get("sha256") != f["sha256"]:
            bad.append(
                f"{f['path']}: expected sha256 {str(f['sha256'])[:12]} size {f['size']}, "
                f"found {str(g.get('sha256'))[:12]} size {g.get('size')}"
            )
    assert not bad, f"{len(bad)} launch file(s) changed: {shown(bad, 2)}"
    listed = {f["path"] for f in files}
    missing = [n for n in LAUNCH_FILES if n not in listed]
    assert not missing, f"{mpath} files: expected {', '.join(LAUNCH_FILES)}, found no {shown(missing)}"
    have = {str(f.get("path")): (f.get("size"), f.get("sha256"))
            for f in (rec_files if isinstance(rec_files, list) else []) if isinstance(f, dict)}
    want = {f["path"]: (f["size"], f["sha256"]) for f in files}
    differ = sorted(p for p in want.keys() | have.keys() if want.get(p) != have.get(p))
    assert not differ, f"apply record files: expected the manifest's entries, found {shown(differ)} differing"
