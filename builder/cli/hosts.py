"""`builder hosts`: list fleets and hosts; write an Ansible inventory."""

from __future__ import annotations

from pathlib import Path

import click

from builder import output
from builder.cli import get_ctx
from builder.cli.options import file_option, fleet_option, hosts_dir_option, json_option
from builder.errors import EXIT_CONFIG
from builder.inputs import hosts as core
from builder.inputs.ansible import write_ansible_inventory


@click.command()
@fleet_option("Only this fleet.", default=None)
@json_option("Print the hosts as JSON on stdout.")
@file_option("--ansible", "ansible",
             help="Write an Ansible inventory here (*.yml/*.yaml or *.ini) with rank and role as host vars.")
@hosts_dir_option
def hosts(fleet: str | None, as_json: bool, ansible: Path | None, hosts_dir: Path | None) -> int:
    """List the fleets and hosts of hosts/*.toml (validated), or write them as an Ansible inventory."""
    c = get_ctx()
    hdir = core.hosts_folder(c.root, hosts_dir)
    if ansible is not None:
        n = write_ansible_inventory(hdir, fleet, ansible)
        output.status(f"{ansible}: {n} host(s)")
        return 0
    rows, errors = core.host_rows(hdir, fleet)
    if as_json:
        output.data_json(rows)
    else:
        for r in rows:
            output.data(
                f"{r['fleet']}\t{r['name']}\trank {r['rank']}\t{r['role']}\t{r['connection']}\t{r['target']}"
            )
    for line in errors:  # (the fleets that validate are listed; each file that does not is named, exit 2)
        output.error(line)
    return EXIT_CONFIG if errors else 0
