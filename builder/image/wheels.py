"""An image's wheel sets in its build context: every locked wheel at ``wheels/<filename>``, from the store.

Each wheel is taken as a wheel toolchain is (builder.store.content ``Store.fetch_wheel``: the store, a
wheelhouse, pip's cache, or pip online), checked against the lock's sha256 on the way, and linked into
the context from the store (a copy where a link is not possible): a set of several GB costs no second
copy. The recipe installs them with the network off:
``pip install --no-index --no-deps --require-hashes --find-links wheels -r <its requirements file>``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from builder.errors import ConfigError
from builder.lock.wheelset import LockedWheelSet, wheelhouses
from builder.store.content import Store, pip_cache_dir

#: the folder of the build context that holds every wheel of the image's sets
CONTEXT_DIR = "wheels"


def lay_out(sets: dict[str, LockedWheelSet], root: Path, store: Store, dest: Path, *, offline: bool,
            on_log: Callable[[str], None]) -> int:
    """Put every wheel of ``sets`` (name -> lock entry) into ``dest/wheels``; return the bytes laid out."""
    if not sets:
        return 0
    folder = dest / CONTEXT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    houses = wheelhouses(root)
    cache = pip_cache_dir()
    placed: dict[str, str] = {}
    total = 0
    for set_name, entry in sorted(sets.items()):
        for w in entry.wheels:
            what = f"wheels.{set_name}: {w.filename}"
            if placed.get(w.filename, w.sha256) != w.sha256:
                raise ConfigError(f"wheels.{set_name}: {w.filename} is locked with another sha256 by another set")
            if w.filename in placed:
                continue
            blob = store.fetch_wheel(w.name, w.version, w.filename, w.sha256, what, houses, offline, cache)
            target = folder / w.filename
            try:
                os.link(blob, target)
            except OSError:
                shutil.copyfile(blob, target)
            placed[w.filename] = w.sha256
            total += w.size
        on_log(f"wheels.{set_name}: {len(entry.wheels)} wheels in the context ({entry.total_size} bytes)")
    return total
