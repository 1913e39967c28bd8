"""`builder gc`: what the current lock (and any kept locks) refers to stays; the rest goes."""

from __future__ import annotations

import os
from pathlib import Path

from builder.errors import BuilderError
from builder.image.plan import make_plan
from builder.inputs.pins import load_pins
from builder.lock.lockfile import Lock, load_lock
from builder.store.content import GcReport, Store


def referenced(lock: Lock, pins_path: Path) -> tuple[set[str], set[str], set[str]]:
    objects: set[str] = set()
    trees: set[str] = set()
    images: set[str] = set()
    for s in lock.sources.values():
        trees.add(s.tree_sha256)
        objects.update(p.sha256 for p in s.patches)
    for t in lock.toolchains.values():
        objects.update(a.sha256 for a in t.platforms.values())
    for f in lock.files.values():
        objects.add(f.sha256)
    for ws in lock.wheels.values():
        objects.update(w.sha256 for w in ws.wheels)
    # Model files, kit files and the runtime copies of plain files hosts get live in the model store
    # (<store>/models, builder.store.modelstore), which gc leaves as it is; a kit from a git source is read
    # from its source's mirror (<store>/git), which gc leaves too.
    try:
        pins = load_pins(pins_path)
        root = pins_path.resolve().parent
        for name in pins.images:
            try:
                images.add(make_plan(pins, lock, name, root).address)
            except BuilderError:
                continue
    except BuilderError:
        pass
    return objects, trees, images


def collect(pins_path: Path, lock_path: Path, store_root: Path, *, dry_run: bool = False,
            verify: bool = False) -> GcReport:
    locks = [lock_path] + [Path(x) for x in os.environ.get("BUILDER_KEEP_LOCKS", "").split(os.pathsep) if x]
    objects: set[str] = set()
    trees: set[str] = set()
    images: set[str] = set()
    for lp in locks:
        o, t, i = referenced(load_lock(lp), pins_path)
        objects |= o
        trees |= t
        images |= i
    return Store(store_root).gc(objects, trees, images, verify=verify, dry_run=dry_run)
