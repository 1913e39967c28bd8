"""`builder lock`: resolve the pins into the lock, one resolver per kind of input.

Sources go to `gitsrc`, models to `hf`, bases to `oci`, plain files to `fetch`, kernel kits to
`kits` (after the sources, whose locked commit a kit from a git tree is read at), wheel sets to
`wheelset` (a hash-pinned requirements file to its wheel files); toolchains are
fixed-output (their pins carry the hashes). Entries whose pin did not change are kept without
network; the lock is written through `lockfile.write_lock` (rendered by a pure function), and only
when every selected input resolved: a lock that fails leaves `pins.lock` (its entries and its hash of
the pins, `inputs_hash`) byte for byte as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder import __version__
from builder.errors import BuilderError, ConfigError, ResolveError
from builder.foundation.canon import address
from builder.foundation.hashing import recipe_files, sha256_file
from builder.inputs.pins import (
    INPUT_KINDS,
    UNKNOWN,
    CudaToolchain,
    Pins,
    WheelToolchain,
    ZigToolchain,
    check_patch_files,
    load_pins,
)
from builder.lock import gitsrc, hf, kits, oci, published, wheelset
from builder.lock import plainfiles as fetch
from builder.lock.lockfile import (
    LOCK_FORMAT,
    Lock,
    LockedArtifact,
    LockedImage,
    LockedLane,
    LockedPatch,
    LockedPublishedImage,
    LockedToolchain,
    load_previous,
    selected_images,
    spec_hash,
    tracked_inputs,
    why_stale,
    write_lock,
)


@dataclass
class ResolveOptions:
    offline: bool = False
    update: set[str] = field(default_factory=set)
    names: list[str] | None = None
    cache: Path | None = None
    #: progress of hashing local model files (models.NAME, its bytes in all, bytes just hashed)
    on_hash: hf.HashProgress | None = None


@dataclass
class ResolveReport:
    lock_path: Path
    written: bool
    resolved: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    moved: list[tuple[str, str, str]] = field(default_factory=list)


def _resolve_one(kind: str, name: str, spec: Any, root: Path, cache: Path, opts: ResolveOptions,
                 previous: Any, pins: Pins, new: dict[str, dict[str, Any]]) -> Any:
    """Call the resolver for one input; resolvers raise BuilderError with a one-line reason.
    ``new``: the entries resolved so far (a kit from a git source reads that source's)."""
    unknown = unknown_fields(spec)
    if unknown:
        raise ResolveError(f"{kind}.{name}: {', '.join(unknown)} UNKNOWN (nobody has published it"
                           + (f": {spec.note}" if getattr(spec, "note", None) else "") + "); pin it once known")
    if kind == "sources":
        locked = gitsrc.resolve(name, spec, root=root, cache=cache / "git", offline=opts.offline,
                                previous=previous, update=name in opts.update)
        patches = []
        for i, p in enumerate(spec.patches):
            path = root / p.file
            if not path.is_file():
                raise ConfigError(f"sources.{name}.patches[{i}].file: no such file: {p.file}")
            patches.append(LockedPatch(file=p.file, sha256=sha256_file(path)[0], reason=p.reason))
        return locked.model_copy(update={"patches": patches, "spec_hash": spec_hash(spec)})
    if kind == "models":
        return hf.resolve(name, spec, root=root, cache=cache / "hf", offline=opts.offline,
                          spec_hash=spec_hash(spec), previous=previous, progress=opts.on_hash)
    if kind == "bases":
        return oci.resolve(name, spec, offline=opts.offline, spec_hash=spec_hash(spec))
    if kind == "files":
        return fetch.resolve_file(name, spec, root=root, offline=opts.offline, spec_hash=spec_hash(spec))
    if kind == "toolchains":
        return lock_toolchain(spec)
    if kind == "wheels":
        return wheelset.resolve(name, spec, root=root, offline=opts.offline, spec_hash=spec_hash(spec))
    if kind == "kits":
        src = new["sources"].get(spec.source) if spec.source else None
        if src is not None and src.spec_hash != spec_hash(pins.sources[spec.source]):
            src = None  # the source's last entry, kept for a pin it no longer matches
        return kits.resolve(name, spec, root=root, cache=cache / "git", offline=opts.offline,
                            spec_hash=spec_hash(spec), source=src,
                            source_spec=pins.sources.get(spec.source) if spec.source else None,
                            progress=opts.on_hash)
    raise AssertionError(kind)


def unknown_fields(spec: Any) -> list[str]:
    """The fields of a pin that say UNKNOWN: a value no public source gives, which the lock names
    instead of guessing."""
    return [k for k, v in spec.model_dump().items()
            if isinstance(v, str) and (v == UNKNOWN or v.endswith("@" + UNKNOWN))]


def lock_toolchain(spec: ZigToolchain | CudaToolchain | WheelToolchain) -> LockedToolchain:
    """Toolchains are fixed-output: the pins carry the hash; the store checks bytes at fetch time."""
    plats: dict[str, LockedArtifact] = {}
    package = None
    if isinstance(spec, ZigToolchain):
        for plat, p in spec.platforms.items():
            plats[plat] = LockedArtifact(url=p.url, filename=p.url.rsplit("/", 1)[-1], sha256=p.sha256,
                                         size=p.size)
    elif isinstance(spec, WheelToolchain):
        package = spec.package
        for plat, w in spec.platforms.items():
            plats[plat] = LockedArtifact(url=w.url, filename=w.filename, sha256=w.sha256)
    return LockedToolchain(spec_hash=spec_hash(spec), kind=spec.kind, version=spec.version, package=package,
                           platforms=plats)


def resolve(pins_path: Path, lock_path: Path, opts: ResolveOptions) -> ResolveReport:
    """Resolve the selected inputs and write the lock atomically (under a file lock).

    Entries whose pin did not change are kept as they are (no network), unless named in
    `--update`. Inputs that fail are reported by name, and then nothing is written: the lock on
    disk would otherwise record the hash of pins it does not match (`inputs_hash`), and `--check`
    would vouch for a lock that never resolved them.
    """
    pins = load_pins(pins_path)
    root = pins_path.resolve().parent
    check_patch_files(pins, root, pins_path)
    _check_update_names(pins, opts, pins_path)
    cache = opts.cache or (root / ".cache" / "builder")
    previous = load_previous(lock_path)
    selected = pins.closure(opts.names) if opts.names else pins.all_inputs()
    report = ResolveReport(lock_path=lock_path, written=False)
    new = _still_pinned(pins, previous)
    for kind in INPUT_KINDS:
        for name in sorted(selected[kind]):
            _lock_input(kind, name, pins, root, cache, opts, previous, new, report)
    images: dict[str, LockedImage | LockedPublishedImage] = dict(_published(pins, previous, opts, report))
    images |= _recipe_images(pins, root, new)
    lanes = {name: LockedLane(spec_hash=spec_hash(lane), image=lane.image, models=list(lane.models))
             for name, lane in pins.lanes.items()}
    inputs = tracked_inputs(pins, root, pins_path)
    lock = Lock(format=LOCK_FORMAT, builder=__version__, inputs_hash=address(inputs), inputs=inputs,
                images=images, lanes=lanes,
                **{k: dict(sorted(new[k].items())) for k in INPUT_KINDS})  # type: ignore[arg-type]
    if not report.failed:
        report.written = write_lock(lock_path, lock)
    return report


def _check_update_names(pins: Pins, opts: ResolveOptions, pins_path: Path) -> None:
    """Every name of `--update` is an input or a published image of the pins."""
    for n in opts.update:
        if pins.kind_of(n) not in INPUT_KINDS and n not in pins.published():
            raise ConfigError(f"--update {n}: no input named {n!r} in {pins_path}")


def _still_pinned(pins: Pins, previous: Lock | None) -> dict[str, dict[str, Any]]:
    """Everything of the previous lock that is still pinned the same way, by kind."""
    new: dict[str, dict[str, Any]] = {k: {} for k in INPUT_KINDS}
    if previous is not None:
        for kind in INPUT_KINDS:
            specs = getattr(pins, kind)
            for name, entry in getattr(previous, kind).items():
                if name in specs and entry.spec_hash == spec_hash(specs[name]):
                    new[kind][name] = entry
    return new


def _lock_input(kind: str, name: str, pins: Pins, root: Path, cache: Path, opts: ResolveOptions,
                previous: Lock | None, new: dict[str, dict[str, Any]], report: ResolveReport) -> None:
    """One selected input: kept, resolved into ``new``, or named in the report's failures."""
    spec = getattr(pins, kind)[name]
    prev = new[kind].get(name)
    prev_any = getattr(previous, kind).get(name) if previous is not None else None
    # judged by the rule --check applies, against the sources this lock will hold
    if prev is not None and name not in opts.update and not why_stale(kind, name, prev, spec, root, new["sources"]):
        report.kept.append(f"{kind}.{name}")
        return
    if kind == "kits" and spec.source and f"sources.{spec.source}" in report.failed:
        report.failed[f"{kind}.{name}"] = f"{kind}.{name}: its source sources.{spec.source} did not resolve"
        return
    try:
        entry = _resolve_one(kind, name, spec, root, cache, opts, prev_any, pins, new)
    except ConfigError:
        raise
    except BuilderError as e:
        report.failed[f"{kind}.{name}"] = str(e)  # (the lock is then not written at all)
        return
    old_id = _identity(kind, prev_any)
    new_id = _identity(kind, entry)
    if prev_any is not None and old_id != new_id:
        report.moved.append((f"{kind}.{name}", old_id, new_id))
    new[kind][name] = entry
    report.resolved.append(f"{kind}.{name}")


def _recipe_images(pins: Pins, root: Path, new: dict[str, dict[str, Any]]) -> dict[str, LockedImage]:
    """The recipes' image entries, each dated by the newest commit of its locked sources."""
    images: dict[str, LockedImage] = {}
    for name, img in pins.recipes().items():
        sde = max([new["sources"][s].commit_time for s in img.sources if s in new["sources"]] or [1])
        images[name] = LockedImage(spec_hash=spec_hash(img), recipe=img.recipe,
                                   recipe_files=recipe_files(root, img.recipe), platform=img.platform,
                                   source_date_epoch=sde)
    return images


def _published(pins: Pins, previous: Lock | None, opts: ResolveOptions,
               report: ResolveReport) -> dict[str, LockedPublishedImage]:
    """The published images' entries: kept while their pin is the same (offline too), else resolved
    through the registry (offline: the engine's copy); a failure keeps the previous entry, as for inputs."""
    wanted = selected_images(pins, opts.names)
    out: dict[str, LockedPublishedImage] = {}
    for name, spec in sorted(pins.published().items()):
        prev = previous.images.get(name) if previous is not None else None
        prev_pub = prev if isinstance(prev, LockedPublishedImage) else None
        same = prev_pub is not None and prev_pub.spec_hash == spec_hash(spec)
        if prev_pub is not None and same and (name not in opts.update or name not in wanted):
            out[name] = prev_pub
            if name in wanted:
                report.kept.append(f"images.{name}")
            continue
        if name in wanted and unknown_fields(spec):
            report.failed[f"images.{name}"] = (f"images.{name}: published digest UNKNOWN"
                                               + (f" ({spec.note})" if spec.note else "") + "; pin it once known")
            continue
        if name not in wanted:
            if prev_pub is not None:
                out[name] = prev_pub  # stale for the new pin (--check says so) until it is locked
            continue
        try:
            entry = published.resolve_published(name, spec, offline=opts.offline, spec_hash=spec_hash(spec))
        except ConfigError:
            raise
        except BuilderError as e:
            report.failed[f"images.{name}"] = str(e)
            if prev_pub is not None:
                out[name] = prev_pub
            continue
        if prev_pub is not None and prev_pub.image_id != entry.image_id:
            report.moved.append((f"images.{name}", prev_pub.image_id, entry.image_id))
        out[name] = entry
        report.resolved.append(f"images.{name}")
    return out


def _identity(kind: str, entry: Any) -> str:
    if entry is None:
        return "-"
    if kind == "sources":
        return str(entry.commit)
    if kind == "models":
        return f"{entry.commit} ({address([f.model_dump() for f in entry.files])[:12]})"
    if kind == "bases":
        return str(entry.index_digest or sorted(entry.platforms.values()))
    if kind == "files":
        return str(entry.sha256)
    if kind == "wheels":
        return wheelset.identity(entry)
    if kind == "kits":
        return f"{entry.manifest.sha256[:12]} ({len(entry.files)} files" + (
            f", {entry.source} at {entry.commit[:12]})" if entry.commit else ")")
    return address(entry.model_dump(mode="json"))[:16]
