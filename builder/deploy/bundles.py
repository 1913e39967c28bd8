"""The bundles a deploy ships: the ones in ``out/bundles/<fleet>/<host>`` when they are what the lock
and inventory give now, else made again (``builder bundle``).

"What they give now" is decided without re-making anything heavy: the manifest's identity (fleet, host,
lane, rank, role, world size, paths, builder version), the lock hash, the image (input address,
ImageID, DiffIDs from the build record), the models this rank holds (builder.store.placement), the launch
files rendered again (pure) and the installer's bytes must all equal what a new ``builder bundle``
would write, and the signature must check against the key the hosts trust. The image archive and the
model files are not read: their identity is the ImageID and the locked sha256, and ship verifies every
byte before it sends anything.

A bundle is made again with the image archive and the model files only when the deploy is asked
for them (``--with-image`` / ``--with-models``, as ``builder bundle``): a host that already holds the
image and the model files (a changed serve setting) needs neither, and the installer refuses, before
anything is switched, a bundle without what its host lacks.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.bundle import (
    BundleOptions,
    choose_signing_key,
    crypto_sig_check,
    describe_signing_key,
    hostpkg,
    make_bundle,
    parse_size,
    rank_launch,
)
from builder.errors import BuilderError, VerifyError
from builder.inputs.hosts import Fleet, Host, bundles_folder
from builder.installer.errors import InstallError
from builder.installer.manifest import MANIFEST, check_manifest
from builder.installer.verify import verify_bundle
from builder.ship import ShipOptions, trusted_key_bytes


@dataclass
class FleetBundle:
    host: str
    path: Path
    manifest: dict[str, Any]
    made: bool  # made (again) by this deploy

    @property
    def bundle_id(self) -> str:
        return str(self.manifest["bundle_id"])


def bundle_dir(root: Path, fleet: Fleet, host: Host) -> Path:
    return bundles_folder(root, fleet.fleet.name, host.name)


def expected(ctx: Any, fleet: Fleet, host: Host) -> dict[str, Any]:
    """What a bundle of this host made now must hold (all but the archive and the model bytes)."""
    lane_name = fleet.fleet.lane
    rl = rank_launch(ctx, fleet, host, lane_name)
    files = {
        rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "mode": mode}
        for rel, (data, mode) in rl.files.items()
    }
    installer = hostpkg.zipapp()
    files[hostpkg.NAME] = {"size": len(installer), "sha256": hashlib.sha256(installer).hexdigest(), "mode": "0755"}
    return {
        "identity": rl.identity,
        "image": rl.image,
        "models": rl.models,
        "files": files,
    }


def stale(manifest: dict[str, Any], want: dict[str, Any], with_image: bool, with_models: bool,
          models_from: str = "bundle") -> str | None:
    """Why a bundle's manifest is not what a bundle made now would be (None: it is)."""
    for k, v in want["identity"].items():
        if manifest.get(k) != v:
            return f"{k} differs"
    img = manifest.get("image") or {}
    for k, v in want["image"].items():
        if img.get(k) != v:
            return f"image.{k} differs"
    have_models = [{k: m.get(k) for k in ("model", "file", "path", "size", "sha256")} for m in manifest["models"]]
    if have_models != want["models"]:
        return "its model files differ from the lock's"
    entries = {f["path"]: f for f in manifest["files"]}
    for rel, w in want["files"].items():
        e = entries.get(rel)
        if e is None or (e["size"], e["sha256"], e["mode"]) != (w["size"], w["sha256"], w["mode"]):
            return f"{rel} differs"
    if with_image and img.get("archive") is None and img.get("pull") is None:
        return "it carries no image (--with-image)"
    if with_models and models_from == "registry":
        if any(m.get("registry") is None for m in manifest["models"]):
            return "its model files do not come from the fleet registry (fleet.models_from)"
    elif with_models and any(m.get("bundled") is None for m in manifest["models"]):
        return "it carries no model files (--with-models)"
    return None


def current_bundle(out: Path, key: bytes, want: dict[str, Any], with_image: bool, with_models: bool,
                   models_from: str = "bundle") -> tuple[dict[str, Any] | None, str]:
    """The bundle at out when it is current and its signature checks (sizes, not hashes); else None
    and why it is stale (made again). Stale is what docs/deploy.md says: not what the lock and inventory
    give now, or a signature the hosts' key does not check, or files changed, missing or cut short.
    Anything else (the folder cannot be read, a fault in builder) is an error, raised, never taken for
    stale and papered over by a new bundle."""
    if not (out / MANIFEST).is_file():
        return None, "no bundle yet"
    try:
        manifest, _, _ = verify_bundle(str(out), key, sig_check=crypto_sig_check, hashes=False)
    except InstallError as e:  # refused: its form, its files, or a signature that does not check
        return None, str(e)
    except VerifyError as e:  # builder.foundation.sign: the signature (or the key) does not check
        return None, str(e)
    except OSError as e:
        raise BuilderError(f"{out}: cannot read the bundle: {e.strerror or e}") from None
    why = stale(manifest, want, with_image, with_models, models_from)
    return (manifest, "") if why is None else (None, why)


def ensure_bundles(
    ctx: Any,
    fleet_path: Path,
    fleet: Fleet,
    *,
    key: Path | None,
    allow_outside_key: bool = False,
    with_image: bool,
    with_models: bool,
    part_size: str,
    dry_run: bool = False,
    say: Any = None,
) -> dict[str, FleetBundle | str]:
    """host -> its bundle (made again where stale); with dry_run, host -> why it would be made. The key
    that signs is chosen once, when the first bundle is made again, and named through ``say``."""
    chosen: list[Path] = []
    choosing = threading.Lock()

    def signing_key() -> Path:
        with choosing:
            if not chosen:
                choice = choose_signing_key(key, ctx.root, allow_outside=allow_outside_key)
                line = describe_signing_key(choice)
                if say is not None:
                    say(f"signing bundles with {line}")
                chosen.append(choice.path)
            return chosen[0]

    def one(h: Host) -> FleetBundle | str:
        bdir = bundle_dir(ctx.root, fleet, h)
        want = expected(ctx, fleet, h)
        manifest: dict[str, Any] | None = None
        why = "no bundle yet"
        if (bdir / MANIFEST).is_file():
            ship_opts = ShipOptions(signing_key=key, allow_outside_key=allow_outside_key)
            pub = trusted_key_bytes(ctx.root, fleet, bdir, ship_opts)
            manifest, why = current_bundle(bdir, pub, want, with_image, with_models, fleet.fleet.models_from)
        if manifest is not None:
            return FleetBundle(h.name, bdir, manifest, made=False)
        if dry_run:
            return why
        if say is not None:
            say(f"{h.name}: making its bundle ({why})")
        opts = BundleOptions(
            out=bdir, key=signing_key(), with_image=with_image, with_models=with_models, part_size=size
        )
        res = make_bundle(ctx, f"{fleet.fleet.name}/{h.name}", opts)
        return FleetBundle(h.name, res.path, check_manifest(json.loads((res.path / MANIFEST).read_bytes())),
                           made=True)

    size = parse_size(part_size)  # (ConfigError before anything is written)
    hosts = fleet.by_rank()
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(hosts)))) as ex:  # (hosts' bundles are independent)
        return dict(zip([h.name for h in hosts], ex.map(one, hosts), strict=True))

