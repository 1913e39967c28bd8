"""`builder image NAME`: the locked closure built into a content-addressed, reproducible image.

Steps: plan (closure + input address) -> up-to-date check (the tag exists with matching
labels: done, instantly) -> context assembled from the store (every input verified against
the lock; patches applied in order after a dry-run check) -> build through the Docker SDK
with the network off -> layers normalised (sorted entries, mtimes clamped to
SOURCE_DATE_EPOCH, uid/gid 0, uncompressed) and loaded -> tagged with the input address,
labelled with its inputs -> record (ImageID, DiffIDs) written beside the address.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import ASSEMBLY_FORMAT, __version__
from builder.errors import BuilderError, ConfigError, VerifyError
from builder.foundation import dockerbuild, dockerio
from builder.image import layers, provenance, wheels
from builder.image import mounttargets as targets
from builder.image.imagerecord import ImageRecord, read_record, tag_for, write_record
from builder.image.plan import Plan, load_inputs, make_plan
from builder.inputs.pins import ImageRecipe, Pins
from builder.lock import gitsrc
from builder.lock.lockfile import Lock
from builder.lock.plainfiles import scrub_url
from builder.store.content import Store, pip_cache_dir

LABEL_PREFIX = "io.builder."


@dataclass
class ImageResult:
    record: ImageRecord
    built: bool  # False when it was already up to date
    reproducible: bool | None = None  # set by --check-reproducible


def labels_for(p: Plan, lock: Lock, pins: Pins) -> dict[str, str]:
    img = _recipe(pins, p.name)
    c = p.closure
    out = {
        "org.opencontainers.image.title": p.name,
        "org.opencontainers.image.created": layers.rfc3339(p.source_date_epoch),
        LABEL_PREFIX + "input-address": p.address,
        LABEL_PREFIX + "lock-hash": p.lock_hash,
        LABEL_PREFIX + "assembly-format": str(ASSEMBLY_FORMAT),
        LABEL_PREFIX + "platform": p.platform,
        LABEL_PREFIX + "builder-version": __version__,
    }
    if img.sources:
        first = img.sources[0]
        s = c["sources"][first]
        out["org.opencontainers.image.revision"] = s["commit"]
        out["org.opencontainers.image.source"] = scrub_url(s["url"])
        out[LABEL_PREFIX + "engine-commit"] = s["commit"]
        out[LABEL_PREFIX + "engine-tree"] = s["tree_sha256"]
        out[LABEL_PREFIX + "patches"] = ",".join(pp["sha256"] for pp in s["patches"]) or "none"
    for tname, t in c["toolchains"].items():
        arts = t.get("artifacts") or {}
        if t["kind"] in ("zig", "wheel") and arts:
            out[LABEL_PREFIX + "zig-sha256"] = arts.get(p.platform) or next(iter(arts.values()))
            out[LABEL_PREFIX + "zig-toolchain"] = tname
        if t["kind"] == "cuda":
            out[LABEL_PREFIX + "cuda-version"] = str(t["version"] or "unknown")
    if c["base"]:
        out[LABEL_PREFIX + "base"] = f"{c['base']['ref']}@{c['base']['manifest_digest']}"
    return out


# ---------------------------------------------------------------------------------------
# up to date


def up_to_date(store_root: Path, p: Plan, labels: dict[str, str]) -> ImageRecord | None:
    """The record, when the tagged image exists with matching labels and the recorded ImageID."""
    rec = read_record(store_root, p.address)
    if rec is None:
        return None
    info = dockerio.image_inspect(rec.tag)
    if info is None or info.get("Id") != rec.image_id:
        return None
    have = (info.get("Config") or {}).get("Labels") or {}
    if any(have.get(k) != v for k, v in labels.items()):
        return None
    return rec


# ---------------------------------------------------------------------------------------
# the build context

#: the file assembly writes beside the recipe's own, for the build to read if it wants
CLOSURE_FILE = ".builder-closure.json"


def source_dir(index: int, name: str) -> str:
    """Where an image's source goes in its build context: the first at ``src/``, each other at ``src-<name>/``.

    The tree is the source's commit as locked, its patch series applied in order.
    """
    return "src" if index == 0 else f"src-{name}"


def toolchain_dir(kind: str, name: str) -> str | None:
    """Where a toolchain goes in the build context: a wheel's ``ziglang/`` folder at ``zig/``; any other
    download as its file under ``toolchains/<name>/``; a CUDA toolchain is not laid out (it is the base's)."""
    if kind == "cuda":
        return None
    return "zig" if kind == "wheel" else f"toolchains/{name}"


def assemble_context(pins: Pins, lock: Lock, p: Plan, root: Path, store: Store, dest: Path, *,
                     offline: bool, build_platform: str, on_log: Callable[[str], None]) -> dict[str, str]:
    """Lay out the build context from the store; return the build args. Nothing unverified goes in."""
    img = _recipe(pins, p.name)
    shutil.copytree(root / img.recipe, dest, dirs_exist_ok=True)
    buildargs: dict[str, str] = dict(img.build_args)
    buildargs["SOURCE_DATE_EPOCH"] = str(p.source_date_epoch)
    ignored = dockerignore_literals(dest)
    for i, sname in enumerate(img.sources):
        _lay_out_source(i, sname, lock, root, store, dest, offline=offline, on_log=on_log)
        if i == 0:
            buildargs["ENGINE_COMMIT"] = lock.sources[sname].commit
    for tname in img.toolchains:
        _lay_out_toolchain(tname, img, lock, root, store, dest, buildargs, ignored, offline=offline,
                           build_platform=build_platform)
    for fname in img.files:
        lf = lock.files[fname]
        blob = store.fetch_url(lf.url, lf.sha256, f"files.{fname}", root=root, offline=offline)
        (dest / "files").mkdir(exist_ok=True)
        shutil.copyfile(blob, dest / "files" / fname)
    wheels.lay_out({w: lock.wheels[w] for w in img.wheels}, root, store, dest, offline=offline, on_log=on_log)
    base = p.closure["base"]
    if base:
        name_only = base["ref"].split("@", 1)[0]
        if _has_tag(name_only):
            name_only = name_only.rsplit(":", 1)[0]
        buildargs["BASE"] = f"{name_only}@{base['manifest_digest']}"
    (dest / CLOSURE_FILE).write_text(json.dumps(p.closure, sort_keys=True, indent=1))
    return buildargs


def _lay_out_source(i: int, sname: str, lock: Lock, root: Path, store: Store, dest: Path, *, offline: bool,
                    on_log: Callable[[str], None]) -> None:
    """The ``i``-th source's tree at its locked commit, from the store (exported from its mirror once),
    with its patches applied in order."""
    ls = lock.sources[sname]
    what = f"sources.{sname}"
    url = gitsrc.source_url(ls.url, root)
    cache = store.root / "git"

    def export(d: Path) -> None:
        mirror = gitsrc.ensure_mirror(url, cache, offline=offline, name=sname)
        gitsrc.export_tree(mirror, ls.commit, d)

    tree = store.put_tree(ls.tree_sha256, export, what)
    store.verified_tree(ls.tree_sha256, what)
    target = dest / source_dir(i, sname)
    shutil.copytree(tree, target, symlinks=True)
    for mode_fix in target.rglob("*"):
        if mode_fix.is_dir() and not mode_fix.is_symlink():
            mode_fix.chmod(0o755)
    for j, patch in enumerate(ls.patches):
        pwhat = f"{what}.patches[{j}] ({patch.file})"
        blob = store.put_file(root / patch.file, patch.sha256, pwhat)
        apply_patch(target, blob, pwhat)
        on_log(f"applied {patch.file}")


def _lay_out_toolchain(tname: str, img: ImageRecipe, lock: Lock, root: Path, store: Store, dest: Path,
                       buildargs: dict[str, str], ignored: list[str], *, offline: bool, build_platform: str) -> None:
    """One toolchain's artifact for the build machine, into its folder of the context (CUDA: only its
    version, as a build arg)."""
    lt = lock.toolchains[tname]
    what = f"toolchains.{tname}"
    if lt.kind == "cuda":
        if lt.version:
            buildargs["CUDA_VERSION"] = lt.version
        return
    # the toolchain runs where the build runs: pick the build machine's artifact
    art = lt.platforms.get(build_platform) or lt.platforms.get(img.platform)
    if art is None:
        raise ConfigError(f"{what}: no artifact for {build_platform} in the lock")
    where = toolchain_dir(lt.kind, tname)
    assert where is not None
    if lt.kind == "wheel":
        blob = store.fetch_wheel(lt.package or tname, lt.version or "", art.filename or "", art.sha256, what,
                                 _wheelhouses(root), offline, pip_cache_dir())
        extract_wheel_folder(blob, "ziglang/", dest / where,
                             skip=[x.removeprefix(f"{where}/") for x in ignored if x.startswith(f"{where}/")])
    else:
        blob = store.fetch_url(art.url, art.sha256, what, root=root, offline=offline, filename=art.filename)
        tdir = dest / where
        tdir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(blob, tdir / (art.filename or "toolchain.tar.xz"))


def _recipe(pins: Pins, name: str) -> ImageRecipe:
    img = pins.images[name]
    if not isinstance(img, ImageRecipe):
        raise ConfigError(f"images.{name}: a published image has no recipe; nothing is built")
    return img


def _has_tag(ref: str) -> bool:
    last = ref.rsplit("/", 1)[-1]
    return ":" in last


def _wheelhouses(root: Path) -> list[Path]:
    out = [Path(x) for x in os.environ.get("BUILDER_WHEELHOUSE", "").split(os.pathsep) if x]
    out.append(root / ".cache" / "wheelhouse")
    return out


def apply_patch(tree: Path, patch: Path, what: str) -> None:
    """`git apply --check` (dry run) then `git apply`, then prove it applied (`--reverse --check`).

    GIT_CEILING_DIRECTORIES stops git from finding an enclosing repository: inside one, `git apply`
    silently skips paths outside the current folder, which would build an unpatched engine.
    """
    env = {"GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tree), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "GIT_CEILING_DIRECTORIES": str(tree.resolve().parent)}
    for args in (["--check"], [], ["--reverse", "--check"]):
        r = subprocess.run(["git", "apply", *args, "--whitespace=nowarn", str(patch)], cwd=tree,
                           capture_output=True, text=True, env=env, timeout=120)
        if r.returncode != 0:
            first = (r.stderr.strip().splitlines() or ["does not apply"])[0]
            if args == ["--reverse", "--check"]:
                raise VerifyError(f"{what}: patch did not apply cleanly: {first}")
            raise VerifyError(f"{what}: patch does not apply: {first}")


def dockerignore_literals(ctx: Path) -> list[str]:
    """The plain paths (no wildcards) a context's .dockerignore excludes; [] when it has exceptions (`!`).

    Docker leaves these out of the upload anyway; assembly uses them to skip extracting what would
    be ignored (the demo recipe keeps Zig's 175 MB of libc sources and headers out this way).
    """
    f = ctx / ".dockerignore"
    if not f.is_file():
        return []
    out: list[str] = []
    for raw in f.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!"):
            return []
        if any(c in line for c in "*?[\\"):
            continue
        norm = os.path.normpath(line.lstrip("/"))
        if norm not in (".", "..") and not norm.startswith("../"):
            out.append(Path(norm).as_posix())
    return out


def extract_wheel_folder(wheel: Path, prefix: str, dest: Path, skip: list[str] | None = None) -> None:
    """Extract one top-level folder of a wheel, keeping the exec bits, refusing escapes.

    ``skip``: paths relative to ``dest`` (files or folders) not to extract.
    """
    dest.mkdir(parents=True, exist_ok=True)
    skipped = tuple(skip or ())
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if not info.filename.startswith(prefix) or info.is_dir():
                continue
            rel = Path(info.filename[len(prefix):])
            if rel.is_absolute() or ".." in rel.parts:
                raise VerifyError(f"{wheel.name}: unsafe path in wheel: {info.filename}")
            posix = rel.as_posix()
            if any(posix == s or posix.startswith(s + "/") for s in skipped):
                continue
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1024 * 1024)
            mode = (info.external_attr >> 16) & 0o777
            out.chmod(0o755 if mode & 0o111 else 0o644)


# ---------------------------------------------------------------------------------------
# build


def build(pins_path: Path, lock_path: Path, store_root: Path, name: str, *, offline: bool = False,
          force: bool = False, nocache: bool = False, allow_emulation: bool = False,
          on_log: Callable[[str], None] = lambda s: None) -> ImageResult:
    """Build the image unless up to date (``force``: build all the same). ``nocache``: every step is built
    again and the build leaves no intermediate image (a stage's cache can be as large as the image)."""
    pins, lock, root = load_inputs(pins_path, lock_path, name)
    p = make_plan(pins, lock, name, root)
    if p.published is not None:
        return take_published(store_root, p, offline=offline, force=force, on_log=on_log)
    labels = labels_for(p, lock, pins)
    engine = dockerio.engine_platform()
    if _arch(engine) != _arch(p.platform) and not allow_emulation:
        raise ConfigError(f"images.{name}: platform {p.platform} differs from the Docker engine's {engine}; "
                          f"build on a {p.platform} engine (DOCKER_HOST=ssh://<spark>) or pass --emulate")
    if not force:
        rec = up_to_date(store_root, p, labels)
        if rec is not None:
            provenance.ensure(store_root, p, rec)  # a record without its provenance documents gets them here
            listed = targets.record_paths(pins, rec)  # (a record from before a lane's mounts changed)
            if listed != rec:
                write_record(store_root, listed)
            return ImageResult(record=listed, built=False)
    rec = _build_once(pins, lock, p, root, Store(store_root), labels, offline=offline, engine=engine,
                      on_log=on_log, nocache=nocache)
    old = read_record(store_root, p.address)
    if old is not None and old.image_id == rec.image_id:
        rec = rec.model_copy(update={"pushed": old.pushed})  # the same image is still in those registries
    rec = targets.record_paths(pins, rec)
    write_record(store_root, rec)
    provenance.write(store_root, p, rec)
    return ImageResult(record=rec, built=True)


def take_published(store_root: Path, p: Plan, *, offline: bool, force: bool = False,
                   on_log: Callable[[str], None] = lambda s: None) -> ImageResult:
    """A published image into the engine by its digest (pulled unless the engine holds its ImageID), checked
    against the lock (ImageID, DiffIDs), tagged as a build is and recorded with the same fields: bundles,
    installs and audits take it as they take a built one."""
    pub = p.published
    assert pub is not None
    tag = tag_for(p.name, p.address)
    rec = read_record(store_root, p.address)
    info = dockerio.image_inspect(pub["image_id"])
    if rec is not None and not force and info is not None and dockerio.image_id(tag) == rec.image_id:
        return ImageResult(record=rec, built=False)
    if info is None or force:
        info = _pull_published(p, pub, offline=offline, on_log=on_log)
    layers_ = list((info.get("RootFS") or {}).get("Layers") or [])
    if str(info.get("Id")) != pub["image_id"] or layers_ != pub["diff_ids"]:
        raise VerifyError(f"images.{p.name}: the engine's image {str(info.get('Id'))[:19]} has DiffIDs other than "
                          "the lock's")
    repo, _, t = tag.rpartition(":")
    dockerio.tag(pub["image_id"], repo, t)
    new = _published_record(p, pub, tag, info, layers_, rec)
    if new != rec:
        write_record(store_root, new)
    return ImageResult(record=new, built=rec is None)


def _pull_published(p: Plan, pub: dict[str, Any], *, offline: bool, on_log: Callable[[str], None]) -> dict[str, Any]:
    """Pull the published image by its digest; the engine's inspect record of the locked ImageID."""
    if offline:
        raise BuilderError(f"images.{p.name}: {pub['ref']} is not in the Docker engine, and --offline does "
                           "not pull (docker load it, or run without --offline)")
    on_log(f"pulling {pub['ref']}")
    dockerio.pull(pub["ref"])
    info = dockerio.image_inspect(pub["image_id"])
    if info is None:
        got = dockerio.image_id(pub["ref"]) or "nothing"
        raise VerifyError(f"images.{p.name}: {pub['ref']} pulled as image {got}, not the locked {pub['image_id']}")
    return info


def _published_record(p: Plan, pub: dict[str, Any], tag: str, info: dict[str, Any], layers_: list[Any],
                      rec: ImageRecord | None) -> ImageRecord:
    """The record of a published image, with the fields of a built one; what a push learned of the same
    image kept."""
    labels = {str(k): str(v) for k, v in ((info.get("Config") or {}).get("Labels") or {}).items()}
    new = ImageRecord(name=p.name, input_address=p.address, image_id=pub["image_id"], diff_ids=layers_, tag=tag,
                      lock_hash=p.lock_hash, platform=p.platform, source_date_epoch=p.source_date_epoch,
                      labels=labels, published=pub["ref"],
                      # the registry's manifest is builder's own form only when builder pushed it
                      manifest_digest=None, pushed=rec.pushed if rec is not None else {})
    if rec is not None and rec.image_id == new.image_id:
        # what a push learned (the manifest builder pushes, its sizes) still holds for the same image
        new = new.model_copy(update={"manifest_digest": rec.manifest_digest, "config_size": rec.config_size,
                                     "layer_sizes": rec.layer_sizes})
    return new


def _arch(platform: str) -> str:
    return platform.split("/")[1] if "/" in platform else platform


def _build_once(pins: Pins, lock: Lock, p: Plan, root: Path, store: Store, labels: dict[str, str], *,
                offline: bool, engine: str, on_log: Callable[[str], None], nocache: bool = False,
                tag: str | None = None) -> ImageRecord:
    with store.locked():
        store.clean_tmp()
    store.tmp.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"image-{os.getpid()}-", dir=store.tmp) as td:
        ctx = Path(td) / "context"
        ctx.mkdir()
        buildargs = assemble_context(pins, lock, p, root, store, ctx, offline=offline, build_platform=engine,
                                     on_log=on_log)
        # The engine keeps a build's stages as its build cache, as `docker build` does: the next build of the
        # same steps (a relock that moved only a later input, another store on this engine) reuses them
        # instead of compiling again. A build from nothing (nocache) removes the intermediate images it
        # made: the cache already holds their like. Builds that may share an intermediate image take turns
        # (dockerbuild.turn). The raw build's own tag: each build removes only its own name for the image
        # it got (docker deletes the image with the last).
        with dockerbuild.turn(ctx):
            raw_tag = f"builder-raw/{p.name}:{os.getpid()}-{secrets.token_hex(4)}"
            raw_id = dockerbuild.build(ctx, buildargs=buildargs, network="none", tag=raw_tag,
                                    platform=None if _arch(engine) == _arch(p.platform) else p.platform,
                                    nocache=nocache, cleanup=nocache, on_log=on_log)
            try:
                base_layers = 0
                if p.closure["base"]:
                    base_ref = buildargs["BASE"]
                    info = dockerio.image_inspect(base_ref)
                    base_layers = len(((info or {}).get("RootFS") or {}).get("Layers") or [])
                result = layers.normalize_and_load(raw_id, source_date_epoch=p.source_date_epoch,
                                                   base_layers=base_layers, labels=labels,
                                                   repo_tags=[tag or tag_for(p.name, p.address)],
                                                   workdir=Path(td) / "layers")
            finally:
                dockerio.remove(raw_tag)
    the_tag = tag or tag_for(p.name, p.address)
    repo, _, t = the_tag.rpartition(":")
    dockerio.tag(result.image_id, repo, t)
    return ImageRecord(name=p.name, input_address=p.address, image_id=result.image_id,
                       diff_ids=list(result.diff_ids), tag=the_tag, lock_hash=p.lock_hash, platform=p.platform,
                       source_date_epoch=p.source_date_epoch, labels=labels,
                       manifest_digest=result.manifest_digest, config_size=len(result.config),
                       layer_sizes=[layer.size for layer in result.layers])


