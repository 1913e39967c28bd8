"""The apply record (state/applied.json), and whether it still vouches for a model file's bytes (by fast
mode's one rule, builder.core.fastmode's)."""

# ruff: noqa: UP031
from __future__ import annotations

import datetime
import hashlib
import json
import os
import stat
from typing import Any

from builder.core.atomic import atomic_write
from builder.core.fastmode import fast_mode_drift

from .files import hash_file
from .manifest import MANIFEST, MAX_MANIFEST, release_files
from .root import Root

RECORD_FORMAT = 1


def model_cached(m: dict[str, Any], old: dict[str, Any] | None) -> bool:
    """Does the apply record ``old`` still vouch for this model file's sha256 (fast_mode_drift)?"""
    if not isinstance(old, dict) or not isinstance(old.get("models"), list):
        return False  # no record, or a damaged one: hash the file instead of trusting it
    try:
        st = os.stat(m["path"])
    except OSError:
        return False
    return any(
        fast_mode_drift(r, m["sha256"], m["size"], st.st_size, st.st_mtime_ns, st.st_ino) is None
        for r in old["models"]
        if isinstance(r, dict) and r.get("path") == m["path"]
    )


def model_ok(m: dict[str, Any], old: dict[str, Any] | list[dict[str, Any] | None] | None) -> str | None:
    """None when the model file is in place with its sha256; else why not. ``old``: the record (or
    records: the apply record and the staged one) whose size, mtime and inode vouch for the file."""
    p = m["path"]
    try:
        st = os.lstat(p)
    except OSError:
        return "missing"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_size != m["size"]:
        return "%d bytes, expected %d" % (st.st_size, m["size"])
    if any(model_cached(m, o) for o in (old if isinstance(old, list) else [old])):
        return None
    digest, _ = hash_file(p)
    return None if digest == m["sha256"] else "sha256 differs"


def model_records(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for m in manifest["models"]:
        st = os.stat(m["path"])
        out.append(
            {
                "path": m["path"],
                "size": st.st_size,
                "sha256": m["sha256"],
                "mtime": st.st_mtime_ns,
                "inode": st.st_ino,
            }
        )
    return sorted(out, key=lambda r: r["path"])


def release_ok_file(path: str, fe: dict[str, Any]) -> bool:
    """A release file as its manifest entry says: a regular file of its size and sha256."""
    try:
        st = os.lstat(path)
        return stat.S_ISREG(st.st_mode) and st.st_size == fe["size"] and hash_file(path)[0] == fe["sha256"]
    except OSError:
        return False


def release_ok(path: str, manifest: dict[str, Any], mbytes: bytes) -> bool:
    """A staged release: its manifest bytes and every release file as the manifest says."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            if f.read(MAX_MANIFEST + 1) != mbytes:
                return False
    except OSError:
        return False
    return all(release_ok_file(os.path.join(path, fe["path"]), fe) for fe in release_files(manifest))


def write_record(
    r: Root, manifest: dict[str, Any], mbytes: bytes, action: str, previous: str | None, path: str | None = None
) -> dict[str, Any]:
    img = manifest["image"]
    rec = {
        "format": RECORD_FORMAT,
        "action": action,
        "bundle_id": manifest["bundle_id"],
        "host": manifest["host"],
        "fleet": manifest["fleet"],
        "lane": manifest["lane"],
        "rank": manifest["rank"],
        "role": manifest["role"],
        "world_size": manifest["world_size"],
        "lock_hash": manifest["lock_hash"],
        "image": {
            "name": img["name"],
            "input_address": img["input_address"],
            "image_id": img["image_id"],
            "diff_ids": list(img["diff_ids"]),
        },
        "manifest_sha256": hashlib.sha256(mbytes).hexdigest(),
        "applied_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),  # noqa: UP017 (python 3.8)
        "previous_bundle_id": previous,
        "release": r.release(manifest["bundle_id"]),
        "files": sorted(
            ({"path": f["path"], "size": f["size"], "sha256": f["sha256"]} for f in release_files(manifest)),
            key=lambda x: x["path"],
        ),
        "models": model_records(manifest),
    }
    atomic_write(path or r.record, (json.dumps(rec, sort_keys=True, indent=2) + "\n").encode("utf-8"))
    return rec
