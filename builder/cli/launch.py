"""`builder launch`: thin command over builder.launch.preview."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from builder import output
from builder.cli import get_ctx
from builder.cli.options import fleet_option, hosts_dir_option, json_option
from builder.errors import ConfigError
from builder.inputs.hosts import hosts_folder
from builder.launch.preview import LaunchOptions
from builder.launch.preview import launch as core


@click.command()
@click.argument("host", required=False)
@fleet_option("Every host of this fleet, in rank order.", default=None)
@click.option("--lane", "lane", metavar="NAME", default=None, help="This lane instead of the fleet's own.")
@json_option("Print the launch as JSON on stdout.")
@hosts_dir_option
def launch(host: str | None, fleet: str | None, lane: str | None, as_json: bool, hosts_dir: Path | None) -> int:
    """Show what each rank will run, without building, shipping or contacting anything.

    For HOST (or fleet/host), or every host of --fleet: the `docker run` exactly as start.sh runs it,
    the container's environment, its mounts and readiness, and the lane's start order.
    """
    if (host is None) == (fleet is None):
        raise ConfigError("builder launch: name a HOST or --fleet NAME (one of them)")
    c = get_ctx()
    out = core(LaunchOptions(root=c.root, pins=c.pins, lock=c.lock, store=c.store,
                             hosts_dir=hosts_folder(c.root, hosts_dir), fleet=fleet, host=host, lane=lane))
    if as_json:
        output.data_json(out)
        return 0
    img = out["image"]
    output.data(f"# fleet {out['fleet']}, lane {out['lane']}: image {img['name']} ({img['state']}) {img['ref']}")
    output.data(f"# start order ({out['start']}): {' -> '.join(out['start_order'])}; the lane is ready when "
                f"{out['health']['path']} answers on port {out['health']['port']} "
                f"(at most {out['start_timeout']} s a rank); stop order: {' -> '.join(out['stop_order'])}")
    if out["mount_targets"]["state"] != "none":
        output.data(f"# mount targets: {out['mount_targets']['state']} ({out['mount_targets']['why']})")
    for h in out["hosts"]:
        floor = f", refused below {h['min_available_gib']} GiB MemAvailable" if h["min_available_gib"] else ""
        output.data(f"\n# {h['host']}: rank {h['rank']} ({h['role']}), ready: {h['ready']}{floor}")
        for k, v in h["env"].items():
            output.data(f"#   {k}={v}")
        output.data(shlex.join(h["argv"]))
        for d in h.get("derivations") or []:
            output.data(f"#   derivation {d['name']} (made before start, into {d['path']}): "
                        + shlex.join(d["argv"]))
    for why in out["unresolved"]:
        output.data(f"# unresolved: {why}")
    for what in out["unknown"]:
        output.data(f"# UNKNOWN: {what}")
    return 0
