"""Where each locked file of a lane lives on a host of a given rank: the one placement rule.

A lane's model files are placed by role: ``role = "engram"`` under the host's ``paths.engram``, every
other role under ``paths.models``, each model in a folder of its own name, each file at its locked
relative path: ``<root by role>/<model name>/<file>``. A file whose name carries a rank tag
(``r<k>of<n>`` or ``rank<k>of<n>``, any case, after a non-alphanumeric character or at the start)
belongs to rank k of n only: n must equal the lane's ``tensor_parallel`` and k must be below it; a
file without a tag goes to every rank.

The lane's runtime inputs (what its mounts name ``input:NAME``) are placed the same way, on every
rank, in a folder of their own under ``paths.models`` (`input_root`): a kit's MANIFEST and every file
it lists at ``<paths.models>/<kit>/<path>`` (role ``kit``), a plain file of ``[files]`` at
``<paths.models>/<name>/<file_name(url)>`` (role ``file``): the paths `mount_path` gives the mounts.
`place_models` yields them after the models, so what ships, installs and is audited for a model
file is what ships, installs and is audited for them.

The bundle (what it ships and records in the manifest), the installer's apply record (from the
manifest), the audit's expectations and the checks all ask this module; nothing re-derives it. The
host side's own layout under ``paths.bundles`` (releases, links, state) is builder.installer's; the
copy of install.pyz that ship and deploy keep there is named by `kept_installer`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from builder.errors import ConfigError
from builder.foundation.canon import attrs

# Only types from the inputs and the lock at import: each host's audit pytest imports this module for
# `rank_tag`, and the pydantic models behind these names are most of what that process would load.
if TYPE_CHECKING:
    from builder.inputs.hosts import Host, Paths
    from builder.inputs.pins import Pins
    from builder.lock.lockfile import Lock

RANK_TAG_RE = re.compile(r"(?:^|[^a-z0-9])r(?:ank)?(\d{1,3})of(\d{1,3})(?![0-9])", re.IGNORECASE)


def rank_tag(path: str) -> tuple[int, int] | None:
    """(k, n) when a file's name (its last path part) says it belongs to rank k of n, else None."""
    m = RANK_TAG_RE.search(path.rsplit("/", 1)[-1])
    return (int(m.group(1)), int(m.group(2))) if m else None


def model_root(paths: Paths, model_name: str, role: str) -> str:
    """The folder a model's files live in on a host: ``<paths.engram or paths.models>/<model name>``."""
    base = paths.engram if role == "engram" else paths.models
    return f"{base.rstrip('/')}/{model_name}"


@dataclass(frozen=True)
class PlacedFile:
    """One locked file (of a model, a kit or a runtime plain file) as one host holds it."""

    model: str  # the model's, kit's or file's name
    role: str  # the model's role, or "kit" or "file"
    file: str  # the path relative to the model's root (the lock's path)
    path: str  # absolute on the host
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PlacedModel:
    """One lane model (or runtime input) on one host: its root folder, this rank's files, and how many
    the lock lists."""

    name: str
    role: str
    root: str
    files: tuple[PlacedFile, ...]
    locked_files: int
    expect_files: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            **attrs(self, "name", "role", "root", "locked_files", "expect_files"),
            "files": [f.to_json() for f in self.files],
        }


def _safe_rel(path: str, where: str) -> str:
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in path or "\x00" in path:
        raise ConfigError(f"{where}: file path {path!r} escapes its folder")
    return path


def owns(path: str, rank: int, tensor_parallel: int, where: str) -> bool:
    """Whether rank ``rank`` of a ``tensor_parallel`` lane holds this file; ConfigError when its tag
    names another tensor-parallel size or a rank out of range."""
    tag = rank_tag(path)
    if tag is None:
        return True
    k, n = tag
    if n != tensor_parallel:
        raise ConfigError(f"{where}: file {path} is for {n} ranks but the lane has tensor_parallel = {tensor_parallel}")
    if k >= n:
        raise ConfigError(f"{where}: file {path} names rank {k} of {n}")
    return k == rank


def place_models(pins: Pins, lock: Lock, lane_name: str, host: Host) -> list[PlacedModel]:
    """Every model of the lane as this host must hold it (its rank's files only), in the lane's order,
    then every runtime input of the lane (`place_input`). ConfigError when one is not locked, its pin
    changed since the lock, a rank tag is wrong, or two share a folder."""
    lane = pins.lanes[lane_name]
    tp = lane.serve.tensor_parallel
    out: list[PlacedModel] = []
    for name in lane.models:
        spec = pins.models[name]
        lm = _locked("models", name, lock.models.get(name), spec, lane_name)
        root = model_root(host.paths, name, spec.role)
        files = tuple(
            PlacedFile(model=name, role=spec.role, file=f.path, path=f"{root}/{f.path}", size=f.size, sha256=f.sha256)
            for f in sorted(lm.files, key=lambda f: f.path)
            if owns(_safe_rel(f.path, f"lock: models.{name}"), host.rank, tp, f"models.{name}")
        )
        out.append(
            PlacedModel(
                name=name, role=spec.role, root=root, files=files, locked_files=len(lm.files),
                expect_files=spec.expect_files,
            )
        )
    out += [place_input(pins, lock, lane_name, name, host.paths) for name in lane.inputs()]
    roots: dict[str, str] = {}
    for m in out:
        if m.root in roots:
            raise ConfigError(f"lanes.{lane_name}: {roots[m.root]} and {m.name} would share the folder {m.root}; "
                              "rename one")
        roots[m.root] = m.name
    return out