def check_reproducible(pins_path: Path, lock_path: Path, store_root: Path, name: str, *, offline: bool = False,
                       on_log: Callable[[str], None] = lambda s: None) -> ImageResult:
    """Build (or reuse) the image, then rebuild it from nothing (no cache) and compare ImageIDs."""
    pins, lock, root = load_inputs(pins_path, lock_path, name)
    _recipe(pins, name)  # a published image is not built here: nothing to reproduce
    first = build(pins_path, lock_path, store_root, name, offline=offline, on_log=on_log)
    p = make_plan(pins, lock, name, root)
    labels = labels_for(p, lock, pins)
    check_tag = f"builder-check/{name}:{p.address[:32]}"
    try:
        second = _build_once(pins, lock, p, root, Store(store_root), labels, offline=offline,
                             engine=dockerio.engine_platform(), on_log=on_log, nocache=True, tag=check_tag)
    finally:
        if dockerio.image_id(check_tag) != first.record.image_id:
            dockerio.remove(check_tag, force=True)
        else:
            dockerio.remove(check_tag)
    same = second.image_id == first.record.image_id and second.diff_ids == first.record.diff_ids
    if not same:
        diff = [i for i, (a, b) in enumerate(zip(first.record.diff_ids, second.diff_ids, strict=False)) if a != b]
        raise BuilderError(f"images.{name}: not reproducible: first build {first.record.image_id[:19]}, rebuild "
                           f"{second.image_id[:19]} (layers differ at {diff or 'config'})")
    return ImageResult(record=first.record, built=first.built, reproducible=True)


def describe(p: Plan) -> dict[str, Any]:
    return {"image": p.name, "input_address": p.address, "lock_hash": p.lock_hash, "closure": p.closure}
