"""Releases under ``releases/``: staging one from a bundle folder, ``staged``, ``switch``,
``rollback`` and ``status`` (see the package docstring: "Stage, then switch")."""

# ruff: noqa: UP031
from __future__ import annotations

import json
import os
from typing import Any

from builder.core.atomic import atomic_write, fsync_dir, replace_folder, tmp_name

from . import kept
from .engine import image_present
from .errors import EXIT_CONFIG, InstallError, say
from .files import read_limited
from .manifest import HEX64, MANIFEST, MAX_MANIFEST, MODES, SIGNATURE, bundle_id_of, check_manifest, release_files
from .record import model_ok, release_ok, write_record
from .root import Root
from .verify import copy_entry


def stage_release(
    r: Root, bundle_dir: str, manifest: dict[str, Any], mbytes: bytes, sbytes: bytes, link: bool = False
) -> None:
    """Make releases/<bundle id>/ from the bundle's release files. ``link``: they are whole files in
    ``incoming/`` that receive checked, linked into the release rather than copied."""
    bid = manifest["bundle_id"]
    final = r.release(bid)
    if os.path.isdir(final) and release_ok(final, manifest, mbytes):
        return
    os.makedirs(r.releases, exist_ok=True)
    tmp = tmp_name(final)
    os.mkdir(tmp, 0o755)
    for fe in release_files(manifest):
        dest = os.path.join(tmp, fe["path"])
        if link:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.link(os.path.join(bundle_dir, fe["path"]), dest)
            os.chmod(dest, MODES[fe["mode"]])
        else:
            copy_entry(bundle_dir, fe, dest, MODES[fe["mode"]])
    atomic_write(os.path.join(tmp, MANIFEST), mbytes, 0o644)
    if sbytes:
        atomic_write(os.path.join(tmp, SIGNATURE), sbytes, 0o644)
    for dirpath, _dirs, _files in os.walk(tmp):
        os.chmod(dirpath, 0o755)
        fsync_dir(dirpath)
    replace_folder(tmp, final)  # (one there is damaged or partial: not ours to trust)


def _release_manifest(r: Root, bid: str) -> tuple[dict[str, Any], bytes]:
    path = os.path.join(r.release(bid), MANIFEST)
    mbytes = read_limited(path, MAX_MANIFEST, path)
    try:
        manifest = check_manifest(json.loads(mbytes.decode("utf-8")))
    except (UnicodeDecodeError, ValueError) as e:
        raise InstallError("%s: malformed: %s" % (path, str(e)[:200])) from None
    if bundle_id_of(manifest) != bid or manifest["bundle_id"] != bid:
        raise InstallError("%s: does not describe release %s" % (path, bid[:16]))
    return manifest, mbytes


def rollback(root: str, *, lock_timeout: float = 60.0) -> dict[str, Any]:
    r = Root(root)
    with r.locked(lock_timeout):
        r.clean_temps()
        current, previous = r.link("current"), r.link("previous")
        if previous is None or previous == current:
            raise InstallError("%s: no previous release to roll back to" % r.root)
        manifest, mbytes = _release_manifest(r, previous)
        if not release_ok(r.release(previous), manifest, mbytes):
            raise InstallError("release %s is damaged (its files differ from its manifest)" % previous[:16])
        if image_present(manifest["image"]["image_id"]) is None:
            raise InstallError(
                "release %s needs image %s, which is no longer on this host"
                % (previous[:16], manifest["image"]["image_id"])
            )
        old = r.read_record()
        for m in manifest["models"]:
            why = model_ok(m, old)
            if why is not None:
                raise InstallError("release %s needs model file %s: %s" % (previous[:16], m["path"], why))
        if current is not None:
            r.set_link("previous", current)
        r.set_link("current", previous)
        write_record(r, manifest, mbytes, "rollback", current)
        say("rolled back to bundle %s (from %s)" % (previous[:16], (current or "none")[:16]))
        return {
            "result": "rolled-back",
            "bundle_id": previous,
            "previous_bundle_id": current,
            "release": r.release(previous),
        }


