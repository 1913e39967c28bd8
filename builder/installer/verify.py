"""Verifying a bundle: the signature (the minisign verifier, through openssl), the manifest, then
every file's presence, size and sha256; nothing is written."""

# ruff: noqa: UP031
from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from builder.core import minisign as mv
from builder.core.atomic import atomic_write, clean_stale_tmp
from builder.core.digest import READ_SIZE, in_parallel

from .errors import EXIT_CONFIG, InstallError
from .files import hash_file, read_limited, scan_tree
from .manifest import (
    MANIFEST,
    MAX_MANIFEST,
    SIGNATURE,
    bundle_id_of,
    check_manifest,
    physical_files,
    trusted_comment_for,
)

if TYPE_CHECKING:
    SigCheck = Callable[[bytes, bytes, bytes], str]

def _names(items: list[str], n: int = 5) -> str:
    s = ", ".join(items[:n])
    return s + (" (and %d more)" % (len(items) - n) if len(items) > n else "")


def openssl_sig_check(manifest_bytes: bytes, sig_bytes: bytes, key_bytes: bytes) -> str:
    try:
        return str(mv.verify_with_openssl(manifest_bytes, sig_bytes, key_bytes))
    except mv.MinisignError as e:
        raise InstallError("%s: %s" % (SIGNATURE, e)) from None


#: untrusted comments a bundle signature may carry (the line is not signed, so it is pinned instead)
SIGNATURE_COMMENTS = ("signature from builder secret key", "signature from minisign secret key")


def check_signature_form(sbytes: bytes) -> None:
    """The signature file must be exactly the canonical four lines (minisign does not sign line 1, and
    base64 padding bits are ignored by decoders): any changed byte is refused, not just signed ones."""
    try:
        sig = mv.parse_signature(sbytes)
    except mv.MinisignError as e:
        raise InstallError("%s: %s" % (SIGNATURE, e)) from None
    if sig.untrusted_comment not in SIGNATURE_COMMENTS:
        raise InstallError("%s: unexpected untrusted comment %r" % (SIGNATURE, sig.untrusted_comment[:80]))
    canon = b"".join(
        [
            b"untrusted comment: " + sig.untrusted_comment.encode("utf-8") + b"\n",
            base64.b64encode(sig.algorithm + sig.key_id + sig.signature) + b"\n",
            b"trusted comment: " + sig.trusted_comment + b"\n",
            base64.b64encode(sig.global_signature) + b"\n",
        ]
    )
    if canon != sbytes:
        raise InstallError("%s: not in canonical form (a byte was changed)" % SIGNATURE)


def verify_bundle(
    bundle_dir: str,
    trusted_key: bytes | None,
    *,
    insecure: bool = False,
    sig_check: SigCheck | None = None,
    hashes: bool = True,
    on_bytes: Callable[[int], None] | None = None,
) -> tuple[dict[str, Any], bytes, bytes]:
    """Check signature, structure and every hash of a bundle folder; return (manifest, its bytes, sig bytes).

    Nothing is written. Refuses (InstallError, exit 1) a bad or missing signature, an unknown key, a
    changed trusted comment, a malformed manifest, path escapes, links, device files, extra, missing or
    changed files (named). ``trusted_key=None`` needs ``insecure=True``.
    """
    if not os.path.isdir(bundle_dir):
        raise InstallError("%s: no such bundle folder" % bundle_dir, EXIT_CONFIG)
    mbytes = read_limited(os.path.join(bundle_dir, MANIFEST), MAX_MANIFEST, MANIFEST)
    sbytes = b""
    if not insecure:
        if trusted_key is None:
            raise InstallError("no trusted key to check the signature with", EXIT_CONFIG)
        sbytes = read_limited(os.path.join(bundle_dir, SIGNATURE), 64 * 1024, SIGNATURE)
    elif os.path.lexists(os.path.join(bundle_dir, SIGNATURE)):
        sbytes = read_limited(os.path.join(bundle_dir, SIGNATURE), 64 * 1024, SIGNATURE)
    manifest = check_signed(mbytes, sbytes, trusted_key, insecure, sig_check)
    expected = physical_files(manifest)
    files, refused = scan_tree(bundle_dir)
    if refused:
        raise InstallError("%s: refused: %s" % (bundle_dir, _names(refused)))
    present = set(files)
    allowed = set(expected) | {MANIFEST} | ({SIGNATURE} if (not insecure or sbytes) else set())
    extra = sorted(present - allowed)
    if extra:
        raise InstallError("%s: extra files not in the manifest: %s" % (bundle_dir, _names(extra)))
    missing = sorted(set(expected) - present)
    if missing:
        raise InstallError("%s: missing files: %s" % (bundle_dir, _names(missing)))
    wrong = []
    for rel, (size, _) in sorted(expected.items()):
        st = os.lstat(os.path.join(bundle_dir, rel))
        if st.st_size != size:
            wrong.append("%s (%d bytes, expected %d)" % (rel, st.st_size, size))
    if wrong:
        raise InstallError("%s: changed files: %s" % (bundle_dir, _names(wrong)))
    if hashes:
        check_all_hashes(bundle_dir, manifest["files"], on_bytes)
    return manifest, mbytes, sbytes


