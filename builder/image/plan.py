"""Image plans: the closure of locked inputs an image needs, and its input address.

The closure holds exactly what goes into the image (base digest for the platform,
source commits and tree hashes, patch hashes in order, toolchain artifact hashes for
the platform, file hashes, each wheel set's wheels by filename and sha256, build args,
platform, the recipe folder's files by relative path, SOURCE_DATE_EPOCH and builder's
assembly format). Its canonical JSON's sha256 is the input address: same closure, same
address, on any machine. The image name, the project's absolute path and unrelated lock
entries are deliberately not in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import ASSEMBLY_FORMAT
from builder.errors import ConfigError
from builder.foundation.canon import address
from builder.foundation.hashing import recipe_files
from builder.inputs.loader import did_you_mean
from builder.inputs.pins import ImageRecipe, Pins, PublishedImage, load_pins
from builder.lock.lockfile import Lock, LockedImage, LockedPublishedImage, check_lock, load_lock, spec_hash
from builder.lock.wheelset import closure_entry


@dataclass(frozen=True)
class Plan:
    name: str
    closure: dict[str, Any]
    address: str
    lock_hash: str  # sha256 of the lock entries in this closure (the image's "lock hash" label)

    @property
    def platform(self) -> str:
        return str(self.closure["platform"])

    @property
    def source_date_epoch(self) -> int:
        return int(self.closure.get("source_date_epoch", 0))

    @property
    def published(self) -> dict[str, Any] | None:
        """For a published image: its reference, manifest digest, ImageID and DiffIDs (as locked)."""
        p = self.closure.get("published")
        return dict(p) if isinstance(p, dict) else None


def _need(lock: Lock, kind: str, name: str, image: str) -> Any:
    entry = getattr(lock, kind).get(name)
    if entry is None:
        raise ConfigError(f"images.{image}: {kind}.{name} is not in the lock (run `builder lock {image}`)")
    return entry


_ZIG_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "riscv64": "riscv64", "powerpc64le": "ppc64le", "s390x": "s390x"}


def _check_zig_target(name: str, platform: str, build_args: dict[str, str]) -> None:
    """A ZIG_TARGET build arg must name the image platform's CPU (aarch64-... for linux/arm64)."""
    triple = build_args.get("ZIG_TARGET")
    if not triple or triple == "native":
        return
    arch = _ZIG_ARCH.get(triple.split("-", 1)[0])
    want = platform.split("/")[1] if "/" in platform else platform
    if arch is not None and arch != want:
        raise ConfigError(f"images.{name}.build_args.ZIG_TARGET: {triple} builds for {arch}, but the image "
                          f"platform is {platform}")


def load_inputs(pins_path: Path, lock_path: Path, name: str) -> tuple[Pins, Lock, Path]:
    pins = load_pins(pins_path)
    if name not in pins.images:
        have = ", ".join(sorted(pins.images)) or "none"
        raise ConfigError(f"{pins_path}: images: no image named {name!r}{did_you_mean(name, pins.images)} "
                          f"(have: {have})")
    res = check_lock(pins_path, lock_path, [name])
    if not res.ok:
        raise ConfigError(f"{lock_path}: stale for image {name}: {res.problems[0]} (run `builder lock {name}`)")
    return pins, load_lock(lock_path), pins_path.resolve().parent


def plan(pins_path: Path, lock_path: Path, name: str) -> Plan:
    pins, lock, root = load_inputs(pins_path, lock_path, name)
    return make_plan(pins, lock, name, root)


def make_plan(pins: Pins, lock: Lock, name: str, root: Path) -> Plan:
    if name not in pins.images:
        have = ", ".join(sorted(pins.images)) or "none"
        raise ConfigError(f"no image named {name!r} in pins{did_you_mean(name, pins.images)} (have: {have})")
    img = pins.images[name]
    li = lock.images.get(name)
    if li is None or li.spec_hash != spec_hash(img):
        raise ConfigError(f"images.{name}: the lock is stale for this image (run `builder lock {name}`)")
    if isinstance(li, LockedPublishedImage):
        return _published_plan(name, li)
    assert isinstance(li, LockedImage) and not isinstance(img, PublishedImage)  # same spec hash, same kind
    current = recipe_files(root, img.recipe)
    if current != li.recipe_files:
        changed = sorted(set(current.items()) ^ set(li.recipe_files.items()))
        raise ConfigError(f"images.{name}: recipe file {changed[0][0]} changed since the lock "
                          f"(run `builder lock {name}`)")
    _check_zig_target(name, img.platform, img.build_args)
    used: dict[str, Any] = {f"images.{name}": li.model_dump(mode="json")}
    closure = {
        "assembly_format": ASSEMBLY_FORMAT,
        "platform": img.platform,
        "build_args": dict(sorted(img.build_args.items())),
        "base": _base_entry(pins, lock, img, name, used),
        "sources": _source_entries(pins, lock, img, name, used),
        "toolchains": _toolchain_entries(lock, img, name, used),
        "files": _file_entries(lock, img, name, used),
        "recipe": {Path(rel).relative_to(img.recipe).as_posix(): h for rel, h in sorted(li.recipe_files.items())},
        "source_date_epoch": li.source_date_epoch,
    }
    if img.wheels:  # (only then: an image without wheel sets keeps the address it had before they existed)
        closure["wheels"] = _wheel_entries(pins, lock, img, name, used)
    return Plan(name=name, closure=closure, address=address(closure), lock_hash=address(used))


