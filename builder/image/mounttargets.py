"""Mount targets that exist: a mount that ``replaces`` an image path (a patched file bind-mounted over
the engine's own) must find that path in the image. Docker does not say when it is missing: the mount
then adds a new file beside the engine's tree and the engine runs its own code, unpatched.

When an image is built (or a published one taken), `record_paths` stats, in the image itself, each
path its lanes' mounts replace, and the parents of a missing one up to the nearest that exists; the
build record keeps the answers. `check` reads them: `builder launch` shows the result and refuses a
missing target, and the deploy refuses before it stops anything. An image that is not built here (a
GB10 base) has no listing: the check says it could not run, and never that it passed.
"""

from __future__ import annotations

from posixpath import dirname
from typing import Any

from builder.errors import ConfigError
from builder.image.imagerecord import ImageRecord
from builder.inputs.pins import Pins


def lanes_of(pins: Pins, image: str) -> list[str]:
    return sorted(n for n, lane in pins.lanes.items() if lane.image == image)


def replaced(pins: Pins, image: str) -> list[str]:
    """Every image path that a lane of this image replaces by a mount."""
    out: list[str] = []
    for n in lanes_of(pins, image):
        out += [t for t in pins.lanes[n].replaced_targets() if t not in out]
    return out


def record_paths(pins: Pins, rec: ImageRecord) -> ImageRecord:
    """The record with ``paths``: each replaced path's kind in the image, and for a missing one its
    parents up to the nearest that exists."""
    # Imported here for start-up time: builder.foundation.dockerio loads the Docker SDK, which only an image
    # build needs of this module; every command that renders a launch imports it for `check`.
    from builder.foundation import dockerio

    wanted = replaced(pins, rec.name)
    if not wanted:
        return rec
    kinds = dockerio.path_kinds(rec.image_id, wanted)
    todo = [p for p in wanted if kinds[p] == "missing"]
    while todo:
        parents = sorted({dirname(p) for p in todo} - set(kinds))
        kinds |= dockerio.path_kinds(rec.image_id, parents) if parents else {}
        todo = [dirname(p) for p in todo if dirname(p) != p and kinds.get(dirname(p)) == "missing"]
    return rec.model_copy(update={"paths": dict(sorted(kinds.items()))})


def nearest(paths: dict[str, str], target: str) -> str:
    p = dirname(target)
    while p != "/" and paths.get(p, "missing") == "missing":
        p = dirname(p)
    return p


def check(pins: Pins, lane_name: str, rec: ImageRecord | None) -> dict[str, Any]:
    """``{"state": "passed" | "not run" | "none", "why": ...}``; ConfigError naming the mount and the
    nearest existing path when a replaced target is missing from the image."""
    lane = pins.lanes[lane_name]
    targets = lane.replaced_targets()
    if not targets:
        return {"state": "none", "why": "no mount of this lane replaces an image path"}
    if rec is None or any(t not in rec.paths for t in targets):
        return {"state": "not run", "why": f"image {lane.image} is not built here (no listing of its paths): "
                                           f"{len(targets)} replaced mount target(s) unchecked"}
    for where, run in [("", None), *lane.runs()]:
        mounts = lane.mounts if run is None else run.mounts
        for i, m in enumerate(mounts):
            if m.replaces and rec.paths[m.target] == "missing":
                key = f"lanes.{lane_name}.{where + '.' if where else ''}mounts[{i}]"
                raise ConfigError(
                    f"{key}: {m.source} replaces {m.target}, which image {lane.image} ({rec.image_id[:19]}) does "
                    f"not have (nearest existing path: {nearest(rec.paths, m.target)}); the mount would add a "
                    "file, not replace one")
    return {"state": "passed", "why": f"{len(targets)} replaced mount target(s) exist in image {lane.image}"}
