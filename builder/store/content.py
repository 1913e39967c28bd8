"""The content-addressed store: every fetched input lives here under its hash.

Layout under the store root (default `.cache/builder` in the project):
  objects/<sha256>        files: patches, wheels, toolchain archives, plain files
  trees/<tree_sha256>/    source trees exported at their locked commit (patches not applied)
  images/<address>.json   what `builder image` built (see imagerecord.py)
  provenance/<address>/   the image's SBOM and provenance statement (provenance.py)
  locks/push-<address>.lock  held while that image is pushed (registry.py)
  git/                    bare mirror caches (gitsrc.py)
  tmp/                    staging: every entry is written here, verified, then os.replace()d
  .lock                   flock held while entries are added or collected

An entry is visible only once complete and verified: a process killed mid-write leaves
at most a folder under tmp/, which the next writer (and `builder gc`) removes. A push spools the image
there too (`tmp/push-<pid>-…/`, holding the flock of its `.live` file while it runs).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from builder.errors import ResolveError, VerifyError
from builder.foundation.canon import file_lock, fsync_dir, pid_alive, sha256_tree
from builder.foundation.hashing import READ_SIZE, sha256_file
from builder.lock import plainfiles as fetch


@dataclass
class GcReport:
    removed: list[str]
    kept: int
    freed_bytes: int


class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects = root / "objects"
        self.trees = root / "trees"
        self.tmp = root / "tmp"

    # ---- plumbing ---------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with file_lock(self.root / ".lock"):
            yield

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A fresh folder inside the store (same filesystem, so rename is atomic)."""
        self.tmp.mkdir(parents=True, exist_ok=True)
        d = Path(tempfile.mkdtemp(prefix=f"stage-{os.getpid()}-", dir=self.tmp))
        try:
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def clean_tmp(self) -> None:
        """Remove staging left by killed writers (call with the store lock held). A folder holding a
        LIVE marker (live_marker) is its writer's while the marker's flock is held, whatever process
        has its pid since; another, while the pid in its name runs."""
        if self.tmp.is_dir():
            for p in self.tmp.iterdir():
                held = _marker_held(p / LIVE)
                if held or (held is None and _owner_alive(p.name)):
                    continue  # a live process is still writing there
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        p.unlink()

    # ---- files ------------------------------------------------------------------------

    def object_path(self, sha256: str) -> Path:
        return self.objects / sha256

    def has(self, sha256: str) -> bool:
        return self.object_path(sha256).is_file()

    def verified(self, sha256: str, what: str) -> Path:
        """The object's path after re-hashing it: the store never hands out bytes it has not checked."""
        p = self.object_path(sha256)
        if not p.is_file():
            raise ResolveError(f"{what}: not in the store (sha256 {sha256[:16]})")
        got, _ = sha256_file(p)
        if got != sha256:
            raise VerifyError(f"{what}: store entry {sha256[:16]} is corrupt (its bytes hash to {got[:16]}); "
                              f"run `builder gc --verify` and fetch again")
        return p

    def put_file(self, src: Path, sha256: str, what: str) -> Path:
        """Copy a file in, verifying it against the expected hash on the way."""
        return self.put_stream(_read_chunks(src), sha256, what)

    def put_stream(self, chunks: Iterable[bytes], sha256: str, what: str) -> Path:
        """Write chunks into staging, check their sha256, then rename into objects/ (under the lock)."""
        dest = self.object_path(sha256)
        if dest.is_file():
            return self.verified(sha256, what)
        with self.locked():
            self.clean_tmp()
            if dest.is_file():  # another writer finished it while we waited for the lock
                return self.verified(sha256, what)
            with self.staging() as st:
                tmp = st / "blob"
                h = hashlib.sha256()
                with open(tmp, "wb") as f:
                    for c in chunks:
                        h.update(c)
                        f.write(c)
                    f.flush()
                    os.fsync(f.fileno())
                got = h.hexdigest()
                if got != sha256:
                    raise VerifyError(f"{what}: bytes do not match the lock (expected sha256 {sha256[:16]}, "
                                      f"got {got[:16]})")
                self.objects.mkdir(parents=True, exist_ok=True)
                os.chmod(tmp, 0o444)
                os.replace(tmp, dest)
                fsync_dir(self.objects)
        return dest

    def fetch_url(self, url: str | None, sha256: str, what: str, *, root: Path, offline: bool,
                  filename: str | None = None) -> Path:
        """A file by url (project path, file:// or http(s)://) from the store, or copied/downloaded
        into it, verified by sha256."""
        if self.has(sha256):
            return self.verified(sha256, what)
        if url is None:
            raise ResolveError(f"{what}: no URL to fetch from")
        if not fetch.is_remote(url):
            local = fetch.local_path(url, root, where=f"{what}.url")
            if not local.is_file():
                raise ResolveError(f"{what}: no such file: {url}")
            return self.put_file(local, sha256, what)
        if offline:
            raise ResolveError(f"{what}: {filename + ' is ' if filename else ''}not in the store "
                               f"and --offline was given")
        with self.staging() as st:
            fetch.download(url, st / "dl", sha256)
            return self.put_file(st / "dl", sha256, what)

    # ---- trees ------------------------------------------------------------------------

    def tree_path(self, tree_sha256: str) -> Path:
        return self.trees / tree_sha256

    def put_tree(self, tree_sha256: str, export: Callable[[Path], None], what: str,
                 hasher: Callable[[Path], str] = sha256_tree) -> Path:
        """Export a tree into staging, check its hash, then rename it into place."""
        dest = self.tree_path(tree_sha256)
        if dest.is_dir():
            return dest
        with self.locked():
            self.clean_tmp()
            if dest.is_dir():
                return dest
            with self.staging() as st:
                work = st / "tree"
                work.mkdir()
                export(work)
                got = hasher(work)
                if got != tree_sha256:
                    raise VerifyError(f"{what}: exported tree does not match the lock (expected "
                                      f"{tree_sha256[:16]}, got {got[:16]})")
                self.trees.mkdir(parents=True, exist_ok=True)
                os.replace(work, dest)
                fsync_dir(self.trees)
        return dest

    def verified_tree(self, tree_sha256: str, what: str, hasher: Callable[[Path], str] = sha256_tree) -> Path:
        dest = self.tree_path(tree_sha256)
        if not dest.is_dir():
            raise ResolveError(f"{what}: tree {tree_sha256[:16]} not in the store")
        got = hasher(dest)
        if got != tree_sha256:
            raise VerifyError(f"{what}: store tree {tree_sha256[:16]} is corrupt (hashes to {got[:16]}); "
                              f"run `builder gc --verify`")
        return dest

    # ---- wheels -----------------------------------------------------------------------

    def fetch_wheel(self, package: str, version: str, filename: str, sha256: str, what: str,
                    wheelhouses: list[Path], offline: bool, pip_cache: Path | None = None) -> Path:
        """A wheel from the store, a local wheelhouse, pip's own cache, or pip (online only), verified
        against the lock's sha256. Found locally, it never touches the network, offline or not."""
        if self.has(sha256):
            return self.verified(sha256, what)
        for wh in wheelhouses:
            cand = wh / filename
            if cand.is_file():
                try:
                    return self.put_file(cand, sha256, what)
                except VerifyError as e:  # (a wheelhouse file of that name with other bytes: name it)
                    raise VerifyError(f"{cand}: {e}") from None
        cached = wheel_in_pip_cache(pip_cache, filename, sha256) if pip_cache is not None else None
        if cached is not None:
            return self.put_file(cached, sha256, what)
        get = pip_download_line(package, version, filename, wheelhouses[-1] if wheelhouses else Path("."))
        if offline:
            looked = ", ".join(map(str, [*wheelhouses, *([pip_cache] if pip_cache is not None else [])]))
            raise ResolveError(f"{what}: {filename} is not in the store, a wheelhouse or pip's cache ({looked}) "
                               f"and --offline was given; put it in the wheelhouse: `{get}`")
        with self.staging() as st:
            plat = _pip_platform(filename)
            cmd = ["python3", "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(st),
                   f"{package}=={version}"]
            if plat:
                cmd[6:6] = ["--platform", plat]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            got = st / filename
            if r.returncode != 0 or not got.is_file():
                said = next((ln for ln in reversed(r.stderr.splitlines()) if ln.strip()), "")
                raise ResolveError(f"{what}: pip could not download {filename}"
                                   f"{f' ({said.strip()})' if said else ''}; with the wheel downloaded "
                                   f"elsewhere, put it in the wheelhouse: `{get}`")
            return self.put_file(got, sha256, what)

    # ---- gc ---------------------------------------------------------------------------

    def gc(self, keep_objects: set[str], keep_trees: set[str], keep_images: set[str],
           verify: bool = False, dry_run: bool = False) -> GcReport:
        """Remove objects, trees and image records not in the keep sets (and, with ``verify``, those whose
        bytes no longer match their name), plus staging left by killed writers. ``dry_run``: only report."""
        report = GcReport(removed=[], kept=0, freed_bytes=0)
        if not self.root.is_dir():
            return report
        with self.locked():
            if not dry_run:
                self.clean_tmp()
            for sweep in self._sweeps(keep_objects, keep_trees, keep_images, verify):
                sweep.run(report, dry_run)
        return report

    def _sweeps(self, keep_objects: set[str], keep_trees: set[str], keep_images: set[str],
                verify: bool) -> list[_Sweep]:
        """Each kind of entry gc collects, in the order it reports them."""
        images = self.root / "images"
        return [
            _Sweep("objects", _listing(self.objects),
                   lambda p: p.name in keep_objects and not (verify and sha256_file(p)[0] != p.name),
                   _file_size, _unlink),
            _Sweep("images", _listing(images), lambda p: p.name.removesuffix(".json") in keep_images,
                   _file_size, _unlink),
            # what is kept beside an image record goes with it: its provenance folder, its push lock
            _Sweep("provenance", _listing(self.root / "provenance"), lambda p: p.name in keep_images,
                   _size, _remove_any),
            # (a lock file frees nothing worth counting; one that a push holds right now stays)
            _Sweep("locks", _listing(self.root / "locks", "push-*.lock"),
                   lambda p: p.name.removeprefix("push-").removesuffix(".lock") in keep_images,
                   lambda p: 0, _unlink_unheld),
            _Sweep("trees", _listing(self.trees),
                   lambda p: p.name in keep_trees and not (verify and sha256_tree(p) != p.name),
                   _size, _remove_tree),
        ]


