"""``install``: a bundle folder verified, then its image, model files and release put in place and
switched in (or staged); and the checks an install and a receive share before anything changes."""

# ruff: noqa: UP031
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
from typing import TYPE_CHECKING, Any

from builder.core.atomic import clean_stale_tmp, fsync_dir, fsync_file, tmp_name
from builder.core.digest import in_parallel

from . import kept
from .blobs import check_room, from_registry, pull_models
from .engine import check_thin, docker_root, image_present, load_image, pull_image
from .errors import EXIT_CONFIG, InstallError, say
from .files import Writeback, hash_file, read_limited, write_all
from .manifest import REGISTRY_CA, release_files, under
from .record import model_ok, release_ok
from .release import mark_staged, stage_release, switch_in
from .root import DEFAULT_RESERVE, Root
from .verify import check_all_hashes, iter_file, parse_key, verify_bundle

if TYPE_CHECKING:
    from .verify import SigCheck


def _discard(written: list[tuple[str, str]]) -> None:
    """Remove the temp files of model files written but not renamed into place."""
    for tmp, _ in written:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@dataclasses.dataclass(frozen=True)
class Admission:
    """What an install and a receive check and keep to before anything changes: the key to trust
    (`trusted_key`, or the host's kept one; `insecure`: none), the host the bundle must be for, the
    free disk to keep, how long to wait for the root's lock; whether to stage instead of switch; and whether
    every placed file is hashed (`rehash`) rather than vouched for by a record."""

    trusted_key: bytes | None = None
    insecure: bool = False
    host: str | None = None
    reserve: int = DEFAULT_RESERVE
    lock_timeout: float = 60.0
    stage: bool = False
    #: hash every placed file instead of trusting the apply record's size, mtime and inode (a repair:
    #: a file changed in place with its size and mtime put back is found and placed again)
    rehash: bool = False


def install(
    bundle_dir: str,
    root: str,
    admit: Admission = Admission(),  # noqa: B008  (frozen, so one shared default is safe)
    *,
    remove_source: bool = False,
    sig_check: SigCheck | None = None,
) -> dict[str, Any]:
    """Install a bundle folder under root; return {"result": "installed"|"unchanged"|"staged", ...}.

    ``admit.stage``: everything up to the switch, then ``staged`` and state/staged.json instead of
    ``current`` and the apply record (the package docstring: "Stage, then switch")."""
    r = Root(root)
    bundle_dir = os.path.abspath(bundle_dir)
    with r.locked(admit.lock_timeout):
        r.clean_temps()
        key, new_key = host_key(r, admit.trusted_key, admit.insecure)  # 1. the key
        # 2. signature, structure and sizes, before anything changes; each byte is hashed once below,
        # in the pass that uses it (a model file as it is written to a temp name beside its place,
        # the image archive as it streams into docker load, the rest on its own), and nothing is
        # placed or switched until every one checked out
        manifest, mbytes, sbytes = verify_bundle(
            bundle_dir, key, insecure=admit.insecure, sig_check=sig_check, hashes=False
        )
        bid = manifest["bundle_id"]
        old = host_record(r, manifest, admit.host)
        current = r.link("current")
        img = manifest["image"]
        have_layers = image_present(img["image_id"])
        vouch = vouching(r, old, admit)
        if _installed_whole(r, manifest, mbytes, old, current, have_layers, vouch):
            check_all_hashes(bundle_dir, manifest["files"])
            say("bundle %s is already installed; nothing to do" % bid[:16])
            if admit.stage:
                mark_staged(r, manifest, mbytes, old.get("previous_bundle_id") if old else None)
            if remove_source:
                _remove_source(r, bundle_dir)
            return {"result": "unchanged", "bundle_id": bid, "release": r.release(bid)}
        # 3. what is needed, and room for it
        check_image_source(img, have_layers)
        if have_layers is None and img["archive"] is not None and img.get("omitted_layers"):
            check_thin(img)
        _check_room(r, manifest, len(mbytes) + len(sbytes), have_layers, vouch, admit.reserve)
        # 4. image, models, release, switch, record
        placing = [m for m in manifest["models"] if model_ok(m, vouch) is not None]
        _place_image_and_models(bundle_dir, manifest, placing, have_layers, link=remove_source,
                                record=r.read_record())
        stage_release(r, bundle_dir, manifest, mbytes, sbytes)
        res = switch_in(r, manifest, mbytes, admit.stage, current, admit.trusted_key if new_key else None)
        if remove_source:
            _remove_source(r, bundle_dir)
        return res


def _installed_whole(r: Root, manifest: dict[str, Any], mbytes: bytes, old: dict[str, Any] | None,
                     current: str | None, have_layers: Any, vouch: list[dict[str, Any] | None]) -> bool:
    """The bundle is current, the apply record names it, and the host holds its image, its release and
    every model file."""
    bid = manifest["bundle_id"]
    return bool(
        current == bid
        and old
        and old.get("bundle_id") == bid
        and have_layers is not None
        and release_ok(r.release(bid), manifest, mbytes)
        and all(model_ok(m, vouch) is None for m in manifest["models"])
    )


