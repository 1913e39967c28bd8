#!/usr/bin/env python3
"""builder's offline installer: verify a bundle, stage it as a release, switch atomically, roll back.

ONE stdlib-only file (no third-party imports, no builder imports; python3 >= 3.8 as on DGX OS). It
needs only python3, docker and openssl (OpenSSL 3.0 or newer, for Ed25519) on the host.

How it reaches a host:
- ``builder ship HOST`` sends the operator's trusted copy over ssh stdin to
  ``ROOT/incoming/installer-<sha256>.py`` and runs it there (``receive``, after checking it against
  that sha256); the copy in the bundle is never run by ship.
- A sneakernet bundle also carries the assembled installer as ``install.py``. The FIRST install on a
  host should use the operator's copy (``builder`` installs it as ``builder/installer.py``; the assembled
  one is ``python3 -m builder.installer assemble > install.py``): never run code from a bundle that has
  not been verified. Later installs may run the ``install.py`` of the current release
  (``<root>/current/install.py``), which was verified when it was installed.

Commands::

    install BUNDLE_DIR --root ROOT [--trusted-key FILE | --trusted-key-base64 LINE] [--insecure]
            [--host NAME] [--remove-source] [--reserve BYTES]
            [--stage]
            (--remove-source, for a folder under ROOT/incoming: its model files are linked into
            place where that is a move, see _link_whole; otherwise each is copied)
    stage --root ROOT --release BUNDLE_ID   (stage a release already under releases/)
    switch --root ROOT --to BUNDLE_ID [--rollback]
    rollback --root ROOT
    status --root ROOT
    receive --root ROOT [install's key, host, --stage and --reserve options]
                             (builder ship: the bundle streamed on stdin, each byte hashed as it
                             arrives, then installed; see "receive" below)
    inventory DIR            (sizes and sha256 of the files under DIR)
    assemble                 (print this installer with the minisign verifier embedded)

Layout under ROOT (a host's ``paths.bundles``)::

    trusted.pub                 the fleet's minisign public key (set at the first install)
    releases/<bundle_id>/       installed releases (launch files, manifest, signature, install.py)
    releases/.tmp-*             staging (removed at the next start; never a release)
    current -> releases/<id>    switched with symlink + rename (atomic)
    previous -> releases/<id>   what ``rollback`` returns to
    staged -> releases/<id>     what ``install --stage`` or ``stage`` made ready (``builder deploy``)
    state/applied.json          the apply record (see APPLY RECORD below), written atomically
    state/staged.json           the record the staged release will have once switched (action "stage")
    state/install.lock          flock: two installs never interleave
    incoming/<bundle_id>/       where ``builder ship`` copies a bundle

Order of an install: signature (against ROOT/trusted.pub; ``--insecure`` must be explicit to skip),
then every hash (extra, missing or changed files; ``..``, absolute paths, links and device files are
refused), then free disk, then: load the image if its ID is not present (the loaded ID must equal the
manifest's; a bundle of a fleet with a registry names the image by digest in ``image.pull`` instead of
carrying it, and ``docker pull`` fetches only the layers the host lacks; a thin archive,
``image.omitted_layers``, is refused unless the host holds the layers it leaves out), place bundled
model files atomically, stage the release, switch ``current``, keep the old
one as ``previous``, write the apply record. A SIGKILL at any point leaves ``current`` on a complete
release (the old one until the switch) and a rerun completes. A rerun of the installed bundle changes
nothing.

Stage, then switch (``builder deploy``: every host staged and audited before any host switches):
``install --stage`` does everything an install does up to the switch, then points ``staged`` at the
release and writes ``state/staged.json`` (the apply record the release will have, so the audit can
check the staged release before it runs); ``current`` and ``state/applied.json`` are not touched.
``stage --release ID`` does the same for a release already under ``releases/`` (its files, image and
model files checked again). ``switch --to ID`` makes any complete release current (``previous`` :=
the old current), writes the apply record (action ``install``, or ``rollback`` with ``--rollback``)
and clears ``staged`` when it named that release.

APPLY RECORD (state/applied.json, format 1)::

    {format, action ("install" | "rollback" | "stage"), bundle_id, host, fleet, lane, rank, role, world_size,
     lock_hash, image: {name, input_address, image_id, diff_ids}, manifest_sha256, applied_at (UTC,
     ISO 8601, the one non-deterministic field), previous_bundle_id (or null), release (its folder),
     files: [{path, size, sha256}] (the release's files), models: [{path, size, sha256, mtime (ns),
     inode}]}

Exit codes: 0 done (or nothing to do), 1 verification or the work failed, 2 usage or configuration.
"""

# ruff: noqa: UP031
from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    SigCheck = Callable[[bytes, bytes, bytes], str]

T = TypeVar("T")
R = TypeVar("R")

FORMAT = 1
KIND = "builder-bundle"
RECORD_FORMAT = 1
MANIFEST = "manifest.json"
SIGNATURE = "manifest.json.minisig"
IMAGE_ARCHIVE = "image.tar"
RESERVED = (MANIFEST, SIGNATURE)
READ_SIZE = 4 * 1024 * 1024
MAX_MANIFEST = 64 * 1024 * 1024
DEFAULT_RESERVE = 256 * 1024 * 1024
MODES = {"0644": 0o644, "0755": 0o755}
TMP_PREFIX = ".tmp-"

HEX64 = re.compile(r"^[0-9a-f]{64}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
PART_SUFFIX = re.compile(r"\.part([0-9]{4})$")
# host[:port]/repo@sha256:<hex>: the only form of image.pull (by digest, never by tag)
PULL_REF = re.compile(
    r"^([A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(:[0-9]{1,5})?/[a-z0-9]+([._/-][a-z0-9]+)*@sha256:[0-9a-f]{64}$"
)
PULL_TIMEOUT = 3600

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2

# The minisign verifier (builder/minisign_verify.py) is embedded on the next line by `assemble()`.
_EMBEDDED_VERIFIER = None  # @@EMBED@@
_EMBED_MARK = "_EMBEDDED_VERIFIER = None  # @@" + "EMBED@@"
_MV: Any = None


class InstallError(Exception):
    """An expected failure: one line and an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(" ".join(str(message).split()))
        self.code = code


def _say(message: str) -> None:
    sys.stderr.write("install: %s\n" % message)
    sys.stderr.flush()


# --------------------------------------------------------------------------- the verifier


def _verifier_source() -> str:
    if _EMBEDDED_VERIFIER is not None:
        return str(_EMBEDDED_VERIFIER)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "minisign_verify.py")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        raise InstallError(
            "the minisign verifier is neither embedded nor beside %s (use the assembled "
            "installer)" % os.path.basename(__file__),
            EXIT_CONFIG,
        ) from None


def verifier() -> Any:
    """The stdlib minisign verifier module (embedded copy, or builder/minisign_verify.py beside this file)."""
    global _MV
    if _MV is None:
        name = "_builder_installer_minisign_verify"
        mod = types.ModuleType(name)
        sys.modules[name] = mod  # dataclasses looks the module up while the class body runs
        exec(compile(_verifier_source(), "minisign_verify.py", "exec"), mod.__dict__)
        _MV = mod
    return _MV


def assemble() -> bytes:
    """This file with the verifier's source embedded: the single script ship sends and bundles carry."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "installer.py"), encoding="utf-8") as f:
        src = f.read()
    lines = src.split("\n")
    idx = [i for i, ln in enumerate(lines) if ln == _EMBED_MARK]
    if len(idx) != 1:
        raise InstallError("installer.py: the embed line is missing or repeated")
    lines[idx[0]] = "_EMBEDDED_VERIFIER = " + repr(_verifier_source())
    return "\n".join(lines).encode("utf-8")


# --------------------------------------------------------------------------- small helpers
# canonical_json, fsync_dir, atomic_write and hash_file are stdlib copies of builder.canon's and
# builder.hashing's: this file runs alone on a host and imports nothing of builder.


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def bundle_id_of(manifest: dict[str, Any]) -> str:
    """sha256 of the canonical manifest body without its bundle_id."""
    body = {k: v for k, v in manifest.items() if k != "bundle_id"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def fsync_dir(path: str) -> None:
    """fsync a folder (its entries); a file system that cannot is let be."""
    with contextlib.suppress(OSError):
        fsync_file(path)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_stem(path: str) -> str:
    """Start of the temp names atomic_write uses beside path (.tmp-builder-NAME.)."""
    return "%sbuilder-%s." % (TMP_PREFIX, os.path.basename(path))


def atomic_write(path: str, data: bytes | Iterable[bytes | memoryview], mode: int = 0o644) -> None:
    """Write data (bytes, or an iterable of chunks) to path via a temp name beside it, then rename."""
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, "%s%d.%s" % (_tmp_stem(path), os.getpid(), secrets.token_hex(4)))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            for chunk in [data] if isinstance(data, bytes) else data:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(d)


def human(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return ("%d %s" % (x, unit)) if unit == "B" else ("%.1f %s" % (x, unit))
        x /= 1024
    return "%d B" % n


#: bytes written to a file between two starts of its writeback (see Writeback)
WRITEBACK_STEP = 64 * 1024 * 1024


class Writeback:
    """Starts the disk writing a file's bytes while later ones are still being written, so the fsync
    at its end waits for the last step only: left alone, Linux holds gigabytes dirty until that fsync,
    and the disk idles while the bytes are read and hashed. posix_fadvise(DONTNEED) on the bytes
    written so far starts their writeback without waiting for it (and lets the kernel drop the pages
    once they are clean: they were hashed on the way in, nothing here reads them again). Where it
    does not exist, nothing is started early and the fsync does all of it."""

    def __init__(self, fd: int, offset: int = 0, end_only: bool = False) -> None:
        self.fd = fd
        self.end_only = end_only  # (then only start_rest, at the file's end, starts it)
        self.started = self.at = offset

    def wrote(self, n: int) -> None:
        self.at += n
        if not self.end_only and self.at - self.started >= WRITEBACK_STEP:
            self.start_rest()

    def start_rest(self) -> None:
        """Start the writeback of every byte written and not yet started (the end of a file)."""
        if self.at > self.started and hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(self.fd, self.started, self.at - self.started, os.POSIX_FADV_DONTNEED)
        self.started = self.at


def write_all(fd: int, chunk: memoryview, wb: Writeback | None = None) -> None:
    """os.write until the whole chunk is written (a short write writes the rest)."""
    n = len(chunk)
    while chunk:
        chunk = chunk[os.write(fd, chunk) :]
    if wb is not None:
        wb.wrote(n)


def hash_file(path: str, on_bytes: Callable[[int], None] | None = None) -> tuple[str, int]:
    """sha256 and size of one regular file: readinto one reusable buffer (no allocation per read);
    ``on_bytes`` (progress) is told each read's size."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(READ_SIZE)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise InstallError("%s: not a regular file" % path)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
            if on_bytes is not None:
                on_bytes(n)
    return h.hexdigest(), size


# Stdlib copies of builder.hashing.default_workers and in_parallel: this file runs alone on a host.
def default_workers() -> int:
    """One hashing thread per usable core, at least 1 and at most 16 (past that the disk limits)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(16, n))


def in_parallel(
    fn: Callable[[T], R], items: Sequence[T], *, size: Callable[[T], int] | None = None, workers: int | None = None
) -> list[R]:
    """fn over items on a pool of hashing threads (largest first when ``size`` is given); results
    in the items' order. hashlib releases the GIL for large updates, so N threads hash on N cores."""
    n = min(workers or default_workers(), len(items))
    order = sorted(range(len(items)), key=lambda i: size(items[i]), reverse=True) if size else range(len(items))
    if n <= 1:
        done = {i: fn(items[i]) for i in order}
    else:
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="sha256") as ex:
            done = dict(ex.map(lambda i: (i, fn(items[i])), order))
    return [done[i] for i in range(len(items))]


