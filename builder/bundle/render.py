"""Rendering one host's bundle: its rank's launch files, installer, image archive and model files (and
runtime input files: a kit's, a mounted plain file; builder.store.placement places them as model files),
the manifest (the bundle id is the sha256 of its canonical body) and its signature; then the folder
is moved into place whole."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import __version__
from builder.bundle import hostpkg
from builder.bundle.archive import image_archive
from builder.bundle.keys import signing_key_path
from builder.bundle.parts import WrittenFile, write_bytes, write_stream
from builder.bundle.thin import thin_omitted
from builder.core.atomic import clean_stale_tmp, tmp_name
from builder.errors import ConfigError
from builder.foundation import sign
from builder.foundation.canon import canonical_json, file_lock, fsync_dir, pretty_json, replace_folder
from builder.image import mounttargets as targets
from builder.image import provenance, registry
from builder.image.imagerecord import ImageRecord, require_record
from builder.image.plan import make_plan
from builder.inputs.hosts import (
    Fleet,
    Host,
    check_against_pins,
    hosts_folder,
)
from builder.inputs.pins import Pins, load_pins
from builder.installer.manifest import (
    FORMAT,
    IMAGE_ARCHIVE,
    KIND,
    MANIFEST,
    REGISTRY_CA,
    SIGNATURE,
    check_manifest,
    trusted_comment_for,
)
from builder.launch import render_launch
from builder.lock.lockfile import Lock, load_lock, spec_hash
from builder.store.modelfetch import in_store, wanted_for
from builder.store.modelstore import ModelStore
from builder.store.placement import PlacedFile, host_files

DEFAULT_PART_SIZE = 256 * 1024 * 1024


@dataclass
class BundleOptions:
    out: Path | None = None
    key: Path | None = None
    #: sign with a key found by default outside the project (the home folder's keygen default)
    allow_outside_key: bool = False
    with_image: bool = False
    with_models: bool = False
    part_size: int = DEFAULT_PART_SIZE
    #: --thin --have FILE: the DiffIDs the host holds; the archive leaves out the leading layers it holds
    have: list[str] | None = None
    #: progress: called once per host with its name and the bytes its bundle will take (the model files
    #: it holds, and the image archive it carries: about its layers' bytes); returns the callback each
    #: model file (as the store hashes it, else once placed) and image chunk then advances
    progress: Callable[[str, int], Callable[[int], None]] | None = None


@dataclass
class BundleResult:
    fleet: str
    host: str
    rank: int
    path: Path
    bundle_id: str
    files: int
    size: int
    unchanged: bool
    parts: int = 0
    #: the reference by digest the bundle names for a fleet with a registry (None: no registry, or an archive)
    pull: str | None = None


@dataclass
class BundleInputs:
    """What every bundle of a project is made from: the pins, the lock, the store and the inventories."""

    root: Path
    pins: Pins
    lock: Lock
    store: Path
    hosts_dir: Path


@dataclass
class RankLaunch:
    """What a rank's bundle holds besides the bulk bytes: the manifest's identity keys (builder, fleet,
    host, lane, rank, role, world size, lock hash, paths), the image by ImageID, the model files this
    rank holds (builder.store.placement) and its rendered launch files (path -> (bytes, mode))."""

    identity: dict[str, Any]
    record: ImageRecord
    image: dict[str, Any]
    models: list[dict[str, Any]]
    files: dict[str, tuple[bytes, str]]
    #: the placed files behind ``models``, by absolute path (which model, kit or plain file each is)
    placed: dict[str, PlacedFile] | None = None


def parse_size(text: str) -> int:
    """'256MiB', '256M', '1G', '4k', '1048576' -> bytes (binary units). ConfigError when malformed."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text or "")
    if not m:
        raise ConfigError(f"--part-size: not a size: {text!r} (e.g. 256MiB, 1G, 65536)")
    n = int(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper())
    if n < 1:
        raise ConfigError("--part-size: must be at least 1 byte")
    return n


