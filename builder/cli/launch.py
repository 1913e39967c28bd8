"""`builder launch`: thin command over builder.launch.preview."""

from __future__ import annotations

from pathlib import Path

import click

from builder import output
from builder.cli import get_ctx
from builder.cli.options import fleet_option, hosts_dir_option, json_option
from builder.errors import ConfigError
from builder.inputs.hosts import hosts_folder
from builder.launch.preview import LaunchOptions, shell_lines, table_rows
from builder.launch.preview import launch as core


@click.command()
@click.argument("host", required=False)
@fleet_option("Every host of this fleet, in rank order.", default=None)
@click.option("--lane", "lane", metavar="NAME", default=None, help="This lane instead of the fleet's own.")
@click.option("--table", "as_table", is_flag=True, help="One row per rank, in start order, instead of the shell form.")
@json_option("Print the launch as JSON on stdout.")
@hosts_dir_option
def launch(host: str | None, fleet: str | None, lane: str | None, as_table: bool, as_json: bool,
           hosts_dir: Path | None) -> int:
    """Show what each rank will run, without building, shipping or contacting anything.

    For HOST (or fleet/host), or every host of --fleet, in the lane's start order: the `docker run`
    exactly as start.sh runs it, the container's environment, its readiness, and its derivations (the
    shell form); --table gives one row per rank, --json the whole of it for scripts.
    """
    if (host is None) == (fleet is None):
        raise ConfigError("builder launch: name a HOST or --fleet NAME (one of them)")
    c = get_ctx()
    out = core(LaunchOptions(root=c.root, pins=c.pins, lock=c.lock, store=c.store,
                             hosts_dir=hosts_folder(c.root, hosts_dir), fleet=fleet, host=host, lane=lane))
    if as_json:
        output.data_json(out)
    elif as_table:
        img = out["image"]
        output.table(f"fleet {out['fleet']}, lane {out['lane']}: image {img['name']} ({img['state']}) {img['ref']}",
                     *table_rows(out))
        for why in out["unresolved"]:
            output.warn(f"unresolved: {why}")
        for what in out["unknown"]:
            output.warn(f"UNKNOWN: {what}")
    else:
        for line in shell_lines(out):
            output.data(line)
    return 0