def _check_room(r: Root, manifest: dict[str, Any], signed_size: int, have_layers: Any,
                vouch: list[dict[str, Any] | None], reserve: int) -> None:
    """Every model file to place is carried by the bundle, and there is room for those, for the image
    archive's load (twice its size, in the engine's root) and for the release (``signed_size``: its
    manifest's and signature's bytes)."""
    img = manifest["image"]
    bundled = {f["path"]: f for f in manifest["files"]}
    needs: list[tuple[str, int]] = []
    pulling: list[dict[str, Any]] = []
    for m in manifest["models"]:
        why = model_ok(m, vouch)
        if why is None:
            continue
        if from_registry(m):
            pulling.append(m)
            continue
        if m["bundled"] is None and not from_registry(m):
            raise InstallError(
                "model file %s: %s (the bundle does not carry it; copy it there or bundle "
                "with --with-models)" % (m["path"], why)
            )
        needs.append((m["path"], m["size"]))
    if have_layers is None and img["archive"] is not None:
        archive = bundled[img["archive"]]
        needs.append((docker_root() or r.root, 2 * archive["size"]))
    needs.append((r.releases, sum(f["size"] for f in release_files(manifest)) + signed_size))
    check_room(needs, pulling, reserve, manifest["host"])


def _place_image_and_models(bundle_dir: str, manifest: dict[str, Any], placing: list[dict[str, Any]],
                            have_layers: Any, *, link: bool, record: dict[str, Any] | None) -> None:
    """Hash the bundle's files that are not streamed, write the model files to place beside their
    places (those the bundle carries; those from the fleet registry pulled), load (or pull) the image,
    then move the model files into place (each file they replace kept for the running release: ``record``,
    its apply record; builder.installer.kept); a pull, load or image pull that fails leaves no model file
    placed."""
    img = manifest["image"]
    bundled = {f["path"]: f for f in manifest["files"]}
    loading = have_layers is None and img["archive"] is not None
    carried = [m for m in placing if not from_registry(m)]
    streamed = {bundled[m["bundled"]]["path"] for m in carried} | ({img["archive"]} if loading else set())
    check_all_hashes(bundle_dir, [f for f in manifest["files"] if f["path"] not in streamed])
    written = _write_models(bundle_dir, bundled, carried, link=link)
    try:
        written += pull_models([m for m in placing if from_registry(m)], registry_ca(bundle_dir, manifest),
                               manifest["host"]).files
    except BaseException:
        _discard(written)
        raise
    try:
        if loading:
            load_image(bundle_dir, manifest)
        elif have_layers is None:
            pull_image(manifest)
    except BaseException:
        _discard(written)
        raise
    for tmp, dest in written:
        kept.place(manifest, tmp, dest, record)
    for d in sorted({os.path.dirname(dest) for _, dest in written}):
        fsync_dir(d)


def registry_ca(folder: str, manifest: dict[str, Any]) -> str | None:
    """The CA file of the fleet registry's TLS, as ``folder`` holds it (None: the system's CAs)."""
    if any(from_registry(m) and m["registry"]["ca"] for m in manifest["models"]):
        return os.path.join(folder, REGISTRY_CA)
    return None


def _link_whole(src: str, tmp: str) -> bool:
    """Hard-link src to tmp when that is the same as moving it: src is a whole regular file that
    nothing else links (so once the bundle folder is removed, the placed file is the only name of
    its bytes, as after a rename) and that this user owns (as a copy would be). False where it is
    not, or where links are refused (another file system, or one without links): then it is copied."""
    try:
        st = os.lstat(src)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
        return False
    try:
        os.link(src, tmp)
    except OSError:
        return False
    got = os.lstat(tmp)
    if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):  # src was replaced in between: copy it
        os.unlink(tmp)
        return False
    return True


