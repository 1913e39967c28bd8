"""The model store: one verified copy of each model file, by sha256, and a view per model and revision.

    <store>/models/objects/<sha256>                 the bytes, read-only; written only once verified
    <store>/models/views/<model>/<commit>/<path>    hard links to the objects (what bundles and
                                                    launch files read)
    <store>/models/partial/<sha256>.part            a download in progress (never taken as whole)
    <store>/models/tmp/                             imports being verified before their rename

An object's name is its content's sha256, so a file is stored once whatever models, revisions or
hosts use it. Every object is written into ``tmp/`` or ``partial/`` inside the store (one file
system), verified against the lock (size and sha256), then renamed into place under a lock: a
reader never sees a half-written object under a real name.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from builder.canon import file_lock, fsync_dir
from builder.errors import VerifyError
from builder.hashing import sha256_file


@dataclass(frozen=True)
class Wanted:
    """One locked model file: which model and revision it belongs to, and what its bytes must be."""

    model: str
    commit: str
    path: str
    size: int
    sha256: str

    @property
    def where(self) -> str:
        return f"models.{self.model}: {self.path}"


class ModelStore:
    def __init__(self, store: Path) -> None:
        self.root = Path(store) / "models"

    # ------------------------------------------------------------------ paths

    def object_path(self, sha256: str) -> Path:
        return self.root / "objects" / sha256

    def partial_path(self, sha256: str) -> Path:
        return self.root / "partial" / f"{sha256}.part"

    def view_dir(self, model: str, commit: str) -> Path:
        return self.root / "views" / model / commit

    def view_path(self, w: Wanted) -> Path:
        return self.view_dir(w.model, w.commit) / w.path

    def _ensure(self) -> None:
        for d in ("objects", "partial", "tmp", "views"):
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

    def verify(self, w: Wanted) -> str | None:
        """Hash the stored object again: None when its bytes are the locked ones, else why not."""
        p = self.object_path(w.sha256)
        if not p.is_file():
            return "not in the store"
        digest, size = sha256_file(p)
        if size != w.size:
            return f"the store holds {size} bytes, the lock says {w.size}"
        if digest != w.sha256:
            return (
                f"the store's copy has sha256 {digest[:16]}, the lock says {w.sha256[:16]} "
                "(changed behind builder's back)"
            )
        return None

    def remove(self, w: Wanted) -> None:
        with self._locked():
            for p in (self.object_path(w.sha256), self.partial_path(w.sha256)):
                p.unlink(missing_ok=True)

    def commit_object(self, src: Path, w: Wanted, digest: str, size: int) -> Path:
        """Rename a verified file (in tmp/ or partial/) into objects/ and link the view."""
        if size != w.size or digest != w.sha256:
            src.unlink(missing_ok=True)
            raise VerifyError(
                f"{w.where}: expected {w.size} bytes with sha256 {w.sha256[:16]}, got {size} bytes with "
                f"sha256 {digest[:16]}; removed"
            )
        os.chmod(src, 0o444)
        dest = self.object_path(w.sha256)
        with self._locked():
            os.replace(src, dest)
            fsync_dir(dest.parent)
        self.link_view(w)
        return dest

    def import_file(self, src: Path, w: Wanted) -> str:
        """Take a local copy of a locked file (a snapshot folder, an HF cache) into the store: hashed,
        then hard-linked where it is on the same file system, copied otherwise. Returns 'linked' or
        'copied'. VerifyError (nothing stored) when its bytes are not the locked ones."""
        self._ensure()
        digest, size = sha256_file(src)
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
                raise
            how = "copied"
            shutil.copyfile(src, tmp)
            digest, size = sha256_file(tmp)  # the copy is what the store keeps
        if how == "linked":
            # a hard link shares the source's inode: keep the source's mode, do not chmod it
            dest = self.object_path(w.sha256)
            with self._locked():
                os.replace(tmp, dest)
                fsync_dir(dest.parent)
            self.link_view(w)
        else:
            self.commit_object(tmp, w, digest, size)
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