def _read_limited(path: str, limit: int, what: str) -> bytes:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise InstallError("%s: missing" % what) from None
    if stat.S_ISLNK(st.st_mode):
        raise InstallError("%s: is a symbolic link (refused)" % what)
    if not stat.S_ISREG(st.st_mode):
        raise InstallError("%s: not a regular file (refused)" % what)
    if st.st_size > limit:
        raise InstallError("%s: too large (%s)" % (what, human(st.st_size)))
    with open(path, "rb") as f:
        return f.read(limit + 1)


# --------------------------------------------------------------------------- the manifest


def _err(where: str, msg: str) -> InstallError:
    return InstallError("%s: %s: %s" % (MANIFEST, where, msg))


def _want(obj: Any, keys: dict[str, Any], where: str, optional: tuple[str, ...] = ()) -> None:
    if not isinstance(obj, dict):
        raise _err(where, "expected an object")
    for k in sorted(obj):
        if k not in keys:
            raise _err("%s.%s" % (where, k) if where else k, "unknown key")
    for k, typ in keys.items():
        p = "%s.%s" % (where, k) if where else k
        if k not in obj:
            if k in optional:
                continue
            raise _err(p, "missing required key")
        v = obj[k]
        if typ is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif typ == "str?":
            ok = v is None or isinstance(v, str)
        else:
            ok = isinstance(v, typ)
        if not ok:
            raise _err(p, "wrong type")


def check_rel_path(path: str, where: str) -> str:
    """A path inside the bundle: relative, '/'-separated, no '..', '.', empty parts or odd characters."""
    if not path or len(path) > 1024:
        raise _err(where, "empty or too long path")
    if path.startswith("/") or "\\" in path or any(ch in path for ch in "\x00\r\n"):
        raise _err(where, "path %r escapes the bundle or has odd characters" % path)
    parts = path.split("/")
    for p in parts:
        if p in ("", ".", ".."):
            raise _err(where, "path %r escapes the bundle (empty, '.' or '..' part)" % path)
    return path


