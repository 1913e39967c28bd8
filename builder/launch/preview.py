"""`builder launch`: what each rank of a fleet will run, without building, shipping or contacting
anything: the ``docker run`` argv exactly as start.sh runs it (the same renderer), the environment the
container gets, its mounts, its readiness and the start order.

The image is named by its ImageID once built; before that by its tag, which carries its input address;
an input the lock cannot yet give (no lock, a stale entry) is named in ``unresolved``, not fatal. What
the recipe never said is listed in ``unknown``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.errors import ConfigError
from builder.image import mounttargets as targets
from builder.image.imagerecord import read_record, tag_for
from builder.image.plan import make_plan
from builder.inputs.hosts import Fleet, Host, find_fleet, find_host
from builder.inputs.lanes import Lane
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
    lane = _lane(opts, pins, fleet, lane_name)
    unresolved: list[str] = []
    lock: Lock | None = None
    if opts.lock.exists():
        lock = load_lock(opts.lock)
    image, why = image_reference(pins, lock, lane.image, opts.root, opts.store)
    unresolved += why
    rec = read_record(opts.store, image["input_address"]) if image["state"] == "built" else None
    mount_targets = targets.check(pins, lane_name, rec)  # (ConfigError: a mount that would add a file)
    if lock is not None:
        unresolved += _not_locked(pins, lock, lane_name)
    out_hosts = [_host_entry(pins, lock, fleet, h, lane_name, image) for h in hosts]
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


def _lane(opts: LaunchOptions, pins: Pins, fleet: Fleet, lane_name: str) -> Lane:
    """The lane the fleet runs (or ``--lane``), with as many ranks as the fleet has hosts."""
    if lane_name not in pins.lanes:
        raise ConfigError(f"{opts.pins}: no lane named {lane_name!r}{did_you_mean(lane_name, pins.lanes)} "
                          f"(have: {', '.join(sorted(pins.lanes))})")
    lane = pins.lanes[lane_name]
    if lane.serve.tensor_parallel != len(fleet.hosts):
        raise ConfigError(f"fleet {fleet.fleet.name} has {len(fleet.hosts)} hosts but lane {lane_name} has "
                          f"tensor_parallel = {lane.serve.tensor_parallel}")
    return lane


def _not_locked(pins: Pins, lock: Lock, lane_name: str) -> list[str]:
    """The lane's inputs the lock does not hold, each one line."""
    return [f"{kind}.{n}: not in the lock" for kind, names in pins.closure([lane_name]).items()
            for n in sorted(names) if n not in getattr(lock, kind, {})]


def _host_entry(pins: Pins, lock: Lock | None, fleet: Fleet, h: Host, lane_name: str,
                image: dict[str, Any]) -> dict[str, Any]:
    """What one rank runs: its command, its memory floor and its derivations."""
    lane = pins.lanes[lane_name]
    runs = derivation_runs(pins, lock, fleet, h, lane_name, image["ref"], image.get("input_address"))
    cmd = rank_command(pins, fleet, h, lane_name, image["ref"], derived_paths(runs))
    return {"host": h.name, "rank": h.rank, "role": h.role, **cmd.to_json(),
            "min_available_gib": int(memory_floor(lane, h) or 0) or None,
            "derivations": [r.to_json() for r in runs]}


def ready_text(ready: dict[str, Any]) -> str:
    """A rank's readiness (rank.ready_spec's) in words."""
    kind = ready.get("kind")
    if kind == "health":
        text = f"HTTP 200 from {ready['path']} on port {ready['port']}"
    elif kind == "port":
        text = f"a TCP listener on 127.0.0.1:{ready['port']}"
    elif kind == "log":
        text = f"a log line matching {ready['pattern']}"
    else:
        text = "running for 3 s"
    return text + ("; until then it waits for a peer" if ready.get("peer") else "")


def in_start_order(out: dict[str, Any]) -> list[dict[str, Any]]:
    """launch()'s hosts in the lane's start order."""
    by_name = {h["host"]: h for h in out["hosts"]}
    return [by_name[n] for n in out["start_order"] if n in by_name]


def shell_lines(out: dict[str, Any]) -> list[str]:
    """launch() as a shell script's lines: what each rank runs, in the order the ranks start; every
    line but the `docker run`s (and each derivation's) a comment."""
    img = out["image"]
    lines = [
        f"# fleet {out['fleet']}, lane {out['lane']}: image {img['name']} ({img['state']}) {img['ref']}",
        f"# start order ({out['start']}): {' -> '.join(out['start_order'])}; the lane is ready when "
        f"{out['health']['path']} answers on port {out['health']['port']} (at most {out['start_timeout']} s a "
        f"rank); stop order: {' -> '.join(out['stop_order'])}",
    ]
    if out["mount_targets"]["state"] != "none":
        lines.append(f"# mount targets: {out['mount_targets']['state']} ({out['mount_targets']['why']})")
    for i, h in enumerate(in_start_order(out), 1):
        floor = f"; refused below {h['min_available_gib']} GiB MemAvailable" if h["min_available_gib"] else ""
        lines += ["", f"# {i}. {h['host']}: rank {h['rank']} ({h['role']}), ready: {ready_text(h['ready'])}{floor}"]
        lines += [f"#   {k}={v}" for k, v in h["env"].items()]
        for d in h.get("derivations") or []:
            lines.append(f"#   derivation {d['name']} (made before start, into {d['path']}): {shlex.join(d['argv'])}")
        lines.append(shlex.join(h["argv"]))
    lines += [f"# unresolved: {why}" for why in out["unresolved"]]
    lines += [f"# UNKNOWN: {what}" for what in out["unknown"]]
    return lines


def table_rows(out: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """launch() as a table: one row per rank, in the order the ranks start."""
    cols = ["start", "host", "rank", "role", "container", "ready", "derivations", "command"]
    rows = []
    for i, h in enumerate(in_start_order(out), 1):
        image_at = h["argv"].index(out["image"]["ref"]) if out["image"]["ref"] in h["argv"] else len(h["argv"])
        rows.append([str(i), h["host"], str(h["rank"]), h["role"], h["container"], ready_text(h["ready"]),
                     ", ".join(d["name"] for d in h.get("derivations") or []) or "-",
                     shlex.join(h["argv"][image_at:])])
    return cols, rows
