"""The test projects' inputs, made in one place: pins.toml, a fleet's hosts/NAME.toml and a pins.lock.

Pins and fleets are built as data (`pins`, `model`, `image`, `lane`; `fleet`, `host`) and written by one
TOML writer, so a test says what it needs and a change of either format edits this module. `write_lock`
writes a lock as `builder lock` would for a project that resolves nothing. Tests whose subject is the
parser itself (bad keys, fuzzed documents) write their text by hand on purpose.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from builder import __version__
from builder.foundation.canon import atomic_write
from builder.inputs.pins import HfModel, load_pins
from builder.lock.lockfile import (
    Lock,
    LockedImage,
    LockedLane,
    LockedModel,
    LockedModelFile,
    recipe_files,
    render_lock,
    spec_hash,
)

Doc = dict[str, Any]

# --------------------------------------------------------------------------- TOML

_BARE = re.compile(r"[A-Za-z0-9_-]+")


def _key(k: str) -> str:
    return k if _BARE.fullmatch(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a TOML basic string
    if isinstance(v, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, Sequence):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {type(v).__name__}")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, Mapping) for x in v)


def _table(doc: Mapping[str, Any], path: tuple[str, ...], out: list[str]) -> None:
    for k, v in doc.items():
        if not isinstance(v, Mapping) and not _is_table_array(v):
            out.append(f"{_key(k)} = {_value(v)}")
    for k, v in doc.items():
        sub = (*path, _key(k))
        if isinstance(v, Mapping):
            out += ["", f"[{'.'.join(sub)}]"]
            _table(v, sub, out)
        elif _is_table_array(v):
            for item in v:
                out += ["", f"[[{'.'.join(sub)}]]"]
                _table(item, sub, out)


def toml(doc: Mapping[str, Any]) -> str:
    """`doc` as TOML: tables as [headers], lists of tables as [[arrays]], the rest inline. The text
    is read back and compared, so a document this writer cannot say fails here, not in the test."""
    out: list[str] = []
    _table(doc, (), out)
    text = "\n".join(out).lstrip("\n") + "\n"
    if tomllib.loads(text) != json.loads(json.dumps(doc)):
        raise ValueError(f"factory.toml wrote a different document:\n{text}")
    return text


# --------------------------------------------------------------------------- pins


def model(repo: str, revision: str = "main", **keys: Any) -> Doc:
    """A `[models.NAME]` entry."""
    return {"repo": repo, "revision": revision, **keys}


def image(recipe: str | None = None, **keys: Any) -> Doc:
    """An `[images.NAME]` entry (a recipe folder, or `published = ...` in `keys`)."""
    return ({"recipe": recipe} if recipe is not None else {}) | keys


def lane(image: str, models: Sequence[str], *, serve: Mapping[str, Any] | None = None, **keys: Any) -> Doc:
    """A `[lanes.NAME]` entry over an image and models; `serve`: its `[lanes.NAME.serve]` table."""
    out: Doc = {"image": image, "models": list(models), **keys}
    if serve is not None:
        out["serve"] = dict(serve)
    return out


def pins(**sections: Mapping[str, Doc]) -> Doc:
    """A pins document: `format = 1` and each section (`images=`, `models=`, `lanes=`, `bases=`, ...)
    as NAME -> entry."""
    return {"format": 1, **{k: dict(v) for k, v in sections.items()}}


def read_pins(root: Path) -> Doc:
    """root/pins.toml as a document, to change and write back with `write_pins` (a copy of the shipped
    pins, say; its comments are not kept)."""
    return tomllib.loads((root / "pins.toml").read_text())


def edit_pins(root: Path, change: Callable[[Doc], object]) -> Path:
    """root/pins.toml read, changed in place by `change`, written back."""
    doc = read_pins(root)
    change(doc)
    return write_pins(root, doc)


def write_pins(root: Path, doc: Mapping[str, Any]) -> Path:
    """root/pins.toml holding `doc`."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "pins.toml"
    atomic_write(path, toml(doc).encode())
    return path


# --------------------------------------------------------------------------- fleets

#: where a test host's folders are, as an operator prepares them (tests.lib.journeylib.prepare_host)
HOST_PATHS = {"models": "/srv/models", "engram": "/srv/engram", "bundles": "/var/lib/builder"}


def host(name: str, rank: int, *, ssh: str | None = None, role: str | None = None, **keys: Any) -> Doc:
    """One `[[hosts]]` row: `ssh` defaults to the name, `role` to head for rank 0 and worker after;
    `keys`: address, connection, paths, fabric, expect and the rest, as the fleet file has them."""
    return {"name": name, "ssh": name if ssh is None else ssh, "rank": rank,
            "role": role or ("head" if rank == 0 else "worker"), **{k: v for k, v in keys.items() if v is not None}}


def fleet(name: str, lane: str, hosts: Sequence[Mapping[str, Any]], **keys: Any) -> Doc:
    """A fleet document: `[fleet]` (name, lane and `keys`: ssh_config, trusted_key, registry, ...)
    and its hosts."""
    head = {"name": name, "lane": lane, **{k: str(v) if isinstance(v, Path) else v
                                           for k, v in keys.items() if v is not None}}
    return {"fleet": head, "hosts": [dict(h) for h in hosts]}


def write_fleet(root: Path, doc: Mapping[str, Any], file: str | None = None) -> Path:
    """root/hosts/FILE.toml (FILE: the fleet's name unless given) holding `doc`."""
    path = root / "hosts" / f"{file or doc['fleet']['name']}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, toml(doc).encode())
    return path


# --------------------------------------------------------------------------- locks


def lock(**sections: Any) -> Lock:
    """A lock of a project that resolves nothing else: its format, builder and inputs filled in,
    `sections` (`models=`, `images=`, `lanes=`, ...) as NAME -> locked entry, and `builder=` to name another."""
    return Lock(**{"format": 1, "builder": __version__, "inputs_hash": "0" * 64, "inputs": {}, **sections})


def locked_model(pinned: HfModel, files: Sequence[LockedModelFile], *, commit: str = "a" * 40) -> LockedModel:
    """A `[models.NAME]` pin as `builder lock` records it from a local copy at `commit`."""
    return LockedModel(spec_hash=spec_hash(pinned), repo=pinned.repo, revision=pinned.revision, commit=commit,
                       source="local", files=list(files), total_size=sum(f.size for f in files))


def write_lock(
    root: Path,
    *,
    image: str,
    model: str,
    lane: str,
    files: dict[str, bytes],
    platform: str,
    builder: str = __version__,
) -> Path:
    """root/pins.lock for root/pins.toml's image `image` (recipe images/IMAGE), model `model`
    (`files`: path -> bytes, at commit a*40) and lane `lane`, each entry as `builder lock`
    writes it (the pins' spec hashes, the recipe folder's file hashes); returns its path."""
    pinned = load_pins(root / "pins.toml")
    locked = [LockedModelFile(path=p, size=len(b), sha256=hashlib.sha256(b).hexdigest())
              for p, b in sorted(files.items())]
    out = lock(
        builder=builder,
        images={
            image: LockedImage(
                spec_hash=spec_hash(pinned.images[image]),
                recipe=f"images/{image}",
                recipe_files=recipe_files(root, f"images/{image}"),
                platform=platform,
                source_date_epoch=0,
            )
        },
        models={model: locked_model(pinned.models[model], locked)},
        lanes={lane: LockedLane(spec_hash=spec_hash(pinned.lanes[lane]), image=image, models=[model])},
    )
    path = root / "pins.lock"
    atomic_write(path, render_lock(out))
    return path