def check_abs_path(path: str, where: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or any(ch in path for ch in "\x00\r\n\\"):
        raise _err(where, "not an absolute path: %r" % (path,))
    if os.path.normpath(path) != path or ".." in path.split("/") or path.startswith("//"):
        raise _err(where, "path %r is not normalized (or has '..')" % path)
    return path


def _under(path: str, root: str) -> bool:
    return path.startswith(root.rstrip("/") + "/")


def check_manifest(obj: Any) -> dict[str, Any]:
    """Validate a manifest's structure and every path rule; return it. InstallError on the first problem."""
    _want(
        obj,
        {
            "format": int,
            "kind": str,
            "bundle_id": str,
            "builder": str,
            "fleet": str,
            "host": str,
            "lane": str,
            "rank": int,
            "role": str,
            "world_size": int,
            "lock_hash": str,
            "image": dict,
            "paths": dict,
            "files": list,
            "models": list,
        },
        "",
    )
    if obj["format"] != FORMAT:
        raise _err(
            "format", "unsupported bundle format %r (this installer reads %d)" % (obj["format"], FORMAT)
        )
    if obj["kind"] != KIND:
        raise _err("kind", "not a builder bundle")
    if not HEX64.match(obj["bundle_id"]):
        raise _err("bundle_id", "not a sha256")
    for k in ("fleet", "host", "lane"):
        if not NAME.match(obj[k]):
            raise _err(k, "not a valid name")
    if obj["role"] not in ("head", "worker"):
        raise _err("role", "must be head or worker")
    if not (1 <= obj["world_size"] <= 64 and 0 <= obj["rank"] < obj["world_size"]):
        raise _err("rank", "rank/world_size out of range")
    if (obj["rank"] == 0) != (obj["role"] == "head"):
        raise _err("role", "rank 0 is the head and only rank 0")
    if not HEX64.match(obj["lock_hash"]):
        raise _err("lock_hash", "not a sha256")
    img = obj["image"]
    _want(
        img,
        {"name": str, "input_address": str, "image_id": str, "diff_ids": list, "archive": "str?", "pull": "str?",
         "omitted_layers": int},
        "image",
        optional=("pull", "omitted_layers"),
    )
    if not HEX64.match(img["input_address"]):
        raise _err("image.input_address", "not a sha256")
    if not DIGEST.match(img["image_id"]):
        raise _err("image.image_id", "not a sha256: digest")
    for i, d in enumerate(img["diff_ids"]):
        if not isinstance(d, str) or not DIGEST.match(d):
            raise _err("image.diff_ids[%d]" % i, "not a sha256: digest")
    if img["archive"] is not None and img["archive"] != IMAGE_ARCHIVE:
        raise _err("image.archive", "must be %r or null" % IMAGE_ARCHIVE)
    if img.get("pull") is not None and not PULL_REF.match(img["pull"]):
        raise _err("image.pull", "not a registry reference by digest (host:port/repo@sha256:...)")
    if "omitted_layers" in img and (img["archive"] is None or not 0 < img["omitted_layers"] <= len(img["diff_ids"])):
        raise _err("image.omitted_layers", "must count leading layers of a carried archive")
    paths = obj["paths"]
    _want(paths, {"bundles": str, "models": str, "engram": str}, "paths")
    for k in ("bundles", "models", "engram"):
        check_abs_path(paths[k], "paths." + k)

    seen: dict[str, str] = {}
    physical: list[str] = []

    def claim(p: str, where: str) -> None:
        if p in RESERVED:
            raise _err(where, "path %r is reserved" % p)
        if p in seen:
            raise _err(where, "path %r listed twice" % p)
        seen[p] = where
        physical.append(p)

    names = set()
    for i, f in enumerate(obj["files"]):
        w = "files[%d]" % i
        _want(
            f, {"path": str, "size": int, "sha256": str, "mode": str, "parts": list}, w, optional=("parts",)
        )
        check_rel_path(f["path"], w + ".path")
        if f["path"].startswith("parts/"):
            raise _err(w + ".path", "the parts/ folder is for parts only")
        if f["size"] < 0 or not HEX64.match(f["sha256"]):
            raise _err(w, "bad size or sha256")
        if f["mode"] not in MODES:
            raise _err(w + ".mode", "must be one of %s" % ", ".join(sorted(MODES)))
        if f["path"] in names:
            raise _err(w + ".path", "path %r listed twice" % f["path"])
        names.add(f["path"])
        parts = f.get("parts")
        if parts is None:
            claim(f["path"], w + ".path")
            continue
        if len(parts) < 2:
            raise _err(w + ".parts", "a file in parts has at least two")
        total = 0
        for j, p in enumerate(parts):
            pw = "%s.parts[%d]" % (w, j)
            _want(p, {"path": str, "size": int, "sha256": str}, pw)
            expect = "parts/%s.part%04d" % (f["path"], j)
            if p["path"] != expect:
                raise _err(pw + ".path", "expected %r" % expect)
            if p["size"] <= 0 or not HEX64.match(p["sha256"]):
                raise _err(pw, "bad size or sha256")
            total += p["size"]
            claim(p["path"], pw + ".path")
        if total != f["size"]:
            raise _err(w + ".parts", "part sizes add up to %d, not %d" % (total, f["size"]))
    # a file may not also be a folder of another file
    for ph in physical:
        pre = ph.split("/")
        for depth in range(1, len(pre)):
            if "/".join(pre[:depth]) in seen:
                raise _err(seen[ph], "path %r lies under the file %r" % (ph, "/".join(pre[:depth])))
    if img["archive"] is not None and img["archive"] not in names:
        raise _err("image.archive", "names no file of the bundle")

    targets = set()
    for i, m in enumerate(obj["models"]):
        w = "models[%d]" % i
        _want(m, {"model": str, "file": str, "path": str, "size": int, "sha256": str, "bundled": "str?"}, w)
        if not NAME.match(m["model"]):
            raise _err(w + ".model", "not a valid name")
        check_abs_path(m["path"], w + ".path")
        if not (_under(m["path"], paths["models"]) or _under(m["path"], paths["engram"])):
            raise _err(w + ".path", "%r is outside paths.models and paths.engram" % m["path"])
        if m["path"] in targets:
            raise _err(w + ".path", "listed twice")
        targets.add(m["path"])
        if m["size"] < 0 or not HEX64.match(m["sha256"]):
            raise _err(w, "bad size or sha256")
        b = m["bundled"]
        if b is not None:
            if not b.startswith("models/") or b not in names:
                raise _err(w + ".bundled", "names no models/ file of the bundle")
            fe = [f for f in obj["files"] if f["path"] == b][0]
            if fe["size"] != m["size"] or fe["sha256"] != m["sha256"]:
                raise _err(w + ".bundled", "size or sha256 differ from the bundled file")
    return obj


def physical_files(manifest: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Every file the bundle folder holds (parts instead of parted files): path -> (size, sha256)."""
    out: dict[str, tuple[int, str]] = {}
    for f in manifest["files"]:
        if f.get("parts"):
            for p in f["parts"]:
                out[p["path"]] = (p["size"], p["sha256"])
        else:
            out[f["path"]] = (f["size"], f["sha256"])
    return out


def release_files(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The files a release keeps: all but the image archive and bundled models."""
    skip = {manifest["image"]["archive"]} | {m["bundled"] for m in manifest["models"] if m["bundled"]}
    return [f for f in manifest["files"] if f["path"] not in skip]


def trusted_comment_for(manifest: dict[str, Any]) -> str:
    return "builder-bundle id=%s host=%s fleet=%s lane=%s rank=%d" % (
        manifest["bundle_id"],
        manifest["host"],
        manifest["fleet"],
        manifest["lane"],
        manifest["rank"],
    )


# --------------------------------------------------------------------------- verifying a folder


def scan_tree(root: str) -> tuple[list[str], list[str]]:
    """(regular files, refused entries with why) under root, relative, '/'-separated; never follows links."""
    files: list[str] = []
    refused: list[str] = []

    def walk(d: str, rel: str) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            refused.append("%s (cannot list: %s)" % (rel or ".", e.strerror))
            return
        for ent in entries:
            r = rel + "/" + ent.name if rel else ent.name
            if ent.is_symlink():
                refused.append("%s (symbolic link)" % r)
            elif ent.is_dir(follow_symlinks=False):
                walk(ent.path, r)
            elif ent.is_file(follow_symlinks=False):
                files.append(r)
            else:
                refused.append("%s (not a regular file)" % r)

    walk(root, "")
    return files, refused


def _names(items: list[str], n: int = 5) -> str:
    s = ", ".join(items[:n])
    return s + (" (and %d more)" % (len(items) - n) if len(items) > n else "")


def openssl_sig_check(manifest_bytes: bytes, sig_bytes: bytes, key_bytes: bytes) -> str:
    mv = verifier()
    try:
        return str(mv.verify_with_openssl(manifest_bytes, sig_bytes, key_bytes))
    except mv.MinisignError as e:
        raise InstallError("%s: %s" % (SIGNATURE, e)) from None


#: untrusted comments a bundle signature may carry (the line is not signed, so it is pinned instead)
SIGNATURE_COMMENTS = ("signature from builder secret key", "signature from minisign secret key")


def check_signature_form(sbytes: bytes) -> None:
    """The signature file must be exactly the canonical four lines (minisign does not sign line 1, and
    base64 padding bits are ignored by decoders): any changed byte is refused, not just signed ones."""
    mv = verifier()
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
    mbytes = _read_limited(os.path.join(bundle_dir, MANIFEST), MAX_MANIFEST, MANIFEST)
    sbytes = b""
    if not insecure:
        if trusted_key is None:
            raise InstallError("no trusted key to check the signature with", EXIT_CONFIG)
        sbytes = _read_limited(os.path.join(bundle_dir, SIGNATURE), 64 * 1024, SIGNATURE)
    elif os.path.lexists(os.path.join(bundle_dir, SIGNATURE)):
        sbytes = _read_limited(os.path.join(bundle_dir, SIGNATURE), 64 * 1024, SIGNATURE)
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


def check_file_hashes(bundle_dir: str, entry: dict[str, Any]) -> None:
    for _ in iter_file(bundle_dir, entry):
        pass


def copy_entry(bundle_dir: str, entry: dict[str, Any], dest: str, mode: int) -> None:
    """Write a manifest file (reassembled, hash-checked) to dest via a temp name beside it."""
    d = os.path.dirname(dest)
    stale = _tmp_stem(dest)
    with contextlib.suppress(FileNotFoundError):
        for n in os.listdir(d):  # left by a killed run (dest may lie outside ROOT: clean_temps misses it)
            if n.startswith(stale):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, n))
    atomic_write(dest, iter_file(bundle_dir, entry), mode)


# --------------------------------------------------------------------------- docker


def docker(args: list[str], *, timeout: float = 120, stdin: Any = None) -> subprocess.CompletedProcess:
    exe = shutil.which("docker")
    if exe is None:
        raise InstallError("docker: not found on PATH")
    try:
        return subprocess.run([exe] + args, capture_output=True, timeout=timeout, stdin=stdin, check=False)
    except subprocess.TimeoutExpired:
        raise InstallError("docker %s: no answer within %d s" % (args[0], timeout)) from None


def image_present(image_id: str) -> list[str] | None:
    """The image's DiffIDs when the engine has this ImageID, else None."""
    p = docker(["image", "inspect", "--format", "{{.Id}} {{json .RootFS.Layers}}", image_id])
    if p.returncode != 0:
        err = p.stderr.decode("utf-8", "replace")
        if "No such" in err or "no such" in err:
            return None
        raise InstallError("docker image inspect: %s" % (err.strip().splitlines() or ["failed"])[-1])
    out = p.stdout.decode("utf-8", "replace").strip()
    got_id, _, layers = out.partition(" ")
    if got_id != image_id:
        return None
    try:
        return [str(x) for x in json.loads(layers)]
    except ValueError:
        return []