def load_bundle_inputs(pins_path: Path, lock_path: Path, store: Path, hosts_dir: Path | None = None) -> BundleInputs:
    """The project's inputs; `hosts_dir`: the inventory folder (default: hosts/ under the project root)."""
    root = pins_path.resolve().parent
    return BundleInputs(
        root=root, pins=load_pins(pins_path), lock=load_lock(lock_path), store=store,
        hosts_dir=hosts_folder(root, hosts_dir),
    )


# --------------------------------------------------------------------------- what a rank holds


def _entry(f: PlacedFile) -> dict[str, Any]:
    """A model file or runtime input's file of the rank (builder.store.placement) as the bundle lists it:
    {model, file, path (absolute on the host), size, sha256}."""
    return {"model": f.model, "file": f.file, "path": f.path, "size": f.size, "sha256": f.sha256}


def lane_record(ctx: BundleInputs, lane_name: str) -> ImageRecord:
    """The record of the lane's image, built for the current lock (ConfigError naming the image otherwise)."""
    lane = ctx.pins.lanes[lane_name]
    plan = make_plan(ctx.pins, ctx.lock, lane.image, ctx.root)
    return require_record(ctx.store, lane.image, plan.address)


def rank_launch(ctx: BundleInputs, fleet: Fleet, host: Host, lane_name: str) -> RankLaunch:
    """The image record (the image must be built for the current lock), the rank's model files and
    its launch files, rendered (a pure function of the lock, the inventory and the record)."""
    rec = lane_record(ctx, lane_name)
    targets.check(ctx.pins, lane_name, rec)  # a mount over a path the image lacks: refused, bundle and deploy
    placed = host_files(ctx.pins, ctx.lock, lane_name, host)
    models = [_entry(f) for f in placed]
    image = {
        "name": ctx.pins.lanes[lane_name].image,
        "input_address": rec.input_address,
        "image_id": rec.image_id,
        "diff_ids": list(rec.diff_ids),
    }
    files = render_launch(
        ctx.pins, fleet, host, lane_name, image,
        [{"model": m["model"], "path": m["path"], "size": m["size"], "sha256": m["sha256"]} for m in models],
        lock=ctx.lock,
    )
    identity = {
        "builder": __version__,
        "fleet": fleet.fleet.name,
        "host": host.name,
        "lane": lane_name,
        "rank": host.rank,
        "role": host.role,
        "world_size": len(fleet.hosts),
        "lock_hash": ctx.lock.lock_hash(),
        "paths": {"bundles": host.paths.bundles, "models": host.paths.models, "engram": host.paths.engram},
    }
    return RankLaunch(identity=identity, record=rec, image=image, models=models, files=files,
                      placed={f.path: f for f in placed})


def rank_files(launch: RankLaunch) -> dict[str, tuple[bytes, str]]:
    """The files every bundle of the rank holds, whatever its options (path -> (bytes, mode)): its launch
    files and the installer."""
    return {**launch.files, hostpkg.NAME: (hostpkg.zipapp(), "0755")}


def launch_manifest(launch: RankLaunch) -> dict[str, Any]:
    """What the rank's launch decides of its bundle's manifest, whatever the options and the signing key:
    the identity keys, the image (by ImageID), the model files the rank holds and the entries of
    rank_files (``files``: path -> entry). render_bundle writes each manifest from these same pieces and
    refuses one that does not hold them all (launch_differs), so a deploy can tell whether a bundle is
    what the lock and inventory give now without making it again."""
    return {
        **launch.identity,
        "image": launch.image,
        "models": launch.models,
        "files": {rel: WrittenFile(rel, len(data), hashlib.sha256(data).hexdigest(), mode).entry()
                  for rel, (data, mode) in rank_files(launch).items()},
    }


