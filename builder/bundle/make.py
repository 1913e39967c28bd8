"""`builder bundle`'s steps, for one host or a whole fleet: the lane checked, the registry's preflight,
each host's bundle rendered (builder.bundle.render: files only), then the registry push. The checks and
the push run once for every host made in one call (a deploy makes the stale hosts' bundles in one).

A fleet whose hosts pull model files from its registry (``fleet.models_from = "registry"``) gets, with
--with-models, bundles that name each model file's blob (its digest is its locked sha256) instead of
carrying it; after rendering, each file the registry lacks (a HEAD first) is pushed once for the fleet.

A fleet with a registry gets the image by digest, not as an archive: with --with-image the bundle names
the reference its record gives, and the image is pushed after rendering (what the registry holds is not
sent), so the hosts can pull what the bundle names. The preflight before rendering checks the registry's
URL and CA file and asks it once, so a bad or unreachable registry fails before any file is written.
"""

from __future__ import annotations

import shutil
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from builder.bundle.render import (
    BundleInputs,
    BundleOptions,
    BundleResult,
    check_lane,
    lane_record,
    render_bundle,
)
from builder.errors import VerifyError
from builder.foundation.canon import file_lock
from builder.image import registry
from builder.image.imagerecord import ImageRecord
from builder.inputs.hosts import Fleet, Host, bundles_folder, find_fleet, find_host
from builder.store.modelfetch import in_store, wanted_for
from builder.store.modelstore import ModelStore
from builder.store.placement import host_files

#: bundles rendered at once: each is independent (one host's image archive is written while another's
#: model files are linked), and more would only contend for the same disk
RENDER_AT_ONCE = 4


@dataclass(frozen=True)
class RegistryPush:
    """The push that follows rendering: the fleet file (for messages), its registry, the lane's image
    (the push reads its record again, under its lock)."""

    fleet_path: Path
    target: registry.Target
    record: ImageRecord


def make_bundle(ctx: BundleInputs, host_ref: str, opts: BundleOptions) -> BundleResult:
    """One host's bundle (``out``: opts.out, else out/bundles/FLEET/HOST), its image pushed where the
    fleet has a registry and opts.with_image."""
    fleet_path, fleet, host = find_host(ctx.hosts_dir, host_ref)
    out = opts.out if opts.out is not None else bundles_folder(ctx.root, fleet.fleet.name, host.name)
    return _make(ctx, fleet_path, fleet, [(host, out)], opts)[0]


def make_fleet_bundles(
    ctx: BundleInputs, fleet_name: str, opts: BundleOptions, hosts: Collection[str] | None = None
) -> list[BundleResult]:
    """The fleet's bundles, by rank (under opts.out, else out/bundles/FLEET): every host's, or only
    those of ``hosts`` (names of the fleet's hosts; ConfigError for another). The lane check, the
    registry's preflight and the push run once for them all."""
    fleet_path, fleet = find_fleet(ctx.hosts_dir, fleet_name)
    base = opts.out if opts.out is not None else bundles_folder(ctx.root, fleet.fleet.name)
    chosen = fleet.by_rank() if hosts is None else sorted((fleet.host(n) for n in set(hosts)), key=lambda h: h.rank)
    return _make(ctx, fleet_path, fleet, [(h, base / h.name) for h in chosen], opts)


def _make(ctx: BundleInputs, fleet_path: Path, fleet: Fleet, outs: list[tuple[Host, Path]],
          opts: BundleOptions) -> list[BundleResult]:
    """The steps of `builder bundle` for these hosts of one fleet (host, its bundle's folder)."""
    pending = registry_preflight(ctx, fleet_path, fleet, check_lane(ctx, fleet_path, fleet), opts)
    models_to = models_preflight(fleet_path, fleet, opts)
    results = _render_all(ctx, fleet_path, fleet, outs, opts,
                          pushing=pending is not None or models_to is not None)
    if pending is not None:
        push_image(ctx, pending, results)
    if models_to is not None:
        push_models(ctx, fleet, models_to, results)
    return results