def docker_root() -> str | None:
    p = docker(["info", "--format", "{{.DockerRootDir}}"], timeout=60)
    if p.returncode != 0:
        return None
    d = p.stdout.decode("utf-8", "replace").strip()
    return d or None


def load_image(bundle_dir: str, manifest: dict[str, Any]) -> None:
    """Stream the archive (reassembled from parts, hash-checked as it goes) into `docker load`;
    check the loaded ID."""
    img = manifest["image"]
    entry = [f for f in manifest["files"] if f["path"] == img["archive"]][0]
    load = Load(img, entry["size"])
    failed: BaseException | None = None
    try:
        assert load.proc.stdin is not None
        for chunk in iter_file(bundle_dir, entry):
            load.proc.stdin.write(chunk)
        load.proc.stdin.close()
    except BrokenPipeError:
        pass
    except BaseException as e:  # a hash mismatch: stop docker load before it finishes
        failed = e
        with contextlib.suppress(OSError):
            load.proc.kill()
    load.finish(failed)


class Load:
    """One `docker load` running: of a whole archive file already checked (``path``: its stdin is
    the file, so it runs beside other work), or fed through its stdin pipe (``path`` None)."""

    def __init__(self, img: dict[str, Any], size: int, path: str | None = None) -> None:
        exe = shutil.which("docker")
        if exe is None:
            raise InstallError("docker: not found on PATH")
        _say("loading image %s (%s)" % (img["image_id"][:19], human(size)))
        self.img = img
        self.outf, self.errf = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # no pipe to fill up
        with open(path, "rb") if path is not None else contextlib.nullcontext() as src:
            self.proc = subprocess.Popen([exe, "load"], stdin=src if src is not None else subprocess.PIPE,
                                         stdout=self.outf, stderr=self.errf)

    def finish(self, failed: BaseException | None = None) -> None:
        """Wait for it and check the loaded image (its ID, and DiffIDs, the manifest's); re-raise
        ``failed`` (what stopped its feed) once it has ended."""
        proc = self.proc
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=3600)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise InstallError("docker load: no answer within an hour") from None
        self.outf.seek(0)
        self.errf.seek(0)
        out, err = self.outf.read(65536), self.errf.read(65536)
        self.outf.close()
        self.errf.close()
        img = self.img
        if failed is not None:
            raise failed
        if proc.returncode != 0:
            last = (err.decode("utf-8", "replace").strip().splitlines() or ["failed"])[-1]
            raise InstallError("docker load: %s" % last)
        layers = image_present(img["image_id"])
        if layers is None:
            raise InstallError(
                "docker load: the archive did not give image %s (got: %s)"
                % (img["image_id"], out.decode("utf-8", "replace").strip()[:200])
            )
        if layers and layers != img["diff_ids"]:
            raise InstallError("docker load: image %s has DiffIDs other than the manifest's" % img["image_id"])


def check_thin(img: dict[str, Any]) -> None:
    """A thin archive (``image.omitted_layers``: its leading layers left out) loads only on an engine
    with the classic image store that holds those layers' chain already: `docker load` there skips a
    layer whose chain it has, without reading its file. An engine keeping images in containerd needs
    every blob. Refused here, before anything changes, when either does not hold."""
    p = docker(["info", "--format", "{{json .DriverStatus}}"], timeout=60)
    if p.returncode == 0 and b"io.containerd.snapshotter" in p.stdout:
        raise InstallError(
            "image %s: this host's Docker Engine keeps images in containerd, whose docker load needs every "
            "layer; a thin bundle cannot be loaded here (bundle it without --thin)" % img["image_id"]
        )
    k = img["omitted_layers"]
    want = img["diff_ids"][:k]
    ids = docker(["image", "ls", "--quiet", "--no-trunc"], timeout=60)
    listed = sorted(set(ids.stdout.decode("utf-8", "replace").split())) if ids.returncode == 0 else []
    chains: list[list[str]] = []
    if listed:
        q = docker(["image", "inspect", "--format", "{{json .RootFS.Layers}}"] + listed, timeout=120)
        for line in q.stdout.decode("utf-8", "replace").splitlines():
            try:
                chains.append([str(x) for x in json.loads(line) or []])
            except ValueError:
                continue
    held = 0
    for chain in chains:
        n = 0
        while n < min(len(chain), k) and chain[n] == want[n]:
            n += 1
        held = max(held, n)
    if held < k:
        raise InstallError(
            "image %s: the bundle leaves out %d layer(s) this host does not hold, from %s (bundle it without "
            "--thin, or with --have from this host's record)" % (img["image_id"], k - held, want[held][:19])
        )


def pull_image(manifest: dict[str, Any]) -> None:
    """``docker pull`` the image by digest from the fleet's registry; check the pulled ImageID and DiffIDs.

    The host's dockerd fetches only the layers it lacks and checks every blob against its digest; the
    ImageID check here is what ties the registry's manifest to the signed bundle (another image under
    that reference is refused before anything switches). A registry that does not answer is one line
    naming it.
    """
    img = manifest["image"]
    ref = img["pull"]
    registry = ref.split("/", 1)[0]
    _say("pulling image %s from %s" % (img["image_id"][:19], registry))
    p = docker(["pull", "--quiet", ref], timeout=PULL_TIMEOUT)
    if p.returncode != 0:
        lines = p.stderr.decode("utf-8", "replace").strip().splitlines() or ["failed"]
        raise InstallError("registry %s: cannot pull %s: %s" % (registry, ref.split("/", 1)[1], lines[-1][:300]))
    layers = image_present(img["image_id"])
    if layers is None:
        got = docker(["image", "inspect", "--format", "{{.Id}}", ref])
        gid = got.stdout.decode("utf-8", "replace").strip() if got.returncode == 0 else "nothing"
        raise InstallError(
            "registry %s: %s is image %s, not the bundle's %s" % (registry, ref.split("/", 1)[1], gid, img["image_id"])
        )
    if layers != img["diff_ids"]:
        raise InstallError("registry %s: image %s has DiffIDs other than the manifest's" % (registry, img["image_id"]))
    # a pull by digest tags nothing; the image gets the tag a `docker load` of its archive gives it
    # (a marked copy of builder.imagerecord.tag_for), which the audit checks
    tag = pulled_tag(img)
    t = docker(["tag", img["image_id"], tag], timeout=60)
    if t.returncode != 0:
        err = t.stderr.decode("utf-8", "replace").strip() or "failed"
        raise InstallError("docker tag %s: %s" % (tag, err[-200:]))


def pulled_tag(img: dict[str, Any]) -> str:
    """builder/NAME:<input address[:32]>: builder.imagerecord.tag_for, copied (the installer imports nothing)."""
    return "builder/%s:%s" % (img["name"], img["input_address"][:32])


# --------------------------------------------------------------------------- root state