def launch_differs(manifest: dict[str, Any], want: dict[str, Any]) -> tuple[str, ...] | None:
    """Where a manifest does not hold what its launch decides (``want``: launch_manifest), as keys: a
    top-level key and, under a mapping, the key in it (``("image", "image_id")``, ``("files",
    "start.sh")``, ``("models",)``); None when it holds all of it. A manifest may add to it (the image
    archive or pull reference, a file's parts, where each model file comes from, the files of the
    archive, the provenance and the model files); a list (the model files) must match entry for entry."""
    have = {**manifest, "files": {f["path"]: f for f in manifest.get("files", [])}}
    for key, value in want.items():
        if isinstance(value, dict):
            inner = have.get(key)
            for k, v in value.items():
                if not isinstance(inner, dict) or not _holds(inner.get(k), v):
                    return (key, k)
        elif not _holds(have.get(key), value):
            return (key,)
    return None


def _holds(have: Any, want: Any) -> bool:
    """``have`` is ``want``, or adds keys to it (at any depth), or is a list of such, entry for entry."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(_holds(have.get(k), v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(map(_holds, have, want))
    return bool(have == want)


# --------------------------------------------------------------------------- rendering a bundle


def check_lane(ctx: BundleInputs, fleet_path: Path, fleet: Fleet) -> str:
    """The fleet's lane, once it is in the pins and the lock, locked as pinned, with one rank per host."""
    check_against_pins(fleet_path, fleet, set(ctx.pins.lanes), set(ctx.lock.lanes))
    name = fleet.fleet.lane
    lane = ctx.pins.lanes[name]
    if ctx.lock.lanes[name].spec_hash != spec_hash(lane):
        raise ConfigError(f"lanes.{name}: changed since the lock (run `builder lock {name}`)")
    if lane.serve.tensor_parallel != len(fleet.hosts):
        raise ConfigError(
            f"{fleet_path}: fleet {fleet.fleet.name} has {len(fleet.hosts)} hosts but lane {name} "
            f"has tensor_parallel = {lane.serve.tensor_parallel}"
        )
    return name


def render_bundle(
    ctx: BundleInputs, fleet_path: Path, fleet: Fleet, host: Host, out: Path, opts: BundleOptions
) -> BundleResult:
    """Write host's bundle into a temporary folder beside ``out``, sign it, fsync it, then put it at
    ``out`` whole (an old bundle there is replaced only once the new one is complete). Files only: a
    fleet with a registry gets the image by the digest its record names, and nothing is sent to the
    registry here (builder.bundle.make pushes it, after)."""
    if opts.part_size < 1:
        raise ConfigError("--part-size: must be at least 1 byte")
    lane_name = check_lane(ctx, fleet_path, fleet)
    launch = rank_launch(ctx, fleet, host, lane_name)
    rec = launch.record
    # fail early (exit 2), before any write
    secret = sign.load_secret_key(signing_key_path(opts.key, ctx.root, allow_outside=opts.allow_outside_key))
    pull = _pull_reference(fleet_path, fleet, rec, opts)
    on_bytes = _progress_for(fleet, host, launch, opts)
    omitted = thin_omitted(rec.diff_ids, opts.have) if opts.have is not None else 0
    archive = IMAGE_ARCHIVE if opts.with_image and pull is None else None
    source = models_source(fleet_path, fleet) if opts.with_models else None
    with _staging(out) as tmp:
        written = [write_bytes(data, rel, tmp, opts.part_size, mode)
                   for rel, (data, mode) in sorted(rank_files(launch).items())]
        for rel, data in provenance.bundle_files(ctx.store, rec, secret).items():
            written.append(write_bytes(data, rel, tmp, opts.part_size, "0644"))
        if archive is not None:
            written.append(_write_image_archive(rec, omitted, tmp, opts.part_size, on_bytes))
        if source is not None and source["ca"] is not None:
            written.append(write_bytes(Path(source["ca_file"]).read_bytes(), REGISTRY_CA, tmp, opts.part_size,
                                       "0644"))
        model_entries, linked = _bundle_models(ctx, launch, tmp, opts.with_models, written, on_bytes, source)
        body: dict[str, Any] = {
            "format": FORMAT,
            "kind": KIND,
            **launch.identity,
            "image": {**launch.image, "archive": archive, **({"pull": pull} if pull else {}),
                      **({"omitted_layers": omitted} if omitted and archive else {})},
            "files": sorted((w.entry() for w in written), key=lambda e: e["path"]),
            "models": model_entries,
        }
        where = launch_differs(body, launch_manifest(launch))
        if where is not None:  # a fault in builder: a deploy would take every such bundle for stale
            raise RuntimeError(f"bundle of {host.name}: its manifest does not hold its launch's {'.'.join(where)}")
        bid, mbytes = _write_manifest(tmp, body, secret)
        _fsync_tree(tmp, linked)
        unchanged = False
        with contextlib.suppress(OSError):
            unchanged = (out / MANIFEST).read_bytes() == mbytes
        replace_folder(tmp, out)
    return BundleResult(
        fleet=fleet.fleet.name,
        host=host.name,
        rank=host.rank,
        path=out,
        bundle_id=bid,
        files=len(written),
        size=sum(w.size for w in written),
        unchanged=unchanged,
        parts=sum(len(w.parts) for w in written),
        pull=pull,
    )


