"""The model store: one verified copy of each model file, by sha256, and a view per model and revision.

It holds every file a host gets by the placement rule: model files, and the lane's runtime inputs
(a kit's files, a plain file of ``[files]``), each by its sha256 as a model file is.

    <store>/models/objects/<sha256>                 the bytes, read-only; written only once verified
    <store>/models/views/<model>/<commit>/<path>    hard links to the objects (what bundles and
                                                    launch files read)
    <store>/models/views/<kind>/<name>/<version>/<path>   the same for a kit (version: its MANIFEST's
                                                    sha256) or a plain file (version: its sha256)
    <store>/models/partial/<sha256>.part            a download an older builder left (never taken as
                                                    whole; removed with its object)
    <store>/models/tmp/                             imports being verified before their rename
    <store>/models/stamps/<sha256>.json             size, mtime (ns) and inode of the object when it
                                                    was last hashed in full (what vouches for it)

An object's name is its content's sha256, so a file is stored once whatever models, revisions or
hosts use it. Every object is written (or hard-linked: a local copy, the HF cache's blob
huggingface_hub downloaded) into ``tmp/`` inside the store (one file system), verified against the
lock (size and sha256), then renamed into place under a lock: a reader never sees a half-written
object under a real name.

Bundles take model files from here by hard link (``place``: a reflink where a link is refused, a
copy only across file systems), so a fleet's bundles cost one copy of the weights, not one per host.
An object is trusted without reading it while its stamp vouches for it (the host side's fast-mode
rule, ``fast_mode_drift``: same size, mtime and inode as when it was hashed); a store file written
through a link behind builder's back gets a new mtime and is hashed again before it is used.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from builder.core.fastmode import fast_mode_drift
from builder.errors import BuilderError, VerifyError
from builder.foundation.canon import atomic_write, file_lock, fsync_dir
from builder.foundation.hashing import READ_SIZE, sha256_file, stamp

#: Linux's FICLONE ioctl (a reflink: a new inode sharing the source's extents; btrfs, XFS, bcachefs)
FICLONE = 0x40049409


@dataclass(frozen=True)
class Wanted:
    """One locked file a host gets: which model (or kit, or plain file: ``kind``) and revision it
    belongs to, and what its bytes must be. ``commit`` names the revision: a model's commit, a kit's
    version (builder.lock.lockfile.LockedKit.version), a plain file's sha256."""

    model: str
    commit: str
    path: str
    size: int
    sha256: str
    kind: str = "models"  # "models", "kits" or "files": the pins' section

    @property
    def where(self) -> str:
        return f"{self.kind}.{self.model}: {self.path}"