class Root:
    def __init__(self, root: str) -> None:
        if not root.startswith("/"):
            root = os.path.abspath(root)
        self.root = root.rstrip("/") or "/"
        self.releases = os.path.join(self.root, "releases")
        self.state = os.path.join(self.root, "state")
        self.incoming = os.path.join(self.root, "incoming")
        self.record = os.path.join(self.state, "applied.json")
        self.staged_record = os.path.join(self.state, "staged.json")
        self.trusted = os.path.join(self.root, "trusted.pub")

    def link(self, name: str) -> str | None:
        """The bundle id a link (current/previous) points at, or None."""
        p = os.path.join(self.root, name)
        try:
            target = os.readlink(p)
        except OSError:
            return None
        bid = os.path.basename(target.rstrip("/"))
        return bid if HEX64.match(bid) else None

    def clear_staged(self, bundle_id: str | None = None) -> None:
        """Forget the staged release (only when it is bundle_id, if given): record first, then link."""
        if bundle_id is not None and self.link("staged") != bundle_id:
            return
        for p in (self.staged_record, os.path.join(self.root, "staged")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        fsync_dir(self.state)
        fsync_dir(self.root)

    def releases_present(self) -> list[str]:
        try:
            names = os.listdir(self.releases)
        except OSError:
            return []
        return sorted(n for n in names if HEX64.match(n) and os.path.isdir(os.path.join(self.releases, n)))

    def set_link(self, name: str, bundle_id: str) -> None:
        tmp = os.path.join(self.root, "%slink-%s-%d" % (TMP_PREFIX, name, os.getpid()))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.symlink("releases/" + bundle_id, tmp)
        os.replace(tmp, os.path.join(self.root, name))
        fsync_dir(self.root)

    def release(self, bundle_id: str) -> str:
        return os.path.join(self.releases, bundle_id)

    def read_record(self, path: str | None = None) -> dict[str, Any] | None:
        try:
            with open(path or self.record, "rb") as f:
                obj = json.loads(f.read(MAX_MANIFEST).decode("utf-8"))
        except (OSError, ValueError):
            return None
        return obj if isinstance(obj, dict) else None

    def clean_temps(self) -> None:
        """Remove staging left by a killed run (names start with .tmp-)."""
        for d in (self.root, self.releases, self.state):
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for n in names:
                if n.startswith(TMP_PREFIX):
                    p = os.path.join(d, n)
                    if os.path.isdir(p) and not os.path.islink(p):
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(p)

    @contextlib.contextmanager
    def locked(self, timeout: float) -> Iterator[None]:
        os.makedirs(self.state, exist_ok=True)
        fd = os.open(os.path.join(self.state, "install.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                        raise InstallError(
                            "%s: another install or rollback holds the lock" % self.root
                        ) from None
                    time.sleep(0.2)
            yield
        finally:
            os.close(fd)


def _free(path: str) -> tuple[int, int]:
    """(device, free bytes) of the filesystem that holds path (or its nearest existing parent)."""
    p = path
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return os.stat(p).st_dev, shutil.disk_usage(p).free


def check_disk(needs: list[tuple[str, int]], reserve: int) -> None:
    by_dev: dict[int, list[Any]] = {}
    for path, n in needs:
        if n <= 0:
            continue
        dev, free = _free(path)
        slot = by_dev.setdefault(dev, [0, free, path])
        slot[0] += n
    for need, free, path in by_dev.values():
        if need + reserve > free:
            raise InstallError(
                "not enough disk for %s: need %s (plus %s reserve), %s free"
                % (path, human(need), human(reserve), human(free))
            )


def recorded_mtime_ns(value: Any) -> int | None:
    """An apply record's mtime in nanoseconds: this installer writes int ns; float (or small int)
    seconds are accepted from other writers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and value > 10**12:
        return value
    return int(round(float(value) * 1e9))


def fast_mode_drift(recorded: Any, sha256: str, size: int, st_size: int, st_mtime_ns: int, st_ino: int) -> str | None:
    """Fast mode's one rule: does an apply record's entry still vouch for a file's bytes?

    An install hashes each model file in full and records its size, mtime (ns) and inode beside the
    sha256; the entry vouches for ``sha256`` while the file keeps all three. This trusts the file
    system: an in-place edit of the same size whose mtime was put back is not seen (full mode hashes).
    None when the entry vouches; else the drift: "no-record" (no entry, or one for other bytes),
    "size", "replaced" (another inode) or "modified" (another mtime). Seconds lose precision as
    floats, so a recorded mtime in seconds matches within a millisecond; nanoseconds match exactly.
    The installer, builder.hashing and checks/test_models.py all decide with this function.
    """
    if not isinstance(recorded, dict) or recorded.get("sha256") != sha256 or recorded.get("size") != size:
        return "no-record"
    if st_size != size:
        return "size"
    if recorded.get("inode") != st_ino:
        return "replaced"
    raw = recorded.get("mtime")
    want = recorded_mtime_ns(raw)
    in_ns = want is not None and want == raw
    if want is None or (want != st_mtime_ns if in_ns else abs(want - st_mtime_ns) >= 1_000_000):
        return "modified"
    return None


def _model_cached(m: dict[str, Any], old: dict[str, Any] | None) -> bool:
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
    if any(_model_cached(m, o) for o in (old if isinstance(old, list) else [old])):
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


def release_ok(path: str, manifest: dict[str, Any], mbytes: bytes) -> bool:
    """A staged release: its manifest bytes and every release file as the manifest says."""
    try:
        with open(os.path.join(path, MANIFEST), "rb") as f:
            if f.read(MAX_MANIFEST + 1) != mbytes:
                return False
        for fe in release_files(manifest):
            p = os.path.join(path, fe["path"])
            st = os.lstat(p)
            if not stat.S_ISREG(st.st_mode) or st.st_size != fe["size"]:
                return False
            if hash_file(p)[0] != fe["sha256"]:
                return False
    except OSError:
        return False
    return True


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


# --------------------------------------------------------------------------- install


def _key_bytes(args: argparse.Namespace) -> bytes | None:
    if getattr(args, "trusted_key", None):
        try:
            with open(args.trusted_key, "rb") as f:
                return f.read(64 * 1024)
        except OSError as e:
            raise InstallError(
                "%s: cannot read trusted key: %s" % (args.trusted_key, e.strerror), EXIT_CONFIG
            ) from None
    if getattr(args, "trusted_key_base64", None):
        return args.trusted_key_base64.encode("ascii", "replace")
    return None


def _parse_key(data: bytes, what: str) -> Any:
    mv = verifier()
    try:
        return mv.parse_public_key(data)
    except mv.MinisignError as e:
        raise InstallError("%s: %s" % (what, e), EXIT_CONFIG) from None


def install(
    bundle_dir: str,
    root: str,
    *,
    trusted_key: bytes | None = None,
    insecure: bool = False,
    host: str | None = None,
    remove_source: bool = False,
    reserve: int = DEFAULT_RESERVE,
    lock_timeout: float = 60.0,
    sig_check: SigCheck | None = None,
    stage: bool = False,
) -> dict[str, Any]:
    """Install a bundle folder under root; return {"result": "installed"|"unchanged"|"staged", ...}.

    ``stage``: everything up to the switch, then ``staged`` and state/staged.json instead of
    ``current`` and the apply record (see "Stage, then switch" above)."""
    r = Root(root)
    bundle_dir = os.path.abspath(bundle_dir)
    with r.locked(lock_timeout):
        r.clean_temps()
        key, new_key = _host_key(r, trusted_key, insecure)  # 1. the key
        # 2. signature, structure and sizes, before anything changes; each byte is hashed once below,
        # in the pass that uses it (a model file as it is written to a temp name beside its place,
        # the image archive as it streams into docker load, the rest on its own), and nothing is
        # placed or switched until every one checked out
        manifest, mbytes, sbytes = verify_bundle(
            bundle_dir, key, insecure=insecure, sig_check=sig_check, hashes=False
        )
        bid = manifest["bundle_id"]
        old = _host_record(r, manifest, host)
        current = r.link("current")
        img = manifest["image"]
        have_layers = image_present(img["image_id"])
        vouch = [old, r.read_record(r.staged_record)]
        if (
            current == bid
            and old
            and old.get("bundle_id") == bid
            and have_layers is not None
            and release_ok(r.release(bid), manifest, mbytes)
            and all(model_ok(m, vouch) is None for m in manifest["models"])
        ):
            check_all_hashes(bundle_dir, manifest["files"])
            _say("bundle %s is already installed; nothing to do" % bid[:16])
            if stage:
                _mark_staged(r, manifest, mbytes, old.get("previous_bundle_id"))
            if remove_source:
                _remove_source(r, bundle_dir)
            return {"result": "unchanged", "bundle_id": bid, "release": r.release(bid)}
        # 3. what is needed, and room for it
        _check_image_source(img, have_layers)
        if have_layers is None and img["archive"] is not None and img.get("omitted_layers"):
            check_thin(img)
        bundled = {f["path"]: f for f in manifest["files"]}
        needs: list[tuple[str, int]] = []
        for m in manifest["models"]:
            why = model_ok(m, vouch)
            if why is None:
                continue
            if m["bundled"] is None:
                raise InstallError(
                    "model file %s: %s (the bundle does not carry it; copy it there or bundle "
                    "with --with-models)" % (m["path"], why)
                )
            needs.append((m["path"], m["size"]))
        if have_layers is None and img["archive"] is not None:
            archive = bundled[img["archive"]]
            needs.append((docker_root() or r.root, 2 * archive["size"]))
        needs.append(
            (r.releases, sum(f["size"] for f in release_files(manifest)) + len(mbytes) + len(sbytes))
        )
        check_disk(needs, reserve)
        # 4. image, models, release, switch, record
        placing = [m for m in manifest["models"] if model_ok(m, vouch) is not None]
        loading = have_layers is None and img["archive"] is not None
        streamed = {bundled[m["bundled"]]["path"] for m in placing} | ({img["archive"]} if loading else set())
        check_all_hashes(bundle_dir, [f for f in manifest["files"] if f["path"] not in streamed])
        written = _write_models(bundle_dir, bundled, placing, link=remove_source)
        try:
            if loading:
                load_image(bundle_dir, manifest)
            elif have_layers is None:
                pull_image(manifest)
        except BaseException:
            for tmp, _ in written:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise
        for tmp, dest in written:
            os.replace(tmp, dest)
        for d in sorted({os.path.dirname(dest) for _, dest in written}):
            fsync_dir(d)
        stage_release(r, bundle_dir, manifest, mbytes, sbytes)
        res = _switch_in(r, manifest, mbytes, stage, current, trusted_key if new_key else None)
        if remove_source:
            _remove_source(r, bundle_dir)
        return res


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
        d = os.path.dirname(m["path"])
        stem = _tmp_stem(m["path"])
        with contextlib.suppress(FileNotFoundError):
            for n in os.listdir(d):  # left by a killed run (outside ROOT: clean_temps misses it)
                if n.startswith(stem):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(d, n))
        written.append((os.path.join(d, "%splace-%d" % (stem, os.getpid())), m["path"]))

    def one(i: int) -> None:
        m, (tmp, _) = placing[i], written[i]
        _say("placing model file %s" % m["path"])
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
        for tmp, _ in written:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    return written


def _remove_source(r: Root, bundle_dir: str) -> None:
    real = os.path.realpath(bundle_dir)
    if not _under(real, os.path.realpath(r.incoming)):
        raise InstallError("--remove-source: %s is not under %s" % (bundle_dir, r.incoming), EXIT_CONFIG)
    gone = os.path.join(r.incoming, "%sgone-%d" % (TMP_PREFIX, os.getpid()))
    with contextlib.suppress(OSError):
        os.rename(real, gone)
        shutil.rmtree(gone, ignore_errors=True)


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
    tmp = os.path.join(r.releases, "%s%s-%d" % (TMP_PREFIX, bid[:16], os.getpid()))
    shutil.rmtree(tmp, ignore_errors=True)
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
    if os.path.lexists(final):  # damaged or partial (not ours to trust): move aside, then replace
        aside = os.path.join(r.releases, "%sold-%s-%d" % (TMP_PREFIX, bid[:16], os.getpid()))
        os.rename(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(r.releases)


# --------------------------------------------------------------------------- rollback and status


def _release_manifest(r: Root, bid: str) -> tuple[dict[str, Any], bytes]:
    path = os.path.join(r.release(bid), MANIFEST)
    mbytes = _read_limited(path, MAX_MANIFEST, path)
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
        _say("rolled back to bundle %s (from %s)" % (previous[:16], (current or "none")[:16]))
        return {
            "result": "rolled-back",
            "bundle_id": previous,
            "previous_bundle_id": current,
            "release": r.release(previous),
        }


def _mark_staged(r: Root, manifest: dict[str, Any], mbytes: bytes, previous: str | None) -> None:
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
    vouch = [r.read_record(), r.read_record(r.staged_record)]
    for m in manifest["models"]:
        why = model_ok(m, vouch)
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
        _mark_staged(r, manifest, mbytes, prev)
        _say("staged release %s; current stays %s" % (bid[:16], (current or "none")[:16]))
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
        _say("switched to release %s (from %s)" % (bid[:16], (current or "none")[:16]))
        return {"result": "switched", "bundle_id": bid, "previous_bundle_id": previous, "release": r.release(bid)}


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


def inventory(d: str) -> dict[str, list[Any]]:
    """path -> [size, sha256] for every regular file under d (links and odd files are left out)."""
    if not os.path.isdir(d):
        return {}
    files, _ = scan_tree(d)
    out: dict[str, list[Any]] = {}
    for rel in files:
        digest, size = hash_file(os.path.join(d, rel))
        out[rel] = [size, digest]
    return out


# --------------------------------------------------------------------------- receive (ship's stream)
#
# ``builder ship`` runs ``receive`` over the host's one ssh connection with the bundle as a stream on
# stdin, so each byte crosses the wire once and is hashed once here, as it arrives, straight into
# the file it ends up in:
#
#   ship -> host   RECEIVE_MAGIC, then "<manifest bytes> <signature bytes>\n", then those bytes
#   host -> ship   one JSON line {"want": [[path, offset], ...]}: the manifest files the host needs,
#                  each from offset (what an earlier, cut receive left), in manifest order
#   ship -> host   for each wanted file, its bytes from offset to its end (the manifest's parts
#                  read one after another), nothing else
#   host -> ship   one JSON line: the install's answer (installed, staged or unchanged)
#
# Nothing is accepted before the signature and the manifest check out. The image archive comes
# first, then the launch files, then the model files. A model file is received into a temp name
# beside its final path and the image archive and launch files into ``incoming/<bundle id>/``; a file
# in parts is written as one file and each part's sha256 is checked at its end. A file whose bytes
# are not the signed ones is removed and named. Once the archive is in and checked, `docker load`
# reads it while the model files arrive (a loaded image changes nothing a host runs: the release
# names it); nothing is placed or switched until every wanted file is in, checked and on disk. A
# big file received whole is fsynced and recorded in ``incoming/<bundle id>/.received.json`` (its
# size, mtime and inode: fast mode's rule), so a ship cut later does not send or hash it again; a
# cut file is resumed from its last byte (its bytes so far are hashed again, the only second read),
# and the small files are fsynced together once all are in. The release folder links the launch
# files received.

RECEIVE_MAGIC = b"builder-receive 1\n"
RECEIPTS = ".received.json"


def _read_exact(inp: Any, n: int, what: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = inp.read(n - len(out))
        if not chunk:
            raise InstallError("%s: the stream ended early (%d of %d bytes)" % (what, len(out), n))
        out += chunk
    return bytes(out)


def read_header(inp: Any) -> tuple[bytes, bytes]:
    """(manifest bytes, signature bytes) from the start of a receive stream."""
    if _read_exact(inp, len(RECEIVE_MAGIC), "receive") != RECEIVE_MAGIC:
        raise InstallError("receive: not a builder receive stream", EXIT_CONFIG)
    line = inp.readline(64)
    try:
        nm, ns = (int(x) for x in line.split())
    except ValueError:
        raise InstallError("receive: malformed header", EXIT_CONFIG) from None
    if not (0 < nm <= MAX_MANIFEST and 0 <= ns <= 64 * 1024):
        raise InstallError("receive: manifest or signature too large", EXIT_CONFIG)
    return _read_exact(inp, nm, MANIFEST), _read_exact(inp, ns, SIGNATURE)


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


def _host_record(r: Root, manifest: dict[str, Any], host: str | None) -> dict[str, Any] | None:
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


def _check_image_source(img: dict[str, Any], have_layers: list[str] | None) -> None:
    """The image is on this host with the manifest's layers, or the bundle says how to get it."""
    if have_layers is None and img["archive"] is None and img.get("pull") is None:
        raise InstallError(
            "image %s is not on this host and the bundle carries no image (bundle it with --with-image)"
            % img["image_id"]
        )
    if have_layers and have_layers != img["diff_ids"]:
        raise InstallError("image %s on this host has DiffIDs other than the manifest's" % img["image_id"])


def _host_key(r: Root, trusted_key: bytes | None, insecure: bool) -> tuple[bytes | None, bool]:
    """(the key to check the signature with, whether it is the first install's new key)."""
    if insecure:
        _say("WARNING: --insecure: the signature is NOT checked")
        return None, False
    if os.path.exists(r.trusted):
        key = _read_limited(r.trusted, 64 * 1024, r.trusted)
        have = _parse_key(key, r.trusted)
        if trusted_key is not None:
            given = _parse_key(trusted_key, "--trusted-key")
            if (given.key_id, given.key) != (have.key_id, have.key):
                raise InstallError(
                    "the given key %s differs from %s (key %s); to rotate keys, remove that "
                    "file first" % (given.key_id_hex, r.trusted, have.key_id_hex),
                    EXIT_CONFIG,
                )
        return key, False
    if trusted_key is not None:
        _parse_key(trusted_key, "--trusted-key")
        return trusted_key, True
    raise InstallError(
        "%s: no trusted key; give the fleet's public key with --trusted-key FILE at the "
        "first install (or --insecure to skip the signature)" % r.trusted,
        EXIT_CONFIG,
    )


class _Incoming:
    """One manifest file the host needs: where it is written, how much of it is already there."""

    def __init__(self, entry: dict[str, Any], dest: str) -> None:
        self.entry = entry
        self.dest = dest
        self.offset = 0
        self.whole = hashlib.sha256()
        self.part = hashlib.sha256()
        self.part_index = 0
        self.in_part = 0
        #: (offset, whole-file hash) at the end of the last part that checked out
        self.mark: tuple[int, Any] = (0, self.whole.copy())
        self.failed = False

    @property
    def path(self) -> str:
        return str(self.entry["path"])

    def pieces(self) -> list[dict[str, Any]]:
        return self.entry.get("parts") or [self.entry]

    def _feed(self, view: memoryview) -> None:
        """Hash the bytes at self.offset on (split at part ends); InstallError on a damaged part
        (and nothing more is hashed after it)."""
        if self.failed:
            return
        pieces = self.pieces()
        parted = len(pieces) > 1
        while view:
            p = pieces[self.part_index]
            take = min(len(view), p["size"] - self.in_part)
            chunk = view[:take]
            (self.part if parted else self.whole).update(chunk)  # one hash per byte
            self.in_part += take
            self.offset += take
            view = view[take:]
            if self.in_part == p["size"] and len(pieces) > 1:
                if self.part.hexdigest() != p["sha256"]:
                    self.failed = True
                    raise InstallError("%s: sha256 mismatch (damaged part)" % p["path"])
                self.mark = (self.offset, self.whole.copy())
                self.part_index = min(self.part_index + 1, len(pieces) - 1)
                self.part, self.in_part = hashlib.sha256(), 0

    def _back_to_mark(self) -> None:
        """Forget what follows the last part that checked out (a damaged part is received again)."""
        self.offset, whole = self.mark
        self.whole = whole.copy()
        self.failed = False
        self.part, self.in_part = hashlib.sha256(), 0
        at, self.part_index = 0, 0
        for i, p in enumerate(self.pieces()):
            if at >= self.offset:
                self.part_index = i
                break
            at += p["size"]

    def resume(self) -> None:
        """Hash what an earlier, cut receive left in dest: the offset to ask for from there."""
        try:
            have = os.stat(self.dest).st_size
        except FileNotFoundError:
            return
        if have > self.entry["size"]:
            os.truncate(self.dest, 0)
            return
        buf = bytearray(READ_SIZE)
        view = memoryview(buf)
        with open(self.dest, "rb", buffering=0) as f:
            try:
                while self.offset < have:
                    n = f.readinto(view[: min(READ_SIZE, have - self.offset)])
                    if not n:
                        break
                    self._feed(view[:n])
            except InstallError:
                self._back_to_mark()
        os.truncate(self.dest, self.offset)

    @property
    def big(self) -> bool:
        """A file whose receipt is worth its fsync: a resume would otherwise hash it all again (a
        smaller one is hashed again in no time, and fsynced with the others once all are in)."""
        return int(self.entry["size"]) >= WRITEBACK_STEP

    def receive(self, inp: Any, on_bytes: Callable[[int], None] | None = None) -> None:
        """Read the rest of the file from inp into dest, hashing as it arrives; check it whole; a
        big file is fsynced (its writeback started as it arrives, see Writeback).

        The hashing runs on a thread of its own, a chunk behind the reads and writes (hashlib
        releases the GIL), so receiving is bounded by the slower of the two, not their sum. Three
        buffers: one is read into while the others wait for their hash."""
        os.makedirs(os.path.dirname(self.dest), exist_ok=True)
        size = self.entry["size"]
        fd = os.open(self.dest, os.O_WRONLY | os.O_CREAT, 0o644)
        hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="receive-sha256")
        bufs = [bytearray(READ_SIZE) for _ in range(3)]
        pending: list[Any] = [None, None, None]
        wb = Writeback(fd, self.offset)
        try:
            os.ftruncate(fd, self.offset)
            os.lseek(fd, self.offset, os.SEEK_SET)
            got, i = self.offset, 0
            try:
                while got < size:
                    if pending[i] is not None:
                        pending[i].result()  # its hash is done (a damaged part raises here)
                    view = memoryview(bufs[i])
                    n = _fill(inp, view[: min(READ_SIZE, size - got)])
                    if not n:
                        raise InstallError(
                            "%s: the stream ended at byte %d of %d (ship again to resume)" % (self.path, got, size)
                        )
                    write_all(fd, view[:n], wb)
                    pending[i] = hasher.submit(self._feed, view[:n])
                    got += n
                    i = (i + 1) % 3
                    if on_bytes is not None:
                        on_bytes(n)
                for f in pending:
                    if f is not None:
                        f.result()
            except InstallError:
                for f in pending:
                    if f is not None:
                        with contextlib.suppress(InstallError):
                            f.result()
                if self.failed:  # a damaged part: keep what checked out, drop the rest
                    self._back_to_mark()
                    os.ftruncate(fd, self.offset)
                raise
            if len(self.pieces()) == 1 and self.whole.hexdigest() != self.entry["sha256"]:
                os.unlink(self.dest)
                raise InstallError(
                    "%s: sha256 mismatch (the bytes received are not the signed ones; removed)" % self.path
                )
            if self.big:
                os.fsync(fd)
        finally:
            hasher.shutdown(wait=True)
            os.close(fd)


def _fill(inp: Any, view: memoryview) -> int:
    """Read into all of view (a pipe gives at most its buffer per read), or until the stream ends:
    one hash and one write per buffer, not per pipe read."""
    n = 0
    while n < len(view):
        k = inp.readinto(view[n:])
        if not k:
            break
        n += k
    return n


#: Linux's F_SETPIPE_SZ: a larger pipe for the stream (fewer, larger reads)
F_SETPIPE_SZ = 1031
PIPE_SIZE = 1 << 20


def widen_pipe(fd: int) -> None:
    """Ask for a 1 MiB pipe buffer where fd is a pipe (Linux; elsewhere, or when refused, nothing)."""
    with contextlib.suppress(OSError, ValueError):
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)