@dataclass(frozen=True)
class _Sweep:
    """One kind of entry that gc collects: its folder's name in the report, its entries, which of them
    are kept, the bytes one frees, and its removal (False when the entry must stay after all)."""

    folder: str
    entries: list[Path]
    keep: Callable[[Path], bool]
    size: Callable[[Path], int]
    remove: Callable[[Path], bool]

    def run(self, report: GcReport, dry_run: bool) -> None:
        for p in self.entries:
            if self.keep(p):
                report.kept += 1
                continue
            n = self.size(p)
            if not dry_run and not self.remove(p):
                report.kept += 1
                continue
            report.freed_bytes += n
            report.removed.append(f"{self.folder}/{p.name}")


def _listing(folder: Path, pattern: str | None = None) -> list[Path]:
    """A folder's entries (those matching ``pattern``), sorted; none when it is not there."""
    if not folder.is_dir():
        return []
    return sorted(folder.glob(pattern) if pattern else folder.iterdir())


def _file_size(p: Path) -> int:
    return p.stat().st_size


def _unlink(p: Path) -> bool:
    p.unlink()
    return True


def _remove_tree(p: Path) -> bool:
    _rmtree_ro(p)
    return True


def _remove_any(p: Path) -> bool:
    if p.is_dir() and not p.is_symlink():
        _rmtree_ro(p)
    else:
        p.unlink()
    return True


