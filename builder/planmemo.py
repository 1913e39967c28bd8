"""An image's input address remembered beside the exact bytes it was computed from.

`builder push` needs one thing from the plan: the input address the current lock gives the image, to
find its record. The plan reads the pins, the lock, the patches of the image's sources and the files
of its recipe folder, and nothing else; it is a pure function of those bytes (and of builder's
version). So a full plan, once it has passed (lock current, recipe unchanged), is remembered with
the sha256 of every file it read and the recipe folder's listing; while every one of them is the same,
the address is the same, and it is taken without loading the pins' and the lock's models. Any change
(an edit, a new file in the recipe folder, another lock, another builder) misses, and the full plan
runs again. The memo holds digests only: it vouches for nothing that is not re-hashed each time.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from builder import ASSEMBLY_FORMAT, __version__
from builder.canon import atomic_write, canonical_json
from builder.errors import ConfigError
from builder.hashing import recipe_files, sha256_file

FORMAT = 1


def _path(store: Path, pins_path: Path, lock_path: Path, name: str) -> Path:
    key = "\0".join([str(pins_path.resolve()), str(lock_path.resolve()), name])
    return store / "plans" / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def state(pins_path: Path, lock_path: Path, recipe: str | None, patches: list[str]) -> dict[str, Any]:
    """The digests of everything the plan of one image reads (``recipe``: its recipe folder, None for a
    published image; ``patches``: the patch files of its sources)."""
    root = pins_path.resolve().parent
    return {
        "format": FORMAT,
        "builder": __version__,
        "assembly_format": ASSEMBLY_FORMAT,
        "pins": sha256_file(pins_path)[0],
        "lock": sha256_file(lock_path)[0],
        "patches": {p: sha256_file(root / p)[0] for p in patches},
        "recipe": recipe,
        "recipe_files": recipe_files(root, recipe) if recipe is not None else {},
    }


def remember(store: Path, pins_path: Path, lock_path: Path, name: str, address: str, seen: dict[str, Any]) -> None:
    """``name``'s address, planned in full while the files were as ``seen`` (a :func:`state`)."""
    atomic_write(_path(store, pins_path, lock_path, name), canonical_json({**seen, "address": address}))


def recall(store: Path, pins_path: Path, lock_path: Path, name: str) -> str | None:
    """The remembered address of ``name`` when every file the plan read is byte for byte what it was;
    None otherwise (then the full plan decides)."""
    path = _path(store, pins_path, lock_path, name)
    try:
        memo = json.loads(path.read_bytes())
        address = memo.pop("address")
        recipe, patches = memo.get("recipe"), list(memo.get("patches") or {})
        if not isinstance(address, str) or not (recipe is None or isinstance(recipe, str)):
            return None
        now = state(pins_path, lock_path, recipe, patches)
    except (OSError, ValueError, KeyError, AttributeError, ConfigError):
        return None  # no memo, a damaged one, or a file gone: the full plan says why
    return address if now == memo else None