def check_all_hashes(
    bundle_dir: str, files: list[dict[str, Any]], on_bytes: Callable[[int], None] | None = None
) -> None:
    """Every part (and every file not in parts) against its signed sha256, several at once.

    The whole-file sha256 of a file in parts is not recomputed here: each part's sha256 is in the
    signed manifest, so matching parts fix the reassembled bytes, and iter_file() checks the whole-file
    sha256 again when the install reassembles it (copy_entry); that saves a full pass over the data.
    Errors name the first damaged piece in manifest order.
    """
    jobs = []
    for e in files:
        if e.get("parts"):
            for p in e["parts"]:
                jobs.append((p["path"], p["size"], p["sha256"], "damaged part"))
        else:
            jobs.append((e["path"], e["size"], e["sha256"], "changed file"))

    def one(job: tuple[str, int, str, str]) -> str | None:
        rel, size, digest, what = job
        try:
            got, n = hash_file(os.path.join(bundle_dir, rel), on_bytes)
        except InstallError:  # its one refusal: not a regular file
            return "%s: not a regular file" % rel
        except OSError as e:
            return "%s: cannot read: %s" % (rel, e.strerror)
        if n != size or got != digest:
            return "%s: sha256 mismatch (%s)" % (rel, what)
        return None

    for err in in_parallel(one, jobs, size=lambda job: job[1]):
        if err is not None:
            raise InstallError(err)


def iter_file(bundle_dir: str, entry: dict[str, Any], check: bool = True) -> Iterator[memoryview]:
    """The bytes of a manifest file (whole or reassembled from its parts), checked as they stream.

    Raises InstallError naming the part or file whose size or sha256 differ (after the last chunk of it).
    ``check=False``: bytes this process already hashed as they arrived (receive) are not hashed again.
    """
    # One hash per byte: a file's own sha256, or each part's (the signed parts' hashes fix the
    # reassembled bytes, as check_all_hashes relies on too).
    total = 0
    pieces = entry.get("parts") or [{"path": entry["path"], "size": entry["size"], "sha256": entry["sha256"]}]
    buf = bytearray(READ_SIZE)
    view = memoryview(buf)
    for p in pieces:
        h = hashlib.sha256()
        n_part = 0
        path = os.path.join(bundle_dir, p["path"])
        try:
            f = open(path, "rb", buffering=0)
        except OSError as e:
            raise InstallError("%s: cannot read: %s" % (p["path"], e.strerror)) from None
        with f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise InstallError("%s: not a regular file" % p["path"])
            while True:
                n = f.readinto(buf)
                if not n:
                    break
                chunk = view[:n]
                if check:
                    h.update(chunk)
                n_part += n
                total += n
                if n_part > p["size"]:
                    raise InstallError(
                        "%s: larger than the manifest says (%d bytes)" % (p["path"], p["size"])
                    )
                yield chunk
        if n_part != p["size"] or (check and h.hexdigest() != p["sha256"]):
            what = "damaged part" if entry.get("parts") else "changed file"
            raise InstallError("%s: sha256 mismatch (%s)" % (p["path"], what))
    if total != entry["size"]:
        raise InstallError("%s: the reassembled file has %d bytes, not %d" % (entry["path"], total, entry["size"]))


def copy_entry(bundle_dir: str, entry: dict[str, Any], dest: str, mode: int) -> None:
    """Write a manifest file (reassembled, hash-checked) to dest via a temp name beside it."""
    clean_stale_tmp(dest)  # left by a killed run (dest may lie outside ROOT: clean_temps misses it)
    atomic_write(dest, iter_file(bundle_dir, entry), mode)


def parse_key(data: bytes, what: str) -> Any:
    try:
        return mv.parse_public_key(data)
    except mv.MinisignError as e:
        raise InstallError("%s: %s" % (what, e), EXIT_CONFIG) from None


def check_signed(mbytes: bytes, sbytes: bytes, key: bytes | None, insecure: bool,
                 sig_check: SigCheck | None = None) -> dict[str, Any]:
    """verify_bundle's checks of the manifest and its signature, on bytes (nothing else is read)."""
    comment = None
    if not insecure:
        if key is None:
            raise InstallError("no trusted key to check the signature with", EXIT_CONFIG)
        check_signature_form(sbytes)
        comment = (sig_check or openssl_sig_check)(mbytes, sbytes, key)
    try:
        obj = json.loads(mbytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InstallError("%s: malformed JSON: %s" % (MANIFEST, str(e)[:200])) from None
    manifest = check_manifest(obj)
    if bundle_id_of(manifest) != manifest["bundle_id"]:
        raise InstallError("%s: bundle_id does not match the manifest's content" % MANIFEST)
    if comment is not None and comment != trusted_comment_for(manifest):
        raise InstallError(
            "%s: the signed trusted comment %r does not match the manifest (id, host, fleet, "
            "lane, rank)" % (SIGNATURE, comment[:200])
        )
    return manifest
