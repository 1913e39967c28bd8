"""Model files a new release replaced, kept so that the release before it can be switched back to.

A model file has one path on a host whatever the release (placement), so a release whose file differs
replaces the running release's when it is staged. Before the new bytes take the path, the old file gets
a second name, ``<base>/.builder-kept/<sha256>`` (``base``: the manifest's ``paths.models`` or
``paths.engram`` the file is under, so the same file system: a hard link, no byte copied), and its apply
record entry beside it (``<sha256>.json``: size, mtime, inode), so that putting it back needs no hashing.
A switch to a release whose file is not in place puts the kept one back the same way, atomically (the file
it replaces is kept in turn). What neither the current nor the previous release names is let go.

The cost on disk: the bytes of the files that changed, until the release after next.
"""

# ruff: noqa: UP031
from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from builder.core.atomic import atomic_write, fsync_dir, tmp_name
from builder.core.fastmode import fast_mode_drift

from .manifest import under

KEPT = ".builder-kept"


def kept_dir(manifest: dict[str, Any], path: str) -> str | None:
    """The kept folder for a model file at ``path`` (None: under neither base, which check_manifest refuses)."""
    for key in ("models", "engram"):
        base = manifest["paths"][key]
        if under(path, base):
            return os.path.join(base, KEPT)
    return None


def _entry(record: dict[str, Any] | None, path: str) -> dict[str, Any] | None:
    """The record's entry for the model file at ``path`` when it still vouches for the file there."""
    if not isinstance(record, dict) or not isinstance(record.get("models"), list):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    for e in record["models"]:
        if not (isinstance(e, dict) and e.get("path") == path and isinstance(e.get("sha256"), str)
                and isinstance(e.get("size"), int)):
            continue
        if fast_mode_drift(e, e["sha256"], e["size"], st.st_size, st.st_mtime_ns, st.st_ino) is None:
            return e
    return None


def replaced(m: dict[str, Any], record: dict[str, Any] | None) -> bool:
    """Whether the apply record says the file at model file ``m``'s path holds other bytes than ``m``'s."""
    if not isinstance(record, dict) or not isinstance(record.get("models"), list):
        return False
    return any(isinstance(e, dict) and e.get("path") == m["path"] and e.get("sha256") != m["sha256"]
               for e in record["models"])


def keep(manifest: dict[str, Any], path: str, record: dict[str, Any] | None) -> None:
    """Before ``path`` is replaced: give the file there a second name in the kept folder, when the apply
    record ``record`` vouches for its sha256 (a file no record vouches for is not kept: nothing could
    say what it holds)."""
    e = _entry(record, path)
    folder = kept_dir(manifest, path)
    if e is None or folder is None:
        return
    os.makedirs(folder, exist_ok=True)
    dest = os.path.join(folder, e["sha256"])
    tmp = tmp_name(dest, "kept")
    os.link(path, tmp)
    os.replace(tmp, dest)
    atomic_write(dest + ".json", json.dumps(e, sort_keys=True).encode("utf-8"), 0o644)
    fsync_dir(folder)


def place(manifest: dict[str, Any], tmp: str, path: str, record: dict[str, Any] | None) -> None:
    """Move a model file's new bytes (``tmp``) to ``path``, the file there kept first."""
    with contextlib.suppress(OSError):
        if os.path.samefile(tmp, path):  # (rename(2) between two names of one file does nothing)
            os.unlink(tmp)
            return
    keep(manifest, path, record)
    os.replace(tmp, path)


def restore(manifest: dict[str, Any], m: dict[str, Any], record: dict[str, Any] | None) -> dict[str, Any] | None:
    """Put the kept file of model file ``m`` back at its path (the file there kept first); the entry that
    vouches for it then, or None when none is kept (or what is kept is not that file any more)."""
    folder = kept_dir(manifest, m["path"])
    if folder is None:
        return None
    src = os.path.join(folder, m["sha256"])
    try:
        with open(src + ".json", "rb") as f:
            e = json.load(f)
        st = os.stat(src)
    except (OSError, ValueError):
        return None
    if not isinstance(e, dict) or fast_mode_drift(e, m["sha256"], m["size"], st.st_size, st.st_mtime_ns,
                                                  st.st_ino) is not None:
        return None
    with contextlib.suppress(OSError):
        if os.path.samefile(src, m["path"]):  # put back already (a stage, then its switch)
            return {**e, "path": m["path"]}
    os.makedirs(os.path.dirname(m["path"]), exist_ok=True)
    tmp = tmp_name(m["path"], "restore")
    os.link(src, tmp)
    place(manifest, tmp, m["path"], record)
    fsync_dir(os.path.dirname(m["path"]))
    return {**e, "path": m["path"]}


def prune(manifests: list[dict[str, Any]]) -> None:
    """Let go of every kept file that none of ``manifests`` (the current and previous releases') names."""
    wanted: dict[str, set[str]] = {}
    for man in manifests:
        for m in man["models"]:
            folder = kept_dir(man, m["path"])
            if folder is not None:
                wanted.setdefault(folder, set()).add(m["sha256"])
    folders = {os.path.join(man["paths"][k], KEPT) for man in manifests for k in ("models", "engram")}
    for folder in sorted(folders):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if name.split(".", 1)[0] not in wanted.get(folder, set()):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