def _size(p: Path) -> int:
    if not p.is_dir() or p.is_symlink():
        return p.lstat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def _unlink_unheld(p: Path) -> bool:
    """Remove a lock file nobody holds (False, leaving it, while a process holds it). It is removed while
    this holds it: a pusher that opened it meanwhile and waits for it finds it gone once it gets it, and
    takes the lock on the file at that name instead (canon.file_lock), so no two pushers ever hold it."""
    try:
        fd = os.open(p, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        p.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)


#: the file in a staging folder whose flock its writer holds while it lives
LIVE = ".live"


@contextlib.contextmanager
def live_marker(folder: Path) -> Iterator[None]:
    """Hold ``folder/LIVE`` locked for the block: Store.clean_tmp (so `builder gc`) leaves the folder
    while it is held, and removes it once its writer is gone, killed or not."""
    with file_lock(folder / LIVE):
        yield


def _marker_held(path: Path) -> bool | None:
    """Whether a process holds ``path``'s flock; None when there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError:
        return True  # (unreadable: not ours to judge)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _owner_alive(name: str) -> bool:
    """Staging names carry their writer's pid (`stage-<pid>-…`, `image-<pid>-…`)."""
    parts = name.split("-")
    if len(parts) < 3 or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return True  # ours: an image context or download being assembled right now
    return pid_alive(pid)