def _write_models(
    bundle_dir: str, bundled: dict[str, dict[str, Any]], placing: list[dict[str, Any]], link: bool = False
) -> list[tuple[str, str]]:
    """Each model file to place, reassembled and hash-checked as it is written to a temp name beside
    its final path, several files at once (hashlib and the writes release the GIL): [(temp, final)].
    A mismatch removes every temp and names the file.

    ``link`` (the bundle folder is the installer's, under incoming/, and is removed once installed):
    a whole model file on the same file system is hard-linked to its temp name and hashed there, not
    written again (see _link_whole); anything else is copied."""
    written: list[tuple[str, str]] = []
    for m in placing:
        clean_stale_tmp(m["path"])  # left by a killed run (outside ROOT: clean_temps misses it)
        written.append((tmp_name(m["path"], "place-"), m["path"]))

    def one(i: int) -> None:
        m, (tmp, _) = placing[i], written[i]
        say("placing model file %s" % m["path"])
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        entry = bundled[m["bundled"]]
        if link and not entry.get("parts") and _link_whole(os.path.join(bundle_dir, entry["path"]), tmp):
            # the one read, of the name it is placed from: its sha256 against the manifest
            digest, size = hash_file(tmp)
            if (digest, size) != (entry["sha256"], entry["size"]):
                raise InstallError("%s: sha256 mismatch (changed file)" % entry["path"])
            os.chmod(tmp, 0o644)
            return
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # the file's writeback started once it is all written (while the next one is copied),
            # not every WRITEBACK_STEP as receive does: here the bytes come from the page cache as
            # fast as the cores hash them, and DONTNEED on freshly dirtied steps made the writes
            # themselves cost 2 to 5 times the system time (a copying install 2x slower); the kernel's
            # own writeback (past dirty_background_ratio) keeps the disk busy in between
            wb = Writeback(fd, end_only=True)
            for chunk in iter_file(bundle_dir, entry):
                write_all(fd, chunk, wb)
            wb.start_rest()
        finally:
            os.close(fd)
        os.chmod(tmp, 0o644)

    try:
        in_parallel(one, list(range(len(placing))), size=lambda i: int(placing[i]["size"]))
        # every file's bytes on disk before any is renamed into place, fsynced one after another
        # once all are written: each fsync waits for a journal commit (on ext4 one that also carries
        # other writers' data), so fsyncs racing each other from the workers cost a commit apiece,
        # while these find most of their writeback done and most of the metadata committed already
        for tmp, _ in written:
            fsync_file(tmp)
    except BaseException:
        _discard(written)
        raise
    return written


def _remove_source(r: Root, bundle_dir: str) -> None:
    real = os.path.realpath(bundle_dir)
    if not under(real, os.path.realpath(r.incoming)):
        raise InstallError("--remove-source: %s is not under %s" % (bundle_dir, r.incoming), EXIT_CONFIG)
    gone = tmp_name(real, "gone-")
    with contextlib.suppress(OSError):
        os.rename(real, gone)
        shutil.rmtree(gone, ignore_errors=True)


def vouching(r: Root, old: dict[str, Any] | None, admit: Admission) -> list[dict[str, Any] | None]:
    """The records whose size, mtime and inode may vouch for a placed file's bytes: the apply record and
    the staged one; none with ``admit.rehash`` (every file is hashed)."""
    return [] if admit.rehash else [old, r.read_record(r.staged_record)]


def host_record(r: Root, manifest: dict[str, Any], host: str | None) -> dict[str, Any] | None:
    """This host's apply record, once the bundle is known to be for this host (InstallError if not)."""
    if host is not None and manifest["host"] != host:
        raise InstallError("bundle is for host %r, not %r" % (manifest["host"], host), EXIT_CONFIG)
    old = r.read_record()
    if old and old.get("host") not in (None, manifest["host"]):
        raise InstallError(
            "%s: this host was installed as %r; the bundle is for %r" % (r.record, old.get("host"), manifest["host"]),
            EXIT_CONFIG,
        )
    return old


def check_image_source(img: dict[str, Any], have_layers: list[str] | None) -> None:
    """The image is on this host with the manifest's layers, or the bundle says how to get it."""
    if have_layers is None and img["archive"] is None and img.get("pull") is None:
        raise InstallError(
            "image %s is not on this host and the bundle carries no image (bundle it with --with-image)"
            % img["image_id"]
        )
    if have_layers and have_layers != img["diff_ids"]:
        raise InstallError("image %s on this host has DiffIDs other than the manifest's" % img["image_id"])


def host_key(r: Root, trusted_key: bytes | None, insecure: bool) -> tuple[bytes | None, bool]:
    """(the key to check the signature with, whether it is the first install's new key)."""
    if insecure:
        say("WARNING: --insecure: the signature is NOT checked")
        return None, False
    if os.path.exists(r.trusted):
        key = read_limited(r.trusted, 64 * 1024, r.trusted)
        have = parse_key(key, r.trusted)
        if trusted_key is not None:
            given = parse_key(trusted_key, "--trusted-key")
            if (given.key_id, given.key) != (have.key_id, have.key):
                raise InstallError(
                    "the given key %s differs from %s (key %s); to rotate keys, remove that "
                    "file first" % (given.key_id_hex, r.trusted, have.key_id_hex),
                    EXIT_CONFIG,
                )
        return key, False
    if trusted_key is not None:
        parse_key(trusted_key, "--trusted-key")
        return trusted_key, True
    raise InstallError(
        "%s: no trusted key; give the fleet's public key with --trusted-key FILE at the "
        "first install (or --insecure to skip the signature)" % r.trusted,
        EXIT_CONFIG,
    )
