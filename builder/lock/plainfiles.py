"""Plain files by URL and sha256: lock them (hash the real bytes) and download them verified; URLs shown.

A url is a path inside the project, a ``file://`` URL, or an ``http(s)://`` URL. Local bytes
are always hashed and must match the pin. A remote file is downloaded (streamed into a
temporary file, hashed on the way) and must match too; offline, a remote file is reported as
not reachable: the lock records only what it has seen.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO
from urllib.parse import unquote, urlsplit

from builder.errors import ConfigError, ResolveError, VerifyError
from builder.foundation.canon import fsync_dir, run_folder
from builder.foundation.distribution import network_reason
from builder.foundation.hashing import copy_hashed, sha256_file
from builder.inputs.pins import PlainFile
from builder.lock.lockfile import LockedFile

CHUNK = 1024 * 1024
TIMEOUT = 60.0
USER_AGENT = "builder-fetch/1"


#: a scheme URL: its userinfo (``user:password@``, up to the authority's last ``@``) and its query or
#: fragment (where tokens travel) are what scrub_url drops
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?:[^/\s]*@)?(?P<rest>[^\s?#]*)(?:[?#]\S*)?")


def scrub_url(text: str) -> str:
    """Text with every scheme URL in it stripped of credentials and query string: what may be shown
    (messages, image labels). Paths and scp-like ``user@host:path`` remotes are left as they are."""
    return _URL.sub(lambda m: m["scheme"] + m["rest"], text)


def is_remote(url: str) -> bool:
    return url.startswith(("https://", "http://"))


def local_path(url: str, root: Path | None, *, where: str = "url") -> Path:
    """The file a non-remote url names: ``file:///abs`` or a path inside the project."""
    if url.startswith("file://"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(f"{where}: file:// URL with a host is not supported: {url}")
        return Path(unquote(parts.path))
    if "://" in url:
        raise ConfigError(f"{where}: unsupported URL scheme: {url.split('://', 1)[0]}")
    p = Path(url)
    if p.is_absolute() or ".." in p.parts:
        raise ConfigError(f"{where}: must be a path inside the project, a file:// or an https:// URL: {url}")
    if root is None:
        raise ConfigError(f"{where}: a project-relative path needs the project root: {url}")
    return root / p


def _open(url: str, timeout: float) -> IO[bytes]:
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"})
    resp: IO[bytes] = urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 (scheme checked by callers)
    return resp


def _stream_to(url: str, fd: int, *, root: Path | None, timeout: float) -> tuple[str, int]:
    """Copy url's bytes into fd, returning (sha256, size)."""
    with os.fdopen(fd, "wb", closefd=False) as out:
        src = _open(url, timeout) if is_remote(url) else open(local_path(url, root), "rb")
        with src:
            return copy_hashed(src, out, CHUNK)


def download(url: str, dest: Path, sha256: str, *, root: Path | None = None, size: int | None = None,
             timeout: float = TIMEOUT, mode: int = 0o644) -> int:
    """Stream url into dest atomically, verifying sha256 (and size): dest appears only if it matched.

    Returns the size. Raises ResolveError when the bytes cannot be read and VerifyError on a
    mismatch (the temporary file is removed; an existing dest is left as it was).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        try:
            got, n = _stream_to(url, fd, root=root, timeout=timeout)
        except (OSError, urllib.error.URLError) as e:
            raise ResolveError(f"{url}: cannot download: {network_reason(e)}") from None
        finally:
            os.close(fd)
        if got != sha256:
            raise VerifyError(f"{url}: sha256 mismatch: pinned {sha256}, got {got}")
        if size is not None and n != size:
            raise VerifyError(f"{url}: size mismatch: pinned {size}, got {n}")
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
        return n
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def hash_url(url: str, *, root: Path | None = None, timeout: float = TIMEOUT) -> tuple[str, int]:
    """(sha256, size) of the bytes at url, streaming remote ones through a temporary file."""
    if not is_remote(url):
        return sha256_file(local_path(url, root))
    # (in a folder of this run's: one a killed run left is removed by the next, builder.foundation.canon)
    with run_folder("builder-fetch-") as d:
        fd = os.open(d / "download.part", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            return _stream_to(url, fd, root=root, timeout=timeout)
        finally:
            os.close(fd)


def resolve_file(name: str, spec: PlainFile, *, root: Path, offline: bool, spec_hash: str) -> LockedFile:
    """Lock one plain file: hash its real bytes (local, or downloaded when online) against the pin."""
    where = f"files.{name}"
    if is_remote(spec.url):
        if offline:
            raise ResolveError(f"{where}: not reachable offline ({spec.url})")
        try:
            got, n = hash_url(spec.url, root=root)
        except (OSError, urllib.error.URLError) as e:
            raise ResolveError(f"{where}: cannot download {spec.url}: {network_reason(e)}") from None
    else:
        path = local_path(spec.url, root, where=f"{where}.url")
        if not path.is_file():
            raise ResolveError(f"{where}: no such file: {spec.url}")
        try:
            got, n = sha256_file(path)
        except OSError as e:
            raise ResolveError(f"{where}: cannot read {spec.url}: {network_reason(e)}") from None
    if got != spec.sha256:
        raise ResolveError(f"{where}: sha256 mismatch for {spec.url}: pinned {spec.sha256}, got {got}")
    if spec.size is not None and n != spec.size:
        raise ResolveError(f"{where}: size mismatch for {spec.url}: pinned {spec.size}, got {n}")
    return LockedFile(spec_hash=spec_hash, url=spec.url, sha256=got, size=n, verified=True)


__all__ = ["resolve_file", "download", "hash_url", "local_path", "is_remote", "scrub_url"]