class _Entry(Protocol):
    spec_hash: str


E = TypeVar("E", bound=_Entry)


def _locked(kind: str, name: str, entry: E | None, spec: Any, lane_name: str) -> E:
    """The lock's entry for the pin ``kind.name``; ConfigError when it is missing or the pin changed since."""
    from builder.lock.lockfile import spec_hash  # (here, not at import: see the imports above)

    if entry is None:
        raise ConfigError(f"{kind}.{name}: not in the lock (run `builder lock {lane_name}`)")
    if entry.spec_hash != spec_hash(spec):
        raise ConfigError(f"{kind}.{name}: changed since the lock (run `builder lock {lane_name}`)")
    return entry


def place_input(pins: Pins, lock: Lock, lane_name: str, name: str, paths: Paths) -> PlacedModel:
    """A runtime input of the lane on a host: a kit (its MANIFEST and every file it lists) or a plain
    file, under `input_root`; the same on every rank."""
    root = input_root(paths, name)
    if name in pins.kits:
        kit = pins.kits[name]
        lk = _locked("kits", name, lock.kits.get(name), kit, lane_name)
        files = tuple(
            PlacedFile(model=name, role="kit", file=f.path, path=f"{root}/{_safe_rel(f.path, f'lock: kits.{name}')}",
                       size=f.size, sha256=f.sha256)
            for f in sorted([lk.manifest, *lk.files], key=lambda f: f.path)
        )
        return PlacedModel(name=name, role="kit", root=root, files=files, locked_files=len(lk.files),
                           expect_files=kit.expect_files)
    spec = pins.files[name]
    lf = _locked("files", name, lock.files.get(name), spec, lane_name)
    if lf.size is None:
        raise ConfigError(f"files.{name}: changed since the lock (run `builder lock {lane_name}`)")
    fn = _safe_rel(file_name(spec.url), f"files.{name}.url")
    placed = PlacedFile(model=name, role="file", file=fn, path=f"{root}/{fn}", size=lf.size, sha256=lf.sha256)
    return PlacedModel(name=name, role="file", root=root, files=(placed,), locked_files=1, expect_files=None)


def host_files(pins: Pins, lock: Lock, lane_name: str, host: Host) -> list[PlacedFile]:
    """This host's model files and runtime input files, sorted by absolute path."""
    return sorted((f for m in place_models(pins, lock, lane_name, host) for f in m.files), key=lambda f: f.path)


def input_root(paths: Paths, name: str) -> str:
    """The folder a runtime input (a kit, or a plain file of ``[files]``) lives in on a host:
    ``<paths.models>/<name>``."""
    return f"{paths.models.rstrip('/')}/{name}"


def file_name(url: str) -> str:
    """The name a plain file of ``[files]`` has on a host: the last part of its URL or path."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def kept_installer(bundles: str, sha256: str) -> str:
    """Where ship and deploy keep this machine's install.pyz on a host (``paths.bundles`` is
    ``bundles``): ``<paths.bundles>/incoming/install-<sha256[:16]>.pyz``, by its hash, so a host
    keeps one copy per installer version and never runs one whose bytes differ."""
    return f"{bundles.rstrip('/')}/incoming/install-{sha256[:16]}.pyz"


def derived_root(host: Host, lane_name: str, name: str) -> str:
    """The folder a derivation of the lane fills on this host (its rank's output only)."""
    return f"{host.paths.bundles.rstrip('/')}/derived/{lane_name}/{name}"


def state_root(host: Host, lane_name: str, name: str) -> str:
    """A writable folder of the lane's own on the host (logs, caches), made by start.sh."""
    return f"{host.paths.bundles.rstrip('/')}/lanes/{lane_name}/{name}"


def mount_path(pins: Pins, lane_name: str, host: Host, mount: Any) -> str:
    """Where a lane mount's source (builder.inputs.lanes.Mount) is on this host."""
    kind, name = mount.kind, mount.name
    if kind == "host":
        return str(name)
    if kind == "model":
        return model_root(host.paths, name, pins.models[name].role)
    if kind == "input":
        if name in pins.files:
            return f"{input_root(host.paths, name)}/{file_name(pins.files[name].url)}"
        return input_root(host.paths, name)
    if kind == "derived":
        return derived_root(host, lane_name, name)
    return state_root(host, lane_name, name)
