"""`builder deploy`: a whole fleet, in rank order, under the fleet lock (`builder start` and `builder stop`:
builder.deploy.startstop).

A deploy, in order (each step bounded; hosts in parallel where the order allows it):

1. validate the inventory, pins and lock (exit 2 before any host is contacted); take the fleet lock;
2. the bundles (builder.deploy.bundles: the ones in out/bundles when current, else made again);
3. what every host runs (one call each; a host that cannot be reached stops it here: exit 3);
4. nothing to do when every host runs its new bundle already and the head answers: the deploy only
   audits (``--phase all``) and exits with the audit's code;
5. stage everywhere (ship with ``install --stage``: copy, verify, load the image, place the model
   files, stage the release; ``current`` is not touched), at most ``parallel`` hosts at once;
6. the derivations of the staged release on every host (builder.deploy.derivations: each rank's
   per-rank inputs, made in the lane's image where its address does not hold them yet; a failure
   stops the deploy, nothing switched);
7. the gate: the preflight audit of the staged release on every host (image, release, models, Engram,
   GPU, memory, fabric, storage, runtime; another GPU workload than the lane's own fails it). If any
   host failed to stage, drifts or cannot be reached, no host is switched (exit 1, or 3);
8. from here on the journal (builder.deploy.journal) records the old and new release of every host;
   stop the running release: the head first, then the workers (only the lane's containers);
9. switch every host (``installer switch``); start the ranks in the lane's order (builder.launch.order),
   each until it is ready, and wait for the head's health (``start_timeout``); the serving audit;
10. any failure in 8-9 rolls back: stop what started (head first), switch every host whose release
   moved back to what it ran before, start that in order, wait for it and audit it (against the pins
   and lock it was deployed from, kept by the deploy that put it there). The exit code is 1 and the
   report says, per host, what happened and which side it ends on.

A deploy killed at any point leaves the journal behind; the next deploy reads it, so "the old release"
stays what the fleet ran before the killed one, and moves every host to the new release (or, on a
failure, every host back to the old one), and says which.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from typing import Any

from builder.deploy import journal as J
from builder.deploy.bundles import FleetBundle, ensure_bundles
from builder.deploy.connections import close_sockets, command_sockets
from builder.deploy.deployment import Deployment
from builder.deploy.derivations import derive
from builder.deploy.dryrun import changes, describe_earlier, is_noop, noop, plan, plan_offline
from builder.deploy.fleetlock import fleet_lock
from builder.deploy.fleetwork import Fleetwork, explain, short
from builder.deploy.options import DeployOptions, Say
from builder.deploy.report import DeployReport
from builder.deploy.rollback import recover
from builder.deploy.stage import gate, stage
from builder.deploy.switch import forward
from builder.errors import ConfigError
from builder.hostscripts import shown
from builder.installer.manifest import MANIFEST, is_name, release_files


def deploy(opts: DeployOptions, say: Say = lambda _: None) -> DeployReport:
    start = time.monotonic()
    if opts.plan:
        opts = replace(opts, dry_run=True)
    if opts.dry_run and opts.repair:  # (what a repair does is known only once every file is hashed)
        raise ConfigError("--repair with --dry-run or --plan: what a repair places again is known only after it hashes "
                          "every installed file; run `builder audit --mode full` to see what differs")
    if opts.dry_run:
        w = Fleetwork(opts, say)  # ConfigError (exit 2) before any host is contacted
        try:
            rep = run(Deployment(w))
        finally:
            w.close()
    else:
        if not is_name(opts.fleet):  # (a fleet's name, as the inventory allows it)
            raise ConfigError(f"--fleet: not a fleet name: {opts.fleet!r}")
        with fleet_lock(opts.store, opts.fleet, "deploy"):
            sockets = command_sockets(opts)
            try:
                w = Fleetwork(opts, say, sockets=sockets)  # ConfigError (exit 2): nothing was changed
            except BaseException:
                close_sockets(sockets)
                raise
            try:
                rep = run(Deployment(w))
            finally:
                w.close()
    rep.seconds = time.monotonic() - start
    return rep


def run(d: Deployment) -> DeployReport:
    """The deploy, from the bundles to the serving audit (or the rollback)."""
    w, rep = d.w, d.rep
    opts = w.opts
    made = ensure_bundles(
        w.ctx, w.fleet_path, w.fleet, key=opts.key, allow_outside_key=opts.allow_outside_key,
        with_image=opts.with_image, with_models=opts.with_models,
        part_size=opts.part_size, dry_run=opts.dry_run, say=w.say,
    )
    stale = {n: b for n, b in made.items() if isinstance(b, str)}
    d.bundles = {n: b for n, b in made.items() if isinstance(b, FleetBundle)}
    earlier = J.load(opts.store, w.fleet_name)
    if opts.plan:
        for h in w.hosts:
            d.out(h).target = d.bundles[h.name].bundle_id if h.name in d.bundles else None
        if earlier is not None:
            rep.resumed = (f"an earlier deploy of fleet {earlier.fleet} (pid {earlier.pid}, started "
                           f"{earlier.started}) did not finish (it stopped while {earlier.phase})")
        return plan_offline(d, stale)
    failed = w.probe()
    if failed:
        for name, why in failed.items():
            d.out(name).result, d.out(name).message = "unreachable", why
        return d.refuse("not every host answered; nothing was changed", unreachable=True)
    for h in w.hosts:
        o, st = d.out(h), w.states[h.name]
        o.target = d.bundles[h.name].bundle_id if h.name in d.bundles else None
        o.origin = st.installed or st.current
        if earlier is not None and h.name in earlier.origin:
            o.origin = earlier.origin[h.name]
        o.on = d.side(h)
    if earlier is not None:
        rep.resumed = describe_earlier(d, earlier)
        w.say(rep.resumed)
    if opts.dry_run:
        return plan(d, stale)
    if opts.repair:
        return repair(d, earlier)
    if is_noop(d):
        return noop(d, earlier)
    return switch_over(d, earlier)


def snapshot(d: Deployment) -> None:
    """Keep the pins and lock this deploy is made from (what a later rollback to it is audited against)."""
    w = d.w
    opts = w.opts
    built = w.ctx.pins.recipes().get(w.lane.image)  # (a published image has no recipe folder)
    recipe = built.recipe if built is not None else None
    J.snapshot(opts.store, d.rep.target_lock or "", opts.pins, opts.lock, opts.root, recipe)


def repair(d: Deployment, earlier: J.Journal | None) -> DeployReport:
    """`builder deploy --repair`, in any audit mode: every file of every host is hashed, never trusted by
    its stat. The installer places again, from the verified bundle, each model, kit, Engram and launch
    file whose content differs from the signed manifest (``receive --rehash``), and each derivation
    whose files differ from their record is made again (``derive.py make … full``), before the gate, so
    what is repaired never blocks its own repair; hardware and fleet checks still gate it. Then, as any
    deploy: the gate, the stop, the switch (the apply record written again on the repaired hosts), the
    start in the lane's order and the serving audit, or the rollback. Nothing differs and the fleet
    serves and passes its audit: it says so (exit 0). A host whose apply record alone drifted (nothing
    to place) is reinstalled in the same way once the audit names it."""
    refused = _repair_files(d)
    if refused is not None:
        return refused
    _note_drifted_records(d)
    d.repair = set(d.replaced)
    if d.replaced or not is_noop(d):
        return switch_over(d, earlier)
    return _repair_what_the_audit_fails(d, earlier)


def _repair_files(d: Deployment) -> DeployReport | None:
    """Stage with every file hashed, placing again what differs, then the derivations; the refusal when
    either fails."""
    w, rep = d.w, d.rep
    d.rehash = True
    for line in changes(d):
        w.say(f"to deploy: {line}")
    snapshot(d)
    w.say("repair: hashing every installed file on every host against its signed manifest and the "
          "derivations' records; placing again what differs")
    if not stage(d):
        bad = "; ".join(f"{o.host}: {o.message}" for o in rep.hosts if o.result in ("failed", "unreachable"))
        return d.refuse(f"repair: staging failed, no host was switched: {bad}", unreachable=rep.unreachable)
    return derive(d)


def _note_drifted_records(d: Deployment) -> None:
    """Add to ``d.replaced`` each host on its target bundle whose apply record drifted, and say what
    was put right on each host."""
    w = d.w
    on_target = {h.name for h in w.hosts if w.states[h.name].installed == d.out(h).target}
    # (a host moving to a new bundle receives it whole: only those already on it can have drifted)
    d.replaced = {n: what for n, what in d.replaced.items() if n in on_target}
    for name in sorted(on_target):
        why = record_drift(w.states[name].applied, d.bundles[name])
        if why:
            d.replaced.setdefault(name, []).append(f"the apply record ({why})")
    for name, what in sorted(d.replaced.items()):
        w.say(f"{name}: differed from its bundle or record, put right: {shown(what)}")


def _repair_what_the_audit_fails(d: Deployment, earlier: J.Journal | None) -> DeployReport:
    """No file differed: audit the fleet as it is; the hosts the audit fails are reinstalled (their apply
    record written again)."""
    w, rep = d.w, d.rep
    done = noop(d, earlier)
    if done.exit_code == 0 and done.result != "deployed":  # (an earlier deploy finished: its reason stands)
        done.reason = ("nothing to repair: every file on every host matches its signed manifest or its "
                       "derivation's record (each hashed), and the fleet serves and passes its audit")
        return done
    drifted = {n for n, h in (done.audit or {}).get("hosts", {}).items() if h.get("status") != "pass"}
    d.repair = {h.name for h in w.hosts if h.name in drifted}
    if done.unreachable or not d.repair:
        return done
    for h in w.hosts:
        d.out(h).result = "pending"
    rep.result, rep.reason, rep.audit = "failed", "", None
    w.say(f"repair: no file differs; reinstalling the release (its apply record written again) on "
          f"{', '.join(sorted(d.repair))}, which the audit failed")
    return switch_over(d, earlier)


def record_drift(applied: dict[str, Any] | None, bundle: FleetBundle) -> str:
    """What of a host's apply record differs from the signed manifest of the bundle it was installed
    from ("" none): the manifest's sha256, or a release file's size or sha256."""
    if not applied:
        return "missing"
    mbytes = (bundle.path / MANIFEST).read_bytes()
    if applied.get("manifest_sha256") != hashlib.sha256(mbytes).hexdigest():
        return "manifest_sha256"
    if not isinstance(applied.get("files"), list):  # (a hand-edited record: not a list is drift itself)
        return "files"
    want = {f["path"]: (f["size"], f["sha256"]) for f in release_files(bundle.manifest)}
    have = {str(f.get("path")): (f.get("size"), f.get("sha256"))
            for f in applied["files"] if isinstance(f, dict)}
    bad = sorted(p for p in want.keys() | have.keys() if want.get(p) != have.get(p))
    return f"files: {shown(bad)}" if bad else ""


def switch_over(d: Deployment, earlier: J.Journal | None) -> DeployReport:
    """From staging to the serving audit: stage, the derivations, the gate, then the switch (or the
    rollback). With ``d.rehash`` (a repair), staging and the derivations have already run."""
    w, rep = d.w, d.rep
    opts = w.opts
    if not d.rehash:
        for line in changes(d):
            w.say(f"to deploy: {line}")
        snapshot(d)
        if not stage(d):
            return d.refuse("staging failed; no host was switched", unreachable=rep.unreachable)
        refused = derive(d)
        if refused is not None:
            return refused
    refused = gate(d)
    if refused is not None:
        return refused
    d.journal = J.Journal(
        fleet=w.fleet_name,
        target={h.name: d.bundles[h.name].bundle_id for h in w.hosts},
        origin={h.name: d.out(h).origin for h in w.hosts},
        origin_locks={h.name: d.origin_lock(h, earlier) for h in w.hosts},
        target_lock=rep.target_lock or "",
        phase="stopping",
    )
    if earlier is not None:
        d.journal.started = earlier.started
    J.save(opts.store, d.journal)
    try:
        forward(d)
    except Exception as e:  # anything after the first change: roll every host back
        return recover(d, explain(e))
    J.clear(opts.store, w.fleet_name)
    rep.result = "deployed"
    rep.reason = f"every host runs its new bundle (lock {short(rep.target_lock)}) and the fleet serves"
    if d.repair:
        rep.reason += f"; repaired (reinstalled from its bundle): {', '.join(sorted(d.repair))}"
    return rep


__all__ = ["DeployOptions", "deploy"]