def mark_staged(r: Root, manifest: dict[str, Any], mbytes: bytes, previous: str | None) -> None:
    """staged -> this release, and state/staged.json: the record it will have once switched."""
    write_record(r, manifest, mbytes, "stage", previous, r.staged_record)
    r.set_link("staged", manifest["bundle_id"])


def _ready(r: Root, bid: str, what: str) -> tuple[dict[str, Any], bytes]:
    """An installed release that can run now: its files, its image and its model files as its
    manifest says (model files vouched for by the apply or staged record, else hashed)."""
    if not os.path.isdir(r.release(bid)):
        raise InstallError("%s: no release %s under %s" % (what, bid[:16], r.releases))
    manifest, mbytes = _release_manifest(r, bid)
    if not release_ok(r.release(bid), manifest, mbytes):
        raise InstallError("release %s is damaged (its files differ from its manifest)" % bid[:16])
    layers = image_present(manifest["image"]["image_id"])
    if layers is None:
        raise InstallError(
            "release %s needs image %s, which is not on this host" % (bid[:16], manifest["image"]["image_id"])
        )
    if layers and layers != manifest["image"]["diff_ids"]:
        raise InstallError(
            "image %s on this host has DiffIDs other than the manifest's" % manifest["image"]["image_id"]
        )
    record = r.read_record()
    vouch = [record, r.read_record(r.staged_record)]
    for m in manifest["models"]:
        # another release's file at its path (one path per model file, whatever the release): the kept
        # copy goes back, vouched for by its own entry (nothing hashed); else the file there is checked
        back = kept.restore(manifest, m, record) if kept.replaced(m, record) else None
        why = model_ok(m, {"models": [back]} if back is not None else vouch)
        if why is not None:
            raise InstallError("release %s needs model file %s: %s" % (bid[:16], m["path"], why))
    return manifest, mbytes


def stage_installed(root: str, bid: str, *, lock_timeout: float = 60.0) -> dict[str, Any]:
    """Stage a release that is already under releases/ (checked again: files, image, model files)."""
    if not HEX64.match(bid):
        raise InstallError("--release: not a bundle id: %r" % bid, EXIT_CONFIG)
    r = Root(root)
    with r.locked(lock_timeout):
        r.clean_temps()
        manifest, mbytes = _ready(r, bid, "stage")
        current = r.link("current")
        old = r.read_record()
        prev = old.get("previous_bundle_id") if current == bid and old else current
        mark_staged(r, manifest, mbytes, prev)
        say("staged release %s; current stays %s" % (bid[:16], (current or "none")[:16]))
        return {"result": "staged", "bundle_id": bid, "current": current, "release": r.release(bid)}


def switch(
    root: str, bid: str, *, rollback: bool = False, force: bool = False, lock_timeout: float = 60.0
) -> dict[str, Any]:
    """Make release bid current (previous := the old current) and write its apply record. ``force``
    (a repair): write the apply record again even when bid is current and recorded already."""
    if not HEX64.match(bid):
        raise InstallError("--to: not a bundle id: %r" % bid, EXIT_CONFIG)
    r = Root(root)
    with r.locked(lock_timeout):
        r.clean_temps()
        current = r.link("current")
        old = r.read_record()
        if current == bid and old and old.get("bundle_id") == bid and not force:
            r.clear_staged(bid)
            return {"result": "unchanged", "bundle_id": bid, "previous_bundle_id": old.get("previous_bundle_id")}
        manifest, mbytes = _ready(r, bid, "switch")
        if current is not None and current != bid:
            r.set_link("previous", current)
        previous = current if current != bid else r.link("previous")
        r.set_link("current", bid)
        write_record(r, manifest, mbytes, "rollback" if rollback else "install", previous)
        r.clear_staged(bid)
        _prune_kept(r, manifest, previous)
        say("switched to release %s (from %s)" % (bid[:16], (current or "none")[:16]))
        return {"result": "switched", "bundle_id": bid, "previous_bundle_id": previous, "release": r.release(bid)}