def _receipts(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read(MAX_MANIFEST).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _received_whole(receipts: dict[str, Any], inc: _Incoming) -> bool:
    """Does an earlier receive's receipt still vouch for dest (fast mode's rule)?"""
    try:
        st = os.stat(inc.dest)
    except OSError:
        return False
    e = inc.entry
    return fast_mode_drift(receipts.get(inc.dest), e["sha256"], e["size"], st.st_size, st.st_mtime_ns,
                           st.st_ino) is None


def receive(
    root: str,
    inp: Any,
    out: Any,
    *,
    trusted_key: bytes | None = None,
    insecure: bool = False,
    host: str | None = None,
    reserve: int = DEFAULT_RESERVE,
    lock_timeout: float = 60.0,
    stage: bool = False,
) -> dict[str, Any]:
    """Receive a bundle streamed on inp (see above) and install it; the wanted list goes to out."""
    r = Root(root)
    mbytes, sbytes = read_header(inp)
    with r.locked(lock_timeout):
        r.clean_temps()
        key, new_key = _host_key(r, trusted_key, insecure)
        manifest = check_signed(mbytes, sbytes, key, insecure)
        bid = manifest["bundle_id"]
        old = _host_record(r, manifest, host)
        current = r.link("current")
        img = manifest["image"]
        # the engine's answers (each a docker CLI start and an API call) while the files are checked
        asked = ThreadPoolExecutor(max_workers=2, thread_name_prefix="docker")
        layers_q = asked.submit(image_present, img["image_id"])
        root_q = asked.submit(docker_root) if img["archive"] is not None else None
        asked.shutdown(wait=False)
        vouch = [old, r.read_record(r.staged_record)]
        placing = [m for m in manifest["models"] if model_ok(m, vouch) is not None]
        release_there = os.path.isdir(r.release(bid)) and release_ok(r.release(bid), manifest, mbytes)
        have_layers = layers_q.result()

        def reply(obj: dict[str, Any]) -> None:
            out.write((json.dumps(obj, sort_keys=True) + "\n").encode("utf-8"))
            out.flush()

        ready = have_layers is not None and release_there and not placing
        if stage and ready and r.link("staged") == bid and r.read_record(r.staged_record):
            reply({"want": []})
            _say("bundle %s is already staged; nothing to do" % bid[:16])
            return {"result": "unchanged", "bundle_id": bid, "release": r.release(bid), "received": []}
        if ready and current == bid and old and old.get("bundle_id") == bid:
            reply({"want": []})
            _say("bundle %s is already installed; nothing to do" % bid[:16])
            if stage:
                _mark_staged(r, manifest, mbytes, old.get("previous_bundle_id"))
            return {"result": "unchanged", "bundle_id": bid, "release": r.release(bid), "received": []}
        _check_image_source(img, have_layers)
        files = {f["path"]: f for f in manifest["files"]}
        inc_dir = os.path.join(r.incoming, bid)
        # the image archive first, so that docker load runs while the rest arrives; the model files last
        load = have_layers is None and img["archive"] is not None
        archive = _Incoming(files[img["archive"]], os.path.join(inc_dir, img["archive"])) if load else None
        wanted: list[_Incoming] = [archive] if archive is not None else []
        if not release_there:
            wanted += [_Incoming(fe, os.path.join(inc_dir, fe["path"])) for fe in release_files(manifest)]
        models: list[_Incoming] = []
        for m in placing:
            if m["bundled"] is None:
                raise InstallError(
                    "model file %s: %s (the bundle does not carry it; copy it there or bundle "
                    "with --with-models)" % (m["path"], model_ok(m, vouch))
                )
            d, mine = os.path.dirname(m["path"]), _tmp_stem(m["path"]) + "recv-" + bid[:16]
            with contextlib.suppress(FileNotFoundError):
                for n in os.listdir(d):  # what a receive of another bundle left for this file
                    if n.startswith(_tmp_stem(m["path"])) and n != mine:
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(d, n))
            models.append(_Incoming(files[m["bundled"]], os.path.join(d, mine)))
        wanted += models
        for n in os.listdir(r.incoming) if os.path.isdir(r.incoming) else []:
            if HEX64.match(n) and n != bid:  # another bundle's unfinished receive: its disk back
                shutil.rmtree(os.path.join(r.incoming, n), ignore_errors=True)
        receipts_path = os.path.join(inc_dir, RECEIPTS)
        receipts = _receipts(receipts_path)
        todo = []
        for w in wanted:
            if _received_whole(receipts, w):
                continue
            w.resume()
            todo.append(w)
        needs = [(w.dest, w.entry["size"] - w.offset) for w in todo]
        if load and root_q is not None:
            needs.append((root_q.result() or r.root, 2 * files[img["archive"]]["size"]))
        check_disk(needs, reserve)
        reply({"want": [[w.path, w.offset] for w in todo]})
        got = 0
        loading: Load | None = None
        try:
            if archive is not None and archive not in todo:  # received whole by an earlier, cut ship
                loading = Load(img, archive.entry["size"], archive.dest)
            for w in todo:
                start = w.offset
                w.receive(inp)
                got += w.entry["size"] - start
                if w.big:  # (fsynced: its receipt may vouch for it)
                    st = os.stat(w.dest)
                    receipts[w.dest] = {"size": st.st_size, "sha256": w.entry["sha256"],
                                        "mtime": st.st_mtime_ns, "inode": st.st_ino}
                    atomic_write(receipts_path, json.dumps(receipts, sort_keys=True).encode("utf-8"))
                if w is archive:  # its every byte is in and checked: docker load reads it while the rest arrives
                    loading = Load(img, w.entry["size"], w.dest)
            # every wanted byte is in and checked: the small files on disk, then load, place, stage, switch
            for w in todo:
                if not w.big:
                    fsync_file(w.dest)
        except BaseException:
            if loading is not None:
                with contextlib.suppress(InstallError):
                    loading.finish()
            raise
        if loading is not None:
            loading.finish()
        elif have_layers is None:
            pull_image(manifest)
        for i, m in enumerate(placing):
            w = models[i]  # (zip's strict= is newer than python 3.8)
            _say("placing model file %s" % m["path"])
            os.chmod(w.dest, 0o644)
            os.replace(w.dest, m["path"])
        for d in sorted({os.path.dirname(m["path"]) for m in placing}):
            fsync_dir(d)
        if not release_there:
            stage_release(r, inc_dir, {**manifest, "files": [
                {k: v for k, v in f.items() if k != "parts"} for f in manifest["files"]]}, mbytes, sbytes,
                link=True)
        res = _switch_in(r, manifest, mbytes, stage, current, trusted_key if new_key else None)
        shutil.rmtree(inc_dir, ignore_errors=True)
        res["received"] = [w.path for w in todo]
        res["bytes_received"] = got
        return res