# Each part of a recipe image's closure, from the lock: the entries it reads go into ``used``, whose
# address is the image's lock hash.


def _base_entry(pins: Pins, lock: Lock, img: ImageRecipe, name: str, used: dict[str, Any]) -> dict[str, Any] | None:
    """The base image's manifest for the image's platform (None for an image from scratch)."""
    if not img.base:
        return None
    plat = img.platform
    lb = _need(lock, "bases", img.base, name)
    if lb.spec_hash != spec_hash(pins.bases[img.base]):
        raise ConfigError(f"images.{name}: bases.{img.base} changed since the lock")
    if plat not in lb.platforms:
        raise ConfigError(f"images.{name}: base {img.base} has no {plat} manifest in the lock")
    used[f"bases.{img.base}"] = lb.model_dump(mode="json")
    return {"ref": lb.ref, "index_digest": lb.index_digest, "manifest_digest": lb.platforms[plat]}


def _source_entries(pins: Pins, lock: Lock, img: ImageRecipe, name: str, used: dict[str, Any]) -> dict[str, Any]:
    """Each source's commit, tree hash and patches' hashes in order."""
    sources: dict[str, Any] = {}
    for s in img.sources:
        ls = _need(lock, "sources", s, name)
        if ls.spec_hash != spec_hash(pins.sources[s]):
            raise ConfigError(f"images.{name}: sources.{s} changed since the lock")
        sources[s] = {"url": ls.url, "commit": ls.commit, "tree_sha256": ls.tree_sha256,
                      "patches": [{"file": Path(p.file).name, "sha256": p.sha256} for p in ls.patches]}
        used[f"sources.{s}"] = ls.model_dump(mode="json")
    return sources


def _toolchain_entries(lock: Lock, img: ImageRecipe, name: str, used: dict[str, Any]) -> dict[str, Any]:
    """Each toolchain's kind, version, package and artifacts' hashes by platform."""
    toolchains: dict[str, Any] = {}
    for t in img.toolchains:
        lt = _need(lock, "toolchains", t, name)
        entry: dict[str, Any] = {"kind": lt.kind, "version": lt.version}
        if lt.package:  # a wheel: the package index's name for it (its purl, pkg:pypi/NAME)
            entry["package"] = lt.package
        if lt.platforms:
            # the toolchain runs on the build machine for wheels/zig used as cross compilers;
            # the closure names the artifact for the image platform and the build platform set
            entry["artifacts"] = {p: a.sha256 for p, a in sorted(lt.platforms.items())}
        toolchains[t] = entry
        used[f"toolchains.{t}"] = lt.model_dump(mode="json")
    return toolchains


def _file_entries(lock: Lock, img: ImageRecipe, name: str, used: dict[str, Any]) -> dict[str, Any]:
    """Each plain file's sha256."""
    files: dict[str, Any] = {}
    for f in img.files:
        lf = _need(lock, "files", f, name)
        files[f] = lf.sha256
        used[f"files.{f}"] = lf.model_dump(mode="json")
    return files


def _wheel_entries(pins: Pins, lock: Lock, img: ImageRecipe, name: str, used: dict[str, Any]) -> dict[str, Any]:
    """Each wheel set's wheels by filename and sha256."""
    sets: dict[str, Any] = {}
    for w in img.wheels:
        lw = _need(lock, "wheels", w, name)
        if lw.spec_hash != spec_hash(pins.wheels[w]):
            raise ConfigError(f"images.{name}: wheels.{w} changed since the lock")
        sets[w] = closure_entry(lw)
        used[f"wheels.{w}"] = lw.model_dump(mode="json")
    return sets


def _published_plan(name: str, li: LockedPublishedImage) -> Plan:
    """A published image's closure is the image itself, as locked: the same digests, the same address."""
    closure = {
        "assembly_format": ASSEMBLY_FORMAT,
        "platform": li.platform,
        "published": {"ref": li.published, "manifest_digest": li.manifest_digest, "image_id": li.image_id,
                      "diff_ids": list(li.diff_ids)},
    }
    used = {f"images.{name}": li.model_dump(mode="json")}
    return Plan(name=name, closure=closure, address=address(closure), lock_hash=address(used))