def models_source(fleet_path: Path, fleet: Fleet) -> dict[str, Any] | None:
    """Where the hosts of a fleet with ``models_from = "registry"`` pull model files from: the URL
    (``fleet.registry_pull``, else the registry's), the repository of model files, and the CA file
    (``ca``: its name in the bundle, ``ca_file``: the operator's copy); None for a fleet whose bundles
    carry them. ConfigError naming the file and key for a bad URL or a missing CA file."""
    if fleet.fleet.models_from != "registry":
        return None
    target = registry.fleet_target(fleet_path, fleet)
    if target is None:  # (the fleet file's schema requires fleet.registry)
        raise ConfigError(f"{fleet_path}: fleet.models_from: \"registry\" needs fleet.registry")
    return {"url": (fleet.fleet.registry_pull or target.url).rstrip("/"), "repository": registry.MODEL_REPOSITORY,
            "ca": REGISTRY_CA if target.ca_file else None, "ca_file": target.ca_file}


def _pull_reference(fleet_path: Path, fleet: Fleet, rec: ImageRecord, opts: BundleOptions) -> str | None:
    """The reference by digest a fleet with a registry pulls the image by (with --with-image: the one the
    push after rendering makes; without: the one an earlier push recorded, if any)."""
    pull = registry.fleet_pull_reference(fleet_path, fleet, rec, pushing=opts.with_image)
    if pull is None and opts.with_image and fleet.fleet.registry is not None:
        raise ConfigError(f"images.{rec.name}: its record names no manifest (a record of an older build): "
                          f"push it first (`builder push {rec.name}`)")
    return pull


def _progress_for(fleet: Fleet, host: Host, launch: RankLaunch, opts: BundleOptions) -> Callable[[int], None] | None:
    """The callback the bundle's bulk bytes advance: the model files it holds and the image archive it
    carries (its layers' and config's bytes); None without opts.progress."""
    if opts.progress is None:
        return None
    rec = launch.record
    carried = opts.with_models and fleet.fleet.models_from == "bundle"
    work = sum(m["size"] for m in launch.models) if carried else 0
    if opts.with_image and fleet.fleet.registry is None:
        omit = thin_omitted(rec.diff_ids, opts.have) if opts.have is not None else 0
        work += sum(rec.layer_sizes[omit:]) + (rec.config_size or 0)
    return opts.progress(f"{fleet.fleet.name}/{host.name}", work)