def _prune_kept(r: Root, manifest: dict[str, Any], previous: str | None) -> None:
    """Keep the replaced model files only the current and previous releases name (builder.installer.kept)."""
    manifests = [manifest]
    if previous is not None and os.path.isdir(r.release(previous)):
        try:
            manifests.append(_release_manifest(r, previous)[0])
        except InstallError:
            pass  # (a previous release that cannot be read cannot be switched back to either)
    kept.prune(manifests)


#: the serving records a host keeps (the newest); older ones are removed when one is written
SERVING_KEEP = 16


def keep_serving(root: str, bid: str, record: bytes, *, lock_timeout: float = 60.0) -> dict[str, Any]:
    """Write what release `bid` answered (its gates, replay and speed, as the operator recorded them after
    its serving audit) to ``state/serving/<bid>.json``, atomically; the host keeps the newest few."""
    if not HEX64.match(bid):
        raise InstallError("--release: not a bundle id: %r" % bid[:80], EXIT_CONFIG)
    try:
        rec = json.loads(record)
    except ValueError:
        raise InstallError("--record: not JSON", EXIT_CONFIG) from None
    if not isinstance(rec, dict) or rec.get("bundle") != bid:
        raise InstallError("--record: not the serving record of release %s" % bid[:16], EXIT_CONFIG)
    r = Root(root)
    if not os.path.isdir(r.release(bid)):
        raise InstallError("no release %s under %s" % (bid[:16], r.releases), EXIT_CONFIG)
    folder = os.path.join(r.state, "serving")
    with r.locked(lock_timeout):
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, bid + ".json")
        atomic_write(path, json.dumps(rec, sort_keys=True).encode() + b"\n", 0o644)
        kept = sorted((e for e in os.scandir(folder) if e.name.endswith(".json")),
                      key=lambda e: e.stat().st_mtime_ns, reverse=True)
        for e in kept[SERVING_KEEP:]:
            os.unlink(e.path)
        fsync_dir(folder)
    return {"result": "kept", "bundle_id": bid, "path": path}


def status(root: str) -> dict[str, Any]:
    r = Root(root)
    rec = r.read_record()
    return {
        "root": r.root,
        "current": r.link("current"),
        "previous": r.link("previous"),
        "staged": r.link("staged"),
        "releases": r.releases_present(),
        "trusted_key": os.path.exists(r.trusted),
        "applied": rec,
        "consistent": rec is not None and rec.get("bundle_id") == r.link("current"),
    }


def switch_in(r: Root, manifest: dict[str, Any], mbytes: bytes, stage: bool, current: str | None,
               new_key: bytes | None) -> dict[str, Any]:
    """The end of an install once the release is staged: the first key, then staged or current."""
    bid = manifest["bundle_id"]
    if new_key is not None:
        atomic_write(r.trusted, new_key, 0o644)
        say("trusted key set: %s" % r.trusted)
    if stage:
        mark_staged(r, manifest, mbytes, current)
        say(
            "staged bundle %s (host %s, lane %s, rank %d); current stays %s"
            % (bid[:16], manifest["host"], manifest["lane"], manifest["rank"], (current or "none")[:16])
        )
        return {"result": "staged", "bundle_id": bid, "current": current, "release": r.release(bid)}
    previous = r.link("previous")
    if current is not None and current != bid:
        r.set_link("previous", current)
        previous = current
    r.set_link("current", bid)
    write_record(r, manifest, mbytes, "install", previous if previous != bid else None)
    r.clear_staged(bid)
    _prune_kept(r, manifest, previous if previous != bid else None)
    say(
        "installed bundle %s (host %s, lane %s, rank %d); previous: %s"
        % (bid[:16], manifest["host"], manifest["lane"], manifest["rank"], (previous or "none")[:16])
    )
    return {"result": "installed", "bundle_id": bid, "previous_bundle_id": previous, "release": r.release(bid)}
