"""Model files pulled from the fleet registry: each one the manifest names by its blob (``models[].registry``:
the registry's URL, the repository, the digest, which is the file's sha256) is fetched with GET
/v2/<repository>/blobs/<digest> (a redirect the registry answers with is followed) into a temp name beside
its place, hashed as it arrives, several files at once. A pull cut midway goes on from the bytes it has
(a ``Range`` request; the temp file is kept, so a later install resumes it too); a file whose bytes are
not its digest is removed and refused. Every failure is one line naming the host, the file and the cause.
The caller moves the files into place once everything else checked out."""

# ruff: noqa: UP031
from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import os
import socket
import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from builder.core.atomic import fsync_file, tmp_stem

from .errors import InstallError, say
from .root import check_disk

#: bytes read from the registry at a time
BLOCK = 1024 * 1024
#: pulls of one file in a row that bring no byte further, and the wait before the first (doubled each time)
RETRIES = 4
RETRY_WAIT = 0.5
#: files fetched at once
WORKERS = 4
TIMEOUT = 60.0
AGENT = "builder-installer/1"


def temp_for(m: dict[str, Any]) -> str:
    """Where a model file is fetched to, beside its place (kept across installs: a cut pull resumes)."""
    return os.path.join(os.path.dirname(m["path"]), "%sblob-%s" % (tmp_stem(m["path"]), m["sha256"][:16]))


def from_registry(m: dict[str, Any]) -> bool:
    return m.get("registry") is not None


def check_room(needs: list[tuple[str, int]], pulling: list[dict[str, Any]], reserve: int, host: str) -> None:
    """Room for ``needs`` (path, bytes) and the files to pull, with ``reserve`` kept free (root.check_disk);
    short of it for a file to pull: one line naming the host and the first such file that does not fit."""
    try:
        check_disk(needs + [(temp_for(m), m["size"]) for m in pulling], reserve)
    except InstallError as e:
        for i, m in enumerate(pulling):
            try:
                check_disk(needs + [(temp_for(p), p["size"]) for p in pulling[:i + 1]], reserve)
            except InstallError:
                raise InstallError("host %s: model file %s: %s" % (host, m["path"], e)) from None
        raise


class Pulled:
    """What a pull brought: ``files``, [(temp, final path)]; ``nbytes``, the bytes fetched now (a resumed
    file counts only the rest); ``seconds``, the whole pull, its files fetched at once."""

    def __init__(self) -> None:
        self.files: list[tuple[str, str]] = []
        self.nbytes = 0
        self.seconds = 0.0

    def tally(self) -> dict[str, Any]:
        """The installer's answer's ``pulled``."""
        return {"files": len(self.files), "bytes": self.nbytes, "seconds": round(self.seconds, 3)}


class _Cut(Exception):
    """The link dropped, or the registry could not be reached: worth another try from the bytes held."""


def pull_models(entries: list[dict[str, Any]], ca_file: str | None, host: str) -> Pulled:
    """Fetch each entry's blob to its temp name (temp_for), checked against its sha256; return the
    [(temp, final path)] with the bytes fetched and the time taken. InstallError, one line naming the host and
    the file, on the first failure (the files fetched whole stay, to be placed by the next install
    without a byte sent)."""
    out = Pulled()
    if not entries:
        return out
    ctx = _tls(entries, ca_file, host)

    def one(m: dict[str, Any]) -> tuple[str, str, int]:
        try:
            fetched = _pull_one(m, ctx)
        except InstallError as e:
            raise InstallError("host %s: model file %s: %s" % (host, m["path"], e)) from None
        return temp_for(m), m["path"], fetched

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(WORKERS, len(entries)), thread_name_prefix="blob") as ex:
        futures = [ex.submit(one, m) for m in entries]
        errors: list[InstallError] = []
        for f in futures:
            try:
                tmp, dest, fetched = f.result()
            except InstallError as e:
                errors.append(e)
                continue
            out.files.append((tmp, dest))
            out.nbytes += fetched
    if errors:
        raise errors[0]
    out.seconds = time.monotonic() - start
    if out.nbytes:
        say("pulled %d bytes of %d model files in %.1f s (%.0f MiB/s)"
            % (out.nbytes, len(out.files), out.seconds, out.nbytes / 1048576 / max(out.seconds, 1e-6)))
    return out


def _tls(entries: list[dict[str, Any]], ca_file: str | None, host: str) -> ssl.SSLContext | None:
    if not any(m["registry"]["url"].startswith("https://") for m in entries):
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise InstallError("host %s: registry CA file %s: %s" % (host, ca_file, e)) from None


def _held(tmp: str, size: int) -> tuple[Any, int]:
    """The hash of the bytes a temp file holds and their count (a file longer than the blob is emptied)."""
    h = hashlib.sha256()
    try:
        n = os.path.getsize(tmp)
    except OSError:
        return h, 0
    if n > size:
        os.truncate(tmp, 0)
        return h, 0
    with open(tmp, "rb") as f:
        while True:
            block = f.read(BLOCK)
            if not block:
                break
            h.update(block)
    return h, n