@contextlib.contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A fresh temporary folder beside ``out``, under the lock on ``out`` (stale ones of a killed run
    removed first); removed again when the body fails."""
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    with file_lock(parent / f".{out.name}.lock"):
        clean_stale_tmp(out)
        tmp = Path(tmp_name(out))
        tmp.mkdir(mode=0o755)
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _write_image_archive(rec: ImageRecord, omitted: int, tmp: Path, part_size: int,
                         on_bytes: Callable[[int], None] | None) -> WrittenFile:
    """The image as a `docker load` archive (less its first ``omitted`` layers: a thin bundle), in parts."""
    work = tmp.parent / f"{tmp.name}-work"
    try:
        with image_archive(
            rec.image_id, work, tag=rec.tag, mtime=rec.source_date_epoch, omit=frozenset(rec.diff_ids[:omitted]),
        ) as stream:
            return write_stream(stream, IMAGE_ARCHIVE, tmp, part_size, "0644", on_bytes=on_bytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _bundle_models(
    ctx: BundleInputs, launch: RankLaunch, tmp: Path, with_models: bool, written: list[WrittenFile],
    on_bytes: Callable[[int], None] | None, source: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], set[str]]:
    """The manifest's model entries, each with where the bundle holds it (``bundled``, with_models) else
    None; with_models, every file placed under models/ and appended to ``written``. Returns the entries
    and the bundle paths linked from the store (the store's files: already on disk). With ``source``
    (a fleet whose hosts pull model files from its registry) no file is placed: each entry names its
    blob there (``registry``: the URL, repository, digest and the bundle's CA file)."""
    entries: list[dict[str, Any]] = []
    linked: set[str] = set()
    store = ModelStore(ctx.store)
    placed_files = launch.placed or {}
    for m in launch.models:
        bundled = None
        if source is not None:
            entries.append({**m, "bundled": None, "registry": {
                "url": source["url"], "repository": source["repository"], "digest": "sha256:" + m["sha256"],
                "ca": source["ca"]}})
            continue
        if with_models:
            # The store's object, linked whole (never in parts: a part would be a second copy
            # of the bytes); ship resumes a model file by offset instead.
            wanted = wanted_for(ctx.lock, placed_files[m["path"]])
            hashed = [0]

            def step(n: int, hashed: list[int] = hashed) -> None:  # the store hashing it
                hashed[0] += n
                if on_bytes is not None:
                    on_bytes(n)

            in_store(ctx.pins, ctx.root, store, wanted, ctx.lock, step)
            bundled = f"models/{m['model']}/{m['file']}"
            if store.place(wanted, tmp / bundled) == "linked":
                linked.add(bundled)
            if on_bytes is not None and hashed[0] < m["size"]:  # linked as it was vouched for
                on_bytes(m["size"] - hashed[0])
            written.append(WrittenFile(bundled, m["size"], m["sha256"], "0644"))
        entries.append({**m, "bundled": bundled})
    return entries, linked


def _write_manifest(tmp: Path, body: dict[str, Any], secret: sign.SecretKey) -> tuple[str, bytes]:
    """manifest.json (the body and its bundle id) and its signature; returns (bundle id, manifest bytes)."""
    bid = hashlib.sha256(canonical_json(body)).hexdigest()
    manifest = {**body, "bundle_id": bid}
    check_manifest(manifest)  # the installer must accept what we write
    mbytes = pretty_json(manifest)
    (tmp / MANIFEST).write_bytes(mbytes)
    os.chmod(tmp / MANIFEST, 0o644)
    sig = sign.sign(mbytes, secret, trusted_comment_for(manifest))
    (tmp / SIGNATURE).write_text(sig, encoding="utf-8")
    os.chmod(tmp / SIGNATURE, 0o644)
    return bid, mbytes


def _fsync_tree(tmp: Path, linked: set[str]) -> None:
    """Durability before the rename: every file (write_stream already fsynced the data it wrote, so
    this is cheap for those; it catches the manifest, the signature and the modes set after), then
    every folder, deepest first, so each entry is on disk. A file linked from the store (``linked``:
    paths in the bundle) is the store's, already on disk (and its mode is the store's)."""
    for dirpath, _dirs, files in sorted(os.walk(tmp), key=lambda t: -len(t[0])):
        os.chmod(dirpath, 0o755)
        for fn in files:
            full = os.path.join(dirpath, fn)
            if os.path.relpath(full, tmp) in linked:
                continue
            with open(full, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(dirpath)