def _switch_in(r: Root, manifest: dict[str, Any], mbytes: bytes, stage: bool, current: str | None,
               new_key: bytes | None) -> dict[str, Any]:
    """The end of an install once the release is staged: the first key, then staged or current."""
    bid = manifest["bundle_id"]
    if new_key is not None:
        atomic_write(r.trusted, new_key, 0o644)
        _say("trusted key set: %s" % r.trusted)
    if stage:
        _mark_staged(r, manifest, mbytes, current)
        _say(
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
    _say(
        "installed bundle %s (host %s, lane %s, rank %d); previous: %s"
        % (bid[:16], manifest["host"], manifest["lane"], manifest["rank"], (previous or "none")[:16])
    )
    return {"result": "installed", "bundle_id": bid, "previous_bundle_id": previous, "release": r.release(bid)}


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="install.py", description="builder's offline bundle installer")
    sub = p.add_subparsers(dest="cmd")
    i = sub.add_parser("install", help="verify and install a bundle folder")
    i.add_argument("bundle")
    i.add_argument("--root", required=True)
    i.add_argument("--trusted-key", help="the fleet's minisign public key file (first install)")
    i.add_argument("--trusted-key-base64", help="the same key as its base64 line")
    i.add_argument("--insecure", action="store_true", help="skip the signature check (explicit only)")
    i.add_argument("--host", help="refuse a bundle made for another host")
    i.add_argument(
        "--remove-source", action="store_true", help="remove the bundle folder (under ROOT/incoming)"
    )
    i.add_argument(
        "--reserve", type=int, default=DEFAULT_RESERVE, help="bytes to keep free (default 256 MiB)"
    )
    i.add_argument("--lock-timeout", type=float, default=60.0)
    i.add_argument("--stage", action="store_true", help="stage only: point staged at it, do not switch")
    sg = sub.add_parser("stage", help="stage a release already under releases/")
    sg.add_argument("--root", required=True)
    sg.add_argument("--release", required=True)
    sg.add_argument("--lock-timeout", type=float, default=60.0)
    sw = sub.add_parser("switch", help="make a release under releases/ current")
    sw.add_argument("--root", required=True)
    sw.add_argument("--to", required=True)
    sw.add_argument("--rollback", action="store_true", help="record the switch as a rollback")
    sw.add_argument("--force", action="store_true", help="write the apply record again (a repair)")
    sw.add_argument("--lock-timeout", type=float, default=60.0)
    rb = sub.add_parser("rollback", help="switch current back to previous")
    rb.add_argument("--root", required=True)
    rb.add_argument("--lock-timeout", type=float, default=60.0)
    st = sub.add_parser("status", help="print the current state as JSON")
    st.add_argument("--root", required=True)
    rc = sub.add_parser("receive", help="receive a bundle streamed on stdin (builder ship) and install it")
    rc.add_argument("--root", required=True)
    rc.add_argument("--trusted-key", help="the fleet's minisign public key file (first install)")
    rc.add_argument("--trusted-key-base64", help="the same key as its base64 line")
    rc.add_argument("--insecure", action="store_true", help="skip the signature check (explicit only)")
    rc.add_argument("--host", help="refuse a bundle made for another host")
    rc.add_argument("--reserve", type=int, default=DEFAULT_RESERVE, help="bytes to keep free (default 256 MiB)")
    rc.add_argument("--lock-timeout", type=float, default=60.0)
    rc.add_argument("--stage", action="store_true", help="stage only: point staged at it, do not switch")
    inv = sub.add_parser("inventory", help="print sizes and sha256 of the files under DIR as JSON")
    inv.add_argument("dir")
    sub.add_parser("assemble", help="print this installer with the verifier embedded")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd in ("install", "receive"):  # (the two take the same checks and limits)
            common = {"trusted_key": _key_bytes(args), "insecure": args.insecure, "host": args.host,
                      "reserve": args.reserve, "lock_timeout": args.lock_timeout, "stage": args.stage}
        if args.cmd == "install":
            res = install(args.bundle, args.root, remove_source=args.remove_source, **common)
        elif args.cmd == "stage":
            res = stage_installed(args.root, args.release, lock_timeout=args.lock_timeout)
        elif args.cmd == "switch":
            res = switch(
                args.root, args.to, rollback=args.rollback, force=args.force, lock_timeout=args.lock_timeout
            )
        elif args.cmd == "rollback":
            res = rollback(args.root, lock_timeout=args.lock_timeout)
        elif args.cmd == "status":
            res = status(args.root)
        elif args.cmd == "receive":
            widen_pipe(0)
            res = receive(args.root, sys.stdin.buffer, sys.stdout.buffer, **common)
        elif args.cmd == "inventory":
            res = inventory(args.dir)
        elif args.cmd == "assemble":
            sys.stdout.buffer.write(assemble())
            return EXIT_OK
        else:
            _parser().print_usage(sys.stderr)
            return EXIT_CONFIG
    except InstallError as e:
        sys.stderr.write("error: %s\n" % e)
        return e.code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except OSError as e:
        sys.stderr.write("error: %s: %s\n" % (getattr(e, "filename", None) or "I/O", e.strerror or e))
        return EXIT_FAILED
    sys.stdout.write(json.dumps(res, sort_keys=True) + "\n")
    sys.stdout.flush()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