class ModelStore:
    def __init__(self, store: Path) -> None:
        self.root = Path(store) / "models"

    # ------------------------------------------------------------------ paths

    def object_path(self, sha256: str) -> Path:
        return self.root / "objects" / sha256

    def partial_path(self, sha256: str) -> Path:
        return self.root / "partial" / f"{sha256}.part"

    def view_dir(self, model: str, commit: str, kind: str = "models") -> Path:
        base = self.root / "views" if kind == "models" else self.root / "views" / kind
        return base / model / commit

    def view_path(self, w: Wanted) -> Path:
        return self.view_dir(w.model, w.commit, w.kind) / w.path

    def _ensure(self) -> None:
        for d in ("objects", "partial", "tmp", "views", "stamps"):
            (self.root / d).mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ objects

    def has(self, w: Wanted) -> bool:
        """Whether the object is present with the locked size (its name was earned by a full hash
        when it was written; `verify` hashes again)."""
        try:
            st = self.object_path(w.sha256).stat()
        except FileNotFoundError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size == w.size

    def verify(self, w: Wanted, on_bytes: Callable[[int], None] | None = None) -> str | None:
        """Hash the stored object again: None when its bytes are the locked ones, else why not.
        ``on_bytes``: progress, told each number of bytes just hashed."""
        p = self.object_path(w.sha256)
        if not p.is_file():
            return "not in the store"
        digest, size = sha256_file(p, on_bytes=on_bytes)
        if size != w.size:
            return f"the store holds {size} bytes, the lock says {w.size}"
        if digest != w.sha256:
            return (
                f"the store's copy has sha256 {digest[:16]}, the lock says {w.sha256[:16]} "
                "(changed behind builder's back)"
            )
        self._stamp(w)
        return None

    def remove(self, w: Wanted) -> None:
        with self._locked():
            for p in (self.object_path(w.sha256), self.partial_path(w.sha256), self.stamp_path(w.sha256)):
                p.unlink(missing_ok=True)

    # ------------------------------------------------------------------ stamps

    def stamp_path(self, sha256: str) -> Path:
        return self.root / "stamps" / f"{sha256}.json"

    def _stamp(self, w: Wanted) -> None:
        """Record the object's size, mtime and inode now that its bytes were hashed in full."""
        self._ensure()
        st = stamp(self.object_path(w.sha256))
        atomic_write(self.stamp_path(w.sha256), json.dumps({**st, "sha256": w.sha256}).encode())

    def vouched(self, w: Wanted) -> bool:
        """Whether the object's stamp still vouches for its bytes (nothing is read)."""
        try:
            rec = json.loads(self.stamp_path(w.sha256).read_bytes())
            st = self.object_path(w.sha256).stat()
        except (OSError, ValueError):
            return False
        return fast_mode_drift(rec, w.sha256, w.size, st.st_size, st.st_mtime_ns, st.st_ino) is None

    def checked(self, w: Wanted, on_bytes: Callable[[int], None] | None = None) -> Path:
        """The object's path once its bytes are known to be the locked ones: vouched by its stamp, or
        hashed again now (and stamped; ``on_bytes`` told the bytes as they are hashed). VerifyError
        naming the model and file when they are not."""
        if not self.vouched(w):
            why = self.verify(w, on_bytes)
            if why is not None:
                raise VerifyError(f"{w.where}: {why} (run `builder fetch --verify {w.model}`)")
            self._stamp(w)
        return self.object_path(w.sha256)

    def place(self, w: Wanted, dest: Path) -> str:
        """Put the (checked) object at dest, a new name: a hard link, else a reflink, else a copy
        hashed on the way (only across file systems, or where links are refused). Returns 'linked',
        'reflinked' or 'copied'."""
        src = Path(os.path.realpath(self.checked(w)))  # (an object that is a link: what it names)
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dest)
            return "linked"
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
        with open(src, "rb") as fi, open(dest, "wb") as fo:
            try:
                fcntl.ioctl(fo.fileno(), FICLONE, fi.fileno())
                return "reflinked"
            except OSError:
                pass
            h = hashlib.sha256()
            n = 0
            buf = bytearray(READ_SIZE)
            view = memoryview(buf)
            while k := fi.readinto(buf):
                h.update(view[:k])
                fo.write(view[:k])
                n += k
            fo.flush()
            os.fsync(fo.fileno())
        if (n, h.hexdigest()) != (w.size, w.sha256):
            dest.unlink(missing_ok=True)
            raise VerifyError(f"{w.where}: the store's copy changed while it was copied to {dest}")
        return "copied"

    def commit_object(self, src: Path, w: Wanted, digest: str, size: int) -> Path:
        """Rename a verified file (in tmp/ or partial/) into objects/ and link the view."""
        if size != w.size or digest != w.sha256:
            src.unlink(missing_ok=True)
            raise VerifyError(
                f"{w.where}: expected {w.size} bytes with sha256 {w.sha256[:16]}, got {size} bytes with "
                f"sha256 {digest[:16]}; removed"
            )
        os.chmod(src, 0o444)
        return self._publish(src, w)

    def _publish(self, src: Path, w: Wanted) -> Path:
        """Rename a checked file into objects/ (durably, under the store's lock) and link its view."""
        dest = self.object_path(w.sha256)
        with self._locked():
            os.replace(src, dest)
            fsync_dir(dest.parent)
            self._stamp(w)
        self.link_view(w)
        return dest

    def import_file(self, src: Path, w: Wanted, on_bytes: Callable[[int], None] | None = None,
                    hashed: tuple[str, int] | None = None) -> str:
        """Take a local copy of a locked file (a snapshot folder, an HF cache) into the store: hashed
        (``on_bytes`` told the bytes as they are hashed), then hard-linked where it is on the same file
        system, copied otherwise. Returns 'linked' or 'copied'. VerifyError (nothing stored) when its
        bytes are not the locked ones; BuilderError naming the file when the store cannot be written.

        ``hashed``: (sha256, size) of this very file (this inode), read in full by the caller as it was
        written (a download followed as it lands); it is not read again when it is the locked one. Any
        other answer is not trusted to condemn the file: it is hashed again, and that decides."""
        self._ensure()
        # The file itself, not a symbolic link to it (an HF cache's snapshot is links to its blobs):
        # link(2) does not follow a link, so the store would keep the link instead of the bytes.
        src = Path(os.path.realpath(src))
        if hashed is not None and hashed == (w.sha256, w.size):
            digest, size = hashed
        else:
            digest, size = sha256_file(src, on_bytes=on_bytes)
        if size != w.size or digest != w.sha256:
            raise VerifyError(
                f"{w.where}: {src} has {size} bytes with sha256 {digest[:16]}, the lock says {w.size} bytes "
                f"with sha256 {w.sha256[:16]}"
            )
        tmp = self.root / "tmp" / f"{w.sha256}.{os.getpid()}.{secrets.token_hex(4)}"
        how = "linked"
        try:
            os.link(src, tmp)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise BuilderError(f"{w.where}: cannot link {src} into the store: {e.strerror or e}") from None
            how = "copied"
            try:
                shutil.copyfile(src, tmp)
            except OSError as e:  # (a full disk: nothing half-copied stays)
                tmp.unlink(missing_ok=True)
                raise BuilderError(f"{w.where}: cannot copy {src} into the store ({tmp.parent}): "
                                   f"{e.strerror or e}") from None
            digest, size = sha256_file(tmp)  # the copy is what the store keeps
        try:
            if how == "linked":
                # a hard link shares the source's inode: keep the source's mode, do not chmod it
                self._publish(tmp, w)
            else:
                self.commit_object(tmp, w, digest, size)
        except OSError as e:  # (a full disk while the stamp or the view is written: the object is whole)
            tmp.unlink(missing_ok=True)
            raise BuilderError(f"{w.where}: cannot write into the store ({self.root}): {e.strerror or e}") from None
        return how

    def link_view(self, w: Wanted) -> Path:
        """The view's name for the object (a hard link; replaced atomically when it names another)."""
        view = self.view_path(w)
        obj = self.object_path(w.sha256)
        view.parent.mkdir(parents=True, exist_ok=True)
        try:
            if os.path.samefile(view, obj):
                return view
        except FileNotFoundError:
            pass
        tmp = view.parent / f".{view.name}.{secrets.token_hex(4)}"
        os.link(obj, tmp)
        os.replace(tmp, view)
        return view

    def _locked(self) -> AbstractContextManager[None]:
        self._ensure()
        return file_lock(self.root / ".lock")
