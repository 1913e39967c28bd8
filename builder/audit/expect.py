"""What each host must be, written before any host is contacted: from the lock, the inventory, the
placement rule and the image's build record in the store, never from the host.

One JSON file per host (`build_expectations`), which checks/conftest.py reads. Anything the
expectations cannot say (no pins, no lock, no build record) goes in as a reason, which the checks
that need it skip or fail with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from builder.audit.concerns import Concern
from builder.audit.selection import AuditOptions
from builder.errors import ConfigError
from builder.image.imagerecord import read_record
from builder.image.plan import make_plan
from builder.inputs.hosts import Fleet, FleetHost, Host, check_against_pins
from builder.inputs.pins import Pins, load_pins
from builder.launch import rank_command
from builder.launch.derivplan import derivation_runs, render_plan
from builder.lock.diff import diff_locks
from builder.lock.lockfile import Lock, load_lock
from builder.store import servingrecord
from builder.store.placement import place_models

EXPECT_FORMAT = 1
APPLIED_RELPATH = "state/applied.json"
STAGED_RELPATH = "state/staged.json"


@dataclass
class LaneInputs:
    """The pins and the lock, loaded once for every host (None, and a reason, when absent)."""

    pins: Pins | None = None
    pins_reason: str = ""
    lock: Lock | None = None
    lock_reason: str = ""
    lock_hash: str | None = None


def read_pins_and_lock(opts: AuditOptions, inputs: LaneInputs) -> None:
    """The pins and lock from their files, or the reason each is absent; ConfigError for a lock
    without its pins."""
    if opts.pins.exists():
        inputs.pins = load_pins(opts.pins)
    else:
        inputs.pins_reason = f"no pins file at {opts.pins}"
    if opts.lock.exists():
        inputs.lock = load_lock(opts.lock)
        inputs.lock_hash = inputs.lock.lock_hash()
    else:
        inputs.lock_reason = f"no lock file at {opts.lock} (run `builder lock`)"
    if inputs.pins is None and inputs.lock is not None:
        raise ConfigError(f"{opts.lock}: a lock without its pins file {opts.pins}")


def load_lane_inputs(opts: AuditOptions, targets: list[FleetHost]) -> LaneInputs:
    """Load the pins and lock (or take those the command loaded: `opts.loaded`) and check every
    target's fleet against them: its lane exists (in the lock too), the lock has the lane's models and
    runtime inputs (kits, plain files), its ssh_config is a file. ConfigError otherwise."""
    inputs = LaneInputs()
    loaded = opts.loaded
    if loaded is not None and loaded.pins is not None and loaded.lock is not None:
        # (as the command loaded them: neither is read again)
        inputs.pins, inputs.lock, inputs.lock_hash = loaded.pins, loaded.lock, loaded.lock.lock_hash()
    else:
        read_pins_and_lock(opts, inputs)
    seen: set[str] = set()
    for t in targets:
        if t.fleet.fleet.name in seen:
            continue
        seen.add(t.fleet.fleet.name)
        if inputs.pins is not None:
            lock_lanes = set(inputs.lock.lanes) if inputs.lock is not None else None
            check_against_pins(t.path, t.fleet, set(inputs.pins.lanes), lock_lanes)
            if inputs.lock is not None:
                lane = inputs.pins.lanes[t.fleet.fleet.lane]
                needed = [("models", m) for m in lane.models] + [
                    ("kits" if i in inputs.pins.kits else "files", i) for i in lane.inputs()]
                for kind, m in needed:
                    if m not in getattr(inputs.lock, kind):
                        raise ConfigError(
                            f"{opts.lock}: {kind}.{m}: lane {t.fleet.fleet.lane!r} needs it but the "
                            f"lock has no entry (run `builder lock`)"
                        )
        t.ssh_config()
    return inputs


def image_expectation(opts: AuditOptions, inputs: LaneInputs, lane_name: str) -> tuple[dict[str, Any] | None, str]:
    """The lane's image as `builder image` recorded it for the lock's input address, or why not.
    (With a lock, a missing record fails the image checks: checklib.expected_image.)"""
    if inputs.pins is None:
        return None, inputs.pins_reason
    if inputs.lock is None:
        return None, inputs.lock_reason
    lane = inputs.pins.lanes[lane_name]
    plan = make_plan(inputs.pins, inputs.lock, lane.image, opts.root)
    rec = read_record(opts.store, plan.address)
    if rec is None:
        return None, (
            f"image {lane.image}: expected a build record for input address {plan.address[:16]} in "
            f"{opts.store} (run `builder image {lane.image}`), found none"
        )
    return {
        "name": lane.image,
        "input_address": rec.input_address,
        "image_id": rec.image_id,
        "diff_ids": list(rec.diff_ids),
        "labels": dict(rec.labels),
        "tag": rec.tag,
    }, ""


def launch_expectation(
    pins: Pins, fleet: Fleet, host: Host, lane_name: str, image_id: str | None
) -> tuple[dict[str, Any] | None, str]:
    """How start.sh runs this rank (builder.launch, from the pins and inventory): the container's
    name, its environment, its entrypoint and its command."""
    try:
        cmd = rank_command(pins, fleet, host, lane_name, image_id or "(image)")
    except ConfigError as e:
        return None, str(e)
    return {"container": cmd.name, "env": cmd.env, "entrypoint": cmd.entrypoint, "args": cmd.args}, ""


def derivation_expectation(
    opts: AuditOptions, inputs: LaneInputs, fleet: Fleet, host: Host, lane_name: str
) -> tuple[dict[str, Any] | None, str]:
    """This rank's derivations (builder.launch.derivplan): each folder and the address it must be made
    for, from the lock and the image's input address (what the bundle's derive.json says too)."""
    assert inputs.pins is not None
    lane = inputs.pins.lanes[lane_name]
    if not lane.derivations:
        return None, f"lane {lane_name!r} has no derivations"
    if inputs.lock is None:
        return None, inputs.lock_reason
    try:
        plan = make_plan(inputs.pins, inputs.lock, lane.image, opts.root)
        runs = derivation_runs(inputs.pins, inputs.lock, fleet, host, lane_name, "(image)", plan.address)
    except ConfigError as e:
        return None, str(e)
    return render_plan(runs, host.rank, len(fleet.hosts)), ""


def build_expectations(
    t: FleetHost, opts: AuditOptions, inputs: LaneInputs, selected: list[Concern]
) -> dict[str, Any]:
    """The expectations file of one host (checks/conftest.py reads it)."""
    concerns = [c.name for c in selected]
    h, f = t.host, t.fleet
    lane_name = f.fleet.lane
    staged = opts.release == "staged"
    bundles = h.paths.bundles.rstrip("/")
    exp: dict[str, Any] = {
        "format": EXPECT_FORMAT,
        "host": {
            "name": h.name,
            "rank": h.rank,
            "role": h.role,
            "connection": h.connection,
            "address": h.address,
        },
        "fleet": f.fleet.name,
        "lane": lane_name,
        "world_size": len(f.hosts),
        "mode": opts.mode,
        "phase": opts.phase,
        "concerns": concerns,
        # a selected concern's checks look at this rank's containers (checklib.docker_objects_command)
        "containers": any(c.containers for c in selected),
        "hash_jobs": opts.hash_jobs,
        "paths": h.paths.model_dump(mode="json"),
        "applied_path": f"{bundles}/{STAGED_RELPATH if staged else APPLIED_RELPATH}",
        "current_path": f"{bundles}/{'staged' if staged else 'current'}",
        "release": opts.release,
        "fabric": h.fabric.model_dump(mode="json"),
        "expect": h.expect.model_dump(mode="json"),
        "serve": None,
        "serve_reason": inputs.pins_reason,
        "launch": None,
        "launch_reason": inputs.pins_reason,
        "lock_hash": inputs.lock_hash,
        "lock_reason": inputs.lock_reason,
        "image": None,
        "image_reason": "",
        "models": None,
        "models_reason": inputs.lock_reason or inputs.pins_reason,
        "derivations": None,
        "derivations_reason": inputs.lock_reason or inputs.pins_reason,
    }
    if inputs.pins is not None:
        lane = inputs.pins.lanes[lane_name]
        exp["serve"] = lane.serve.model_dump(mode="json")
        exp["serve_reason"] = ""
        exp["launch"], exp["launch_reason"] = launch_expectation(inputs.pins, f, h, lane_name, None)
        if inputs.lock is not None:
            models = [m.to_json() for m in place_models(inputs.pins, inputs.lock, lane_name, h)]
            exp["models"] = models
            exp["models_reason"] = "" if models else f"lane {lane_name!r} has no models"
        exp["derivations"], exp["derivations_reason"] = derivation_expectation(opts, inputs, f, h, lane_name)
        if "gates" in concerns and h.rank == 0:
            exp["gates"] = gates_expectation(opts, inputs, f.fleet.name, lane_name)
    if "image" in concerns or "release" in concerns or "burn" in concerns:  # (a burn may run in the image)
        exp["image"], exp["image_reason"] = image_expectation(opts, inputs, lane_name)
    return exp


def gates_expectation(opts: AuditOptions, inputs: LaneInputs, fleet: str, lane_name: str) -> dict[str, Any] | None:
    """The lane's gates, and what the replay is compared with: the fleet's serving records by bundle
    (builder.store.servingrecord), the baseline's bundle (None: the one the head runs), and for each
    record's lock, what changed from it to this lock (the report of a changed replay names it)."""
    assert inputs.pins is not None
    gates = inputs.pins.lanes[lane_name].gates
    if gates is None:
        return None
    recs = servingrecord.records(opts.store, fleet)
    changes: dict[str, list[str]] = {}
    for bundle, rec in recs.items():
        kept = opts.store / "deploy" / "locks" / str(rec.get("lock_hash")) / "pins.lock"
        if inputs.lock is not None and rec.get("lock_hash") != inputs.lock_hash and kept.is_file():
            try:
                changes[bundle] = [f"{c.input}: {c.what}" for c in diff_locks(load_lock(kept), inputs.lock)]
            except ConfigError:
                changes[bundle] = [f"the lock kept at {kept} cannot be read"]
    return {"declared": gates.model_dump(mode="json"), "records": recs, "baseline": opts.baseline,
            "accept_replay": opts.accept_replay, "lock_changes": changes}
