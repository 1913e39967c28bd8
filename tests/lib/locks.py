"""A pins.lock for a test project without resolving anything: one image recipe, one local model of
the given files and one lane over both, each entry as `builder lock` writes it (spec hashes of the
project's pins, the recipe folder's file hashes). The one place tests write a lock by hand."""

from __future__ import annotations

import hashlib
from pathlib import Path

from builder import __version__
from builder.canon import atomic_write
from builder.lockfile import (
    Lock,
    LockedImage,
    LockedLane,
    LockedModel,
    LockedModelFile,
    recipe_files,
    render_lock,
    spec_hash,
)
from builder.pins import load_pins


def write_lock(
    root: Path,
    *,
    image: str,
    model: str,
    lane: str,
    files: dict[str, bytes],
    repo: str,
    platform: str,
    builder: str = __version__,
) -> Path:
    """Write root/pins.lock for root/pins.toml's image `image` (recipe images/IMAGE), model `model`
    (`files`: path -> bytes, at commit a*40 of `repo`) and lane `lane`; returns its path."""
    pins = load_pins(root / "pins.toml")
    locked = [LockedModelFile(path=p, size=len(b), sha256=hashlib.sha256(b).hexdigest())
              for p, b in sorted(files.items())]
    lock = Lock(
        format=1,
        builder=builder,
        inputs_hash="0" * 64,
        inputs={},
        images={
            image: LockedImage(
                spec_hash=spec_hash(pins.images[image]),
                recipe=f"images/{image}",
                recipe_files=recipe_files(root, f"images/{image}"),
                platform=platform,
                source_date_epoch=0,
            )
        },
        models={
            model: LockedModel(
                spec_hash=spec_hash(pins.models[model]),
                repo=repo,
                revision="main",
                commit="a" * 40,
                source="local",
                files=locked,
                total_size=sum(f.size for f in locked),
            )
        },
        lanes={lane: LockedLane(spec_hash=spec_hash(pins.lanes[lane]), image=image, models=[model])},
    )
    path = root / "pins.lock"
    atomic_write(path, render_lock(lock))
    return path