def _rmtree_ro(p: Path) -> None:
    def onerror(func: Callable[..., object], path: str, exc: object) -> None:
        os.chmod(os.path.dirname(path), 0o755)
        with contextlib.suppress(OSError):
            os.chmod(path, 0o755)
        func(path)

    shutil.rmtree(p, onerror=onerror)


def _read_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(READ_SIZE):
            yield chunk


def pip_cache_dir() -> Path:
    """pip's cache folder as pip finds it: $PIP_CACHE_DIR, else $XDG_CACHE_HOME/pip, else ~/.cache/pip."""
    if os.environ.get("PIP_CACHE_DIR"):
        return Path(os.environ["PIP_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pip"


def wheel_in_pip_cache(cache: Path, filename: str, sha256: str) -> Path | None:
    """The wheel's bytes in pip's HTTP cache, if pip downloaded it before (`pip install` of builder
    does, for ziglang): pip 23.3 and later keep each response body whole as `http-v2/.../<key>.body`.
    The key hashes a URL builder does not know, so each body that is a zip holding the wheel's
    `NAME-VERSION.dist-info/WHEEL` is hashed, and the one whose sha256 is the lock's is taken."""
    root = cache / "http-v2"
    parts = filename.split("-")
    if not root.is_dir() or len(parts) < 5:
        return None
    wheel_file = f"{parts[0]}-{parts[1]}.dist-info/WHEEL"
    for body in sorted(root.rglob("*.body")):
        try:
            with zipfile.ZipFile(body) as z:
                z.getinfo(wheel_file)
        except (OSError, KeyError, zipfile.BadZipFile):
            continue
        if sha256_file(body)[0] == sha256:
            return body
    return None


def pip_download_line(package: str, version: str, filename: str, wheelhouse: Path) -> str:
    """The one command that puts the locked wheel into the wheelhouse (pip checks nothing builder does
    not: the store verifies it against the lock when it is taken)."""
    plat = _pip_platform(filename)
    here = platform.machine()
    cross = f" --platform {plat}" if plat and plat != "any" and here and here not in plat else ""
    return (f"python3 -m pip download --no-deps --only-binary=:all:{cross} -d {shlex.quote(str(wheelhouse))} "
            f"{package}=={version}")


def _pip_platform(filename: str) -> str | None:
    # ziglang-0.17.0-py3-none-manylinux_2_17_aarch64.manylinux2014_aarch64.musllinux_1_1_aarch64.whl
    parts = filename[:-4].split("-")
    if len(parts) >= 5:
        return parts[-1].split(".")[0]
    return None
