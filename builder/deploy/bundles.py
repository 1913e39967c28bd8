"""The bundles a deploy ships: the ones in ``out/bundles/<fleet>/<host>`` when they are what the lock
and inventory give now, else made again, the stale hosts' together (``builder bundle --fleet``'s form:
the lane check, the registry's preflight and the push run once per deploy).

"What they give now" is decided without re-making anything heavy: what the rank's launch decides of
its manifest (builder.bundle.launch_manifest: the identity keys, the lock hash, the image by ImageID,
the models this rank holds, the launch files rendered again (pure) and the installer's bytes) must be
what the bundle's manifest holds, and the signature must check against the key the hosts trust. The
image archive and the model files are not read: their identity is the ImageID and the locked sha256,
and ship verifies every byte before it sends anything.

A bundle is made again with the image archive and the model files only when the deploy is asked
for them (``--with-image`` / ``--with-models``, as ``builder bundle``): a host that already holds the
image and the model files (a changed serve setting) needs neither, and the installer refuses, before
anything is switched, a bundle without what its host lacks.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.bundle import (
    BundleOptions,
    choose_signing_key,
    crypto_sig_check,
    describe_signing_key,
    launch_differs,
    launch_manifest,
    make_fleet_bundles,
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


def why_stale(manifest: dict[str, Any], want: dict[str, Any], with_image: bool, with_models: bool,
              models_from: str = "bundle") -> str | None:
    """Why a bundle whose manifest is ``manifest`` is made again, in words; None when it is fresh: it
    holds ``want`` (builder.bundle.launch_manifest of its rank now) and carries what the deploy asks for
    (``--with-image``, ``--with-models``; the fleet's ``models_from``). ``manifest`` has been read and
    its signature checked (current_bundle): a bundle that cannot be read is an error, never stale."""
    where = launch_differs(manifest, want)
    if where == ("models",):
        return "its model files differ from the lock's"
    if where is not None:  # a file by its path, else the manifest's key (``lock_hash``, ``image.image_id``)
        return f"{where[1] if where[0] == 'files' else '.'.join(where)} differs"
    img = manifest.get("image") or {}
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
    why = why_stale(manifest, want, with_image, with_models, models_from)
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
    """host -> its bundle, by rank (made again where stale); with dry_run, a stale host -> why it would
    be made. The stale hosts' bundles are made in one call of the fleet form
    (builder.bundle.make_fleet_bundles), so the lane check, the registry's preflight and the push run
    once, not once per host. The key that signs is chosen then, once, and named through ``say``."""
    size = parse_size(part_size)  # (ConfigError before anything is written)
    ship_opts = ShipOptions(signing_key=key, allow_outside_key=allow_outside_key)

    def found(h: Host) -> FleetBundle | str:
        bdir = bundle_dir(ctx.root, fleet, h)
        # (first: a lane that cannot be bundled now, e.g. its image not built, fails a dry run too)
        want = launch_manifest(rank_launch(ctx, fleet, h, fleet.fleet.lane))
        if not (bdir / MANIFEST).is_file():
            return "no bundle yet"
        pub = trusted_key_bytes(ctx.root, fleet, bdir, ship_opts)
        manifest, why = current_bundle(bdir, pub, want, with_image, with_models, fleet.fleet.models_from)
        return why if manifest is None else FleetBundle(h.name, bdir, manifest, made=False)

    hosts = fleet.by_rank()
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(hosts)))) as ex:  # (each host's bundle is read alone)
        bundles = dict(zip([h.name for h in hosts], ex.map(found, hosts), strict=True))
    stale = {name: why for name, why in bundles.items() if isinstance(why, str)}
    if dry_run or not stale:
        return bundles
    for name, why in stale.items():
        if say is not None:
            say(f"{name}: making its bundle ({why})")
    choice = choose_signing_key(key, ctx.root, allow_outside=allow_outside_key)
    if say is not None:
        say(f"signing bundles with {describe_signing_key(choice)}")
    opts = BundleOptions(key=choice.path, with_image=with_image, with_models=with_models, part_size=size)
    for res in make_fleet_bundles(ctx, fleet.fleet.name, opts, hosts=list(stale)):  # (out: bundle_dir's)
        manifest = check_manifest(json.loads((res.path / MANIFEST).read_bytes()))
        bundles[res.host] = FleetBundle(res.host, res.path, manifest, made=True)
    return bundles
