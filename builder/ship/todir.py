"""Sneakernet: copy a verified bundle to a folder (``builder ship --to DIR``), resumably, and verify
the copy; install it on the host with a trusted installer (install.pyz, see builder/installer/__init__.py)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from builder.bundle import verify_with_key
from builder.core.atomic import clean_stale_tmp, tmp_name
from builder.errors import VerifyError
from builder.foundation.hashing import READ_SIZE
from builder.installer.errors import InstallError
from builder.installer.files import hash_file, scan_tree
from builder.installer.manifest import MANIFEST, MODES, SIGNATURE, physical_files
from builder.installer.verify import verify_bundle
from builder.ship.job import ShipResult


def _file_order(manifest: dict[str, Any]) -> list[tuple[str, int, str]]:
    """Every physical file, manifest and signature last (a folder with them is complete)."""
    phys = physical_files(manifest)
    return [(p, s, h) for p, (s, h) in sorted(phys.items())]


def _meta_files(bdir: Path) -> list[tuple[str, int, str]]:
    """(path, size, sha256) of the manifest and (when there is one) the signature in bdir."""
    out = []
    for name in (MANIFEST, SIGNATURE):
        if (bdir / name).exists():
            digest, size = hash_file(str(bdir / name))
            out.append((name, size, digest))
    return out



def _copy_checked(src: Path, tmp: Path, dest: Path, size: int, digest: str, mode: int) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    n = 0
    with open(src, "rb") as fi, open(tmp, "wb") as fo:
        while chunk := fi.read(READ_SIZE):
            h.update(chunk)
            n += len(chunk)
            fo.write(chunk)
        fo.flush()
        os.fsync(fo.fileno())
    if n != size or (digest and h.hexdigest() != digest):
        tmp.unlink()
        raise VerifyError(f"{src}: changed while it was copied")
    os.chmod(tmp, mode)
    os.replace(tmp, dest)


def ship_to_dir(bdir: Path, manifest: dict[str, Any], dest: Path, key: bytes | None) -> ShipResult:
    """Copy a verified bundle to dest, skipping files already there with the right hash; verify the copy."""
    res = ShipResult(
        host=manifest["host"],
        fleet=manifest["fleet"],
        bundle_id=manifest["bundle_id"],
        result="copied",
        dest=str(dest),
    )
    dest.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(dest)  # what a killed copy left
    tmp_root = Path(tmp_name(dest))
    files = _file_order(manifest)
    expected = {p for p, _, _ in files} | {MANIFEST, SIGNATURE}
    present, refused = scan_tree(str(dest))
    for r in refused:  # links and odd files: remove what we can name
        with contextlib.suppress(OSError):
            (dest / r.rsplit(" (", 1)[0]).unlink()
    for rel in sorted(set(present) - expected):
        (dest / rel).unlink()
        res.removed.append(rel)
    sends = files + _meta_files(bdir)
    if not (bdir / SIGNATURE).exists():  # an unsigned bundle: no stale signature in the copy
        (dest / SIGNATURE).unlink(missing_ok=True)
    modes = {f["path"]: MODES[f["mode"]] for f in manifest["files"] if not f.get("parts")}
    for rel, size, digest in sends:
        target = dest / rel
        mode = modes.get(rel, 0o644)
        if (
            target.is_file()
            and not target.is_symlink()
            and target.stat().st_size == size
            and hash_file(str(target))[0] == digest
        ):
            os.chmod(target, mode)
            res.skipped.append(rel)
            continue
        _copy_checked(bdir / rel, tmp_root / rel, target, size, digest, mode)
        res.sent.append(rel)
        res.bytes_sent += size
    shutil.rmtree(tmp_root, ignore_errors=True)
    if key is not None:
        verify_with_key(dest, key)
    else:
        try:
            verify_bundle(str(dest), None, insecure=True)
        except InstallError as e:
            raise VerifyError(str(e)) from None
    return res
