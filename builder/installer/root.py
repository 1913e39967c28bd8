"""A host's root (its ``paths.bundles``): the links, the releases, the state folder, the install
lock, the temps a killed run left, and the free disk an install needs."""

# ruff: noqa: UP031
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

from builder.core.atomic import fsync_dir, remove_temps, tmp_name

from .errors import InstallError
from .files import human
from .manifest import HEX64, MAX_MANIFEST

DEFAULT_RESERVE = 256 * 1024 * 1024


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
        path = os.path.join(self.root, name)
        tmp = tmp_name(path)
        os.symlink("releases/" + bundle_id, tmp)
        os.replace(tmp, path)
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
        """Remove every temp name a killed run left in the root's own folders (the install lock is held)."""
        for d in (self.root, self.releases, self.state):
            remove_temps(d)

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