def _render_all(ctx: BundleInputs, fleet_path: Path, fleet: Fleet, outs: list[tuple[Host, Path]],
                opts: BundleOptions, *, pushing: bool) -> list[BundleResult]:
    """Each host's bundle rendered, in the order of ``outs``: one in this thread (a signal stops it where
    it is), several RENDER_AT_ONCE at a time. When one fails and a push was to follow, the bundles
    rendered beside it are removed, as a failed push removes them: each would name what the registry
    may never get, yet look current to the next deploy, which then makes and pushes only the others'."""
    if len(outs) == 1:
        (host, out), = outs
        return [render_bundle(ctx, fleet_path, fleet, host, out, opts)]
    ex = ThreadPoolExecutor(max_workers=max(1, min(RENDER_AT_ONCE, len(outs))))
    try:
        futures = [ex.submit(render_bundle, ctx, fleet_path, fleet, h, out, opts) for h, out in outs]
        wait(futures)
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)  # a signal: the renders not begun never begin
        raise
    ex.shutdown()
    failed = [e for e in (f.exception() for f in futures) if e is not None]
    rendered = [f.result() for f in futures if f.exception() is None]
    if failed:
        if pushing:
            _remove_rendered(rendered)
        raise failed[0]
    return rendered


def _remove_rendered(results: list[BundleResult]) -> None:
    """The bundles just written (not those rendered again to the same bytes: those were there before)."""
    for r in results:
        if not r.unchanged:
            shutil.rmtree(r.path, ignore_errors=True)


def registry_preflight(
    ctx: BundleInputs, fleet_path: Path, fleet: Fleet, lane_name: str, opts: BundleOptions
) -> RegistryPush | None:
    """Before rendering, for --with-image on a fleet with a registry: the registry's URL and CA file are
    valid and it answers (one request), else a one-line error and nothing written. Returns the push to
    run after rendering (None: nothing to push). A record of an older build cannot name its manifest
    (only the engine's bytes tell it): that image is pushed here, and its record learns the manifest
    the bundle then names."""
    if not opts.with_image:
        return None
    target = registry.fleet_target(fleet_path, fleet)
    if target is None:
        return None
    rec = lane_record(ctx, lane_name)
    if registry.planned_reference(rec, target) is None:
        registry.push_image(ctx.store, rec, target)
    else:
        registry.check_reachable(rec, target)
    return RegistryPush(fleet_path=fleet_path, target=target, record=rec)


def models_preflight(fleet_path: Path, fleet: Fleet, opts: BundleOptions) -> registry.Target | None:
    """Before rendering, for --with-models on a fleet whose hosts pull model files from its registry
    (``models_from = "registry"``): the registry answers (one request), else a one-line error and
    nothing written. Returns the registry to push the model files to (None: the bundles carry them)."""
    if not opts.with_models or fleet.fleet.models_from != "registry":
        return None
    target = registry.fleet_target(fleet_path, fleet)
    if target is None:
        return None
    registry.check_blobs_reachable(target, registry.MODEL_REPOSITORY)
    return target


def push_models(
    ctx: BundleInputs, fleet: Fleet, target: registry.Target, results: list[BundleResult]
) -> tuple[int, int]:
    """After rendering: each model file the bundles name that the registry lacks, pushed once for the
    whole fleet, as a blob whose digest is its locked sha256 (from the model store, its bytes checked
    there). A push that fails removes the bundles just rendered, as push_image does. Returns (files
    sent, bytes sent)."""
    store = ModelStore(ctx.store)
    blobs: dict[str, registry.Blob] = {}
    try:
        for r in results:
            for f in host_files(ctx.pins, ctx.lock, fleet.fleet.lane, fleet.host(r.host)):
                if "sha256:" + f.sha256 not in blobs:
                    path = in_store(ctx.pins, ctx.root, store, wanted_for(ctx.lock, f), ctx.lock)
                    blobs["sha256:" + f.sha256] = registry.Blob("sha256:" + f.sha256, f.size, path)
        # one push of model files at a time (a deploy makes its hosts' bundles at once): the second
        # finds the registry holding what the first sent
        with file_lock(ctx.store / "locks" / "push-model-files.lock"):
            sent, size, _ = registry.push_blobs(target, registry.MODEL_REPOSITORY, list(blobs.values()))
    except BaseException:
        _remove_rendered(results)
        raise
    return sent, size


def push_image(ctx: BundleInputs, pending: RegistryPush, results: list[BundleResult]) -> None:
    """After rendering: push the image the bundles name (what the registry holds is not sent), then make
    sure the registry holds it at the reference each bundle names (VerifyError otherwise). A push that
    fails or is interrupted removes the bundles just rendered: a bundle naming an image its registry lacks
    would look current to a deploy, and `builder bundle` run again makes and pushes it."""
    try:
        res, _ = registry.push_image(ctx.store, pending.record, pending.target)
    except BaseException:
        _remove_rendered(results)
        raise
    for r in results:
        if r.pull is not None and r.pull != res.reference:
            raise VerifyError(f"{pending.fleet_path}: fleet.registry: the image was pushed as {res.reference}, "
                              f"the bundle of {r.host} names {r.pull}")