def _pull_one(m: dict[str, Any], ctx: ssl.SSLContext | None) -> int:
    """Fetch one blob to its temp name and check it; returns the bytes fetched now."""
    src = m["registry"]
    size, want = m["size"], m["sha256"]
    tmp = temp_for(m)
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    if size == 0:  # (fetched by no request)
        with open(tmp, "ab"):
            pass
    h, have = _held(tmp, size)
    try:
        h = _fetch(m, ctx, tmp, h, have)
    except InstallError:
        with contextlib.suppress(OSError):  # a temp file with no byte to resume from is not kept
            if os.path.getsize(tmp) == 0:
                os.unlink(tmp)
        raise
    got = h.hexdigest()
    if got != want:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise InstallError("the registry's blob %s is not this file: its bytes hash to sha256:%s (refused)"
                           % (src["digest"], got))
    fsync_file(tmp)
    os.chmod(tmp, 0o644)
    return size - have


def _fetch(m: dict[str, Any], ctx: ssl.SSLContext | None, tmp: str, h: Any, have: int) -> Any:
    """The blob's bytes from ``have`` on into tmp, resumed by Range after each cut that brought some bytes
    further (RETRIES in a row that bring none: InstallError); returns the hash of all of them."""
    src, size = m["registry"], m["size"]
    url = "%s/v2/%s/blobs/%s" % (src["url"], src["repository"], src["digest"])
    tries, last = 0, ""
    while have < size:
        if have:
            say("resuming model file %s at byte %d of %d" % (m["path"], have, size))
        else:
            say("pulling model file %s (%d bytes) from %s" % (m["path"], size, src["url"]))
        before = have
        try:
            h, have = _get(url, tmp, h, have, size, ctx)
        except _Cut as e:
            last = str(e)
        if have >= size:
            break
        tries = 0 if have > before else tries + 1
        if tries >= RETRIES:
            raise InstallError("pulling from %s stopped at byte %d of %d: %s" % (src["url"], have, size, last))
        time.sleep(min(RETRY_WAIT * 2 ** tries, 8.0))
    return h


# radon: one ranged GET, where each status and socket error decides whether the pull resumes, restarts or stops
def _get(url: str, tmp: str, h: Any, have: int, size: int, ctx: ssl.SSLContext | None) -> tuple[Any, int]:
    """One GET of the blob from byte ``have`` on, appended to tmp and hashed: (the hash, the bytes held)."""
    headers = {"User-Agent": AGENT}
    if have:
        headers["Range"] = "bytes=%d-" % have
    req = urllib.request.Request(url, headers=headers)
    try:
        resp = urllib.request.urlopen(req, timeout=TIMEOUT, context=ctx)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # (the range is past what it holds: start again)
            os.truncate(tmp, 0)
            return hashlib.sha256(), 0
        if e.code >= 500 or e.code in (408, 429):
            raise _Cut("HTTP %d" % e.code) from None
        raise InstallError("%s: HTTP %d%s" % (url, e.code, " (the registry holds no such blob)"
                                                if e.code == 404 else "")) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ssl.SSLCertVerificationError):  # (no retry mends a certificate)
            raise InstallError("%s: the registry's TLS certificate failed verification against the bundle's "
                               "CA (fleet.registry_ca): %s" % (url.split("/v2/")[0], reason.verify_message)) from None
        raise _Cut("cannot reach the registry: %s" % reason) from None
    with resp:
        if resp.status == 200 and have:  # the registry sends the whole blob: start again
            os.truncate(tmp, 0)
            h, have = hashlib.sha256(), 0
        elif resp.status == 206 and not (resp.headers.get("Content-Range") or "").startswith("bytes %d-" % have):
            raise InstallError("%s: answered a range other than the one asked: %s"
                               % (url, resp.headers.get("Content-Range")))
        elif resp.status not in (200, 206):
            raise InstallError("%s: HTTP %d" % (url, resp.status))
        try:
            with open(tmp, "ab") as f:
                while True:
                    block = resp.read(BLOCK)
                    if not block:
                        break
                    if have + len(block) > size:
                        raise InstallError("the registry sent more than the file's %d bytes" % size)
                    f.write(block)
                    h.update(block)
                    have += len(block)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise InstallError("no space left on the device of %s" % os.path.dirname(tmp)) from None
            if isinstance(e, (ConnectionError, socket.timeout)) or e.errno is None:
                raise _Cut("the link dropped: %s" % e) from None
            raise InstallError("writing %s: %s" % (tmp, e.strerror or e)) from None
        except http.client.HTTPException as e:
            raise _Cut("the link dropped: %s" % type(e).__name__) from None
    return h, have
