"""`builder launch`: what each rank of a fleet will run, without building, shipping or contacting
anything: the ``docker run`` argv exactly as start.sh runs it (the same renderer), the environment the
container gets, its mounts, its readiness and the start order.

The image is named by its ImageID once built; before that by its tag, which carries its input address;
an input the lock cannot yet give (no lock, a stale entry) is named in ``unresolved``, not fatal. What
the recipe never said is listed in ``unknown``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.errors import ConfigError
from builder.image import mounttargets as targets
from builder.image.imagerecord import read_record, tag_for
from builder.image.plan import make_plan
from builder.inputs.hosts import Fleet, Host, find_fleet, find_host
from builder.inputs.loader import did_you_mean
from builder.inputs.pins import Pins, PublishedImage, load_pins
from builder.launch import memory_floor
from builder.launch.derivplan import derivation_runs, derived_paths
from builder.launch.order import start_order, stop_groups
from builder.launch.rank import rank_command
from builder.lock.lockfile import Lock, load_lock


@dataclass
class LaunchOptions:
    root: Path
    pins: Path
    lock: Path
    store: Path
    hosts_dir: Path
    fleet: str | None = None
    host: str | None = None
    lane: str | None = None


def image_reference(
    pins: Pins, lock: Lock | None, name: str, root: Path, store: Path
) -> tuple[dict[str, Any], list[str]]:
    """The lane's image as start.sh will name it, and what is unresolved about it."""
    img = pins.images[name]
    if isinstance(img, PublishedImage):
        return {"name": name, "ref": img.published, "state": "published"}, []
    if lock is None:
        return {"name": name, "ref": f"builder/{name}:(unlocked)", "state": "unlocked"}, [
            "the lock (run `builder lock`): the image has no input address yet"]
    try:
        plan = make_plan(pins, lock, name, root)
    except ConfigError as e:
        return {"name": name, "ref": f"builder/{name}:(unlocked)", "state": "unlocked"}, [str(e)]
    rec = read_record(store, plan.address)
    if rec is not None:
        return {"name": name, "ref": rec.image_id, "state": "built", "input_address": plan.address}, []
    return {"name": name, "ref": tag_for(name, plan.address), "state": "not built",
            "input_address": plan.address}, []


def _fleet(opts: LaunchOptions) -> tuple[Fleet, list[Host]]:
    if opts.host is not None:
        _, fleet, host = find_host(opts.hosts_dir, opts.host)
        return fleet, [host]
    if opts.fleet is None:
        raise ConfigError("name a host or --fleet")
    _, fleet = find_fleet(opts.hosts_dir, opts.fleet)
    return fleet, fleet.by_rank()


def launch(opts: LaunchOptions) -> dict[str, Any]:
    pins = load_pins(opts.pins)
    fleet, hosts = _fleet(opts)
    lane_name = opts.lane or fleet.fleet.lane
    if lane_name not in pins.lanes:
        raise ConfigError(f"{opts.pins}: no lane named {lane_name!r}{did_you_mean(lane_name, pins.lanes)} "
                          f"(have: {', '.join(sorted(pins.lanes))})")
    lane = pins.lanes[lane_name]
    if lane.serve.tensor_parallel != len(fleet.hosts):
        raise ConfigError(f"fleet {fleet.fleet.name} has {len(fleet.hosts)} hosts but lane {lane_name} has "
                          f"tensor_parallel = {lane.serve.tensor_parallel}")
    unresolved: list[str] = []
    lock: Lock | None = None
    if opts.lock.exists():
        lock = load_lock(opts.lock)
    image, why = image_reference(pins, lock, lane.image, opts.root, opts.store)
    unresolved += why
    rec = read_record(opts.store, image["input_address"]) if image["state"] == "built" else None
    mount_targets = targets.check(pins, lane_name, rec)  # (ConfigError: a mount that would add a file)
    if lock is not None:
        for kind, names in pins.closure([lane_name]).items():
            for n in sorted(names):
                if n not in getattr(lock, kind, {}):
                    unresolved.append(f"{kind}.{n}: not in the lock")
    out_hosts = []
    for h in hosts:
        runs = derivation_runs(pins, lock, fleet, h, lane_name, image["ref"], image.get("input_address"))
        cmd = rank_command(pins, fleet, h, lane_name, image["ref"], derived_paths(runs))
        out_hosts.append({"host": h.name, "rank": h.rank, "role": h.role, **cmd.to_json(),
                          "min_available_gib": int(memory_floor(lane, h) or 0) or None,
                          "derivations": [r.to_json() for r in runs]})
    shown = {h.name for h in hosts}
    return {
        "fleet": fleet.fleet.name,
        "lane": lane_name,
        "start": lane.start,
        "start_order": [h.name for h in start_order(fleet, lane) if h.name in shown],
        "stop_order": [h.name for g in stop_groups(fleet) for h in g if h.name in shown],
        "start_timeout": lane.start_timeout,
        "health": {"path": lane.health, "port": lane.serve.port},
        "image": image,
        "hosts": out_hosts,
        "derivations": {n: d.model_dump(mode="json") for n, d in lane.derivations.items()},
        "mount_targets": mount_targets,
        "unresolved": unresolved,
        "unknown": list(lane.unknown),
    }
