"""`builder deploy`, `builder status`, `builder start`, `builder stop`: thin commands over builder.deploy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import click

from builder import output
from builder.cli import get_ctx
from builder.cli.options import (
    allow_outside_key_option,
    checks_option,
    file_option,
    fleet_option,
    hosts_dir_option,
    insecure_option,
    json_option,
    mode_option,
    part_size_option,
    ssh_persist_option,
    together,
)
from builder.deploy import rollout, startstop
from builder.deploy.options import DeployOptions
from builder.deploy.report import DeployReport
from builder.deploy.status import fleet_status, rows
from builder.errors import named, unnamed

#: the fleet commands' defaults are the core's own (DeployOptions): a caller without this command line
#: gets the same
_DEFAULT = {f.name: f.default for f in fields(DeployOptions)}


def _stop_timeout_option(what: str) -> Callable[[Any], Any]:
    return click.option(
        "--stop-timeout", type=click.IntRange(1, 3600), default=_DEFAULT["stop_timeout"], show_default=True,
        help=f"Seconds docker gives {what} to stop before it is killed.",
    )


#: the options every fleet command shares
_fleet_options = together(
    fleet_option("The fleet (hosts/*.toml).", required=True),
    json_option(),
    hosts_dir_option,
    click.option(
        "--connect-timeout", type=click.IntRange(1, 600), default=_DEFAULT["connect_timeout"], show_default=True,
        help="Seconds a host may take to answer before it counts as unreachable.",
    ),
    click.option(
        "--timeout", "timeout", type=click.FloatRange(min=1), default=_DEFAULT["timeout"], show_default=True,
        help="Base seconds of every remote call (transfers add size / 1 MiB/s).",
    ),
    ssh_persist_option("Keep each host's ssh connection open this long after the command, for the next command "
                       "or audit to reuse (0: closed at the end)."),
)

#: the options of the commands that start ranks and audit them
_run_options = together(
    click.option(
        "--start-timeout", type=click.FloatRange(min=1), default=None,
        help="Seconds each rank may take to be ready after its start (default: the lane's start_timeout).",
    ),
    _stop_timeout_option("each container of the running release"),
    mode_option("The audits' mode (full hashes every model file on the hosts)."),
    checks_option,
)


def _options(
    fleet: str, hosts_dir: Path | None, connect_timeout: int, timeout: float, ssh_persist: float
) -> DeployOptions:
    """The options every fleet command shares, on the project's pins, lock and store."""
    c = get_ctx()
    return DeployOptions(
        root=c.root, pins=c.pins, lock=c.lock, store=c.store, fleet=fleet, hosts_dir=hosts_dir,
        connect_timeout=connect_timeout, timeout=timeout, ssh_persist=ssh_persist,
    )


def _say(line: str) -> None:
    output.status(line)


def _print(rep: DeployReport, as_json: bool) -> int:
    rows = []
    for h in rep.hosts:
        rows.append([
            h.host, f"{h.rank} ({h.role})", (h.origin or "none")[:12], (h.target or "-")[:12], h.result, h.on,
            unnamed(h.host, h.message),
        ])
    if not as_json:
        output.table(f"{rep.command} {rep.fleet} (lane {rep.lane})", ["host", "rank", "from", "to", "result", "on",
                                                                       "message"], rows)
    if not as_json:  # a plan is data: on stdout
        for h in rep.hosts:
            for line in h.plan:
                output.data(named(h.host, line))
        for i, step in enumerate(rep.steps, 1):
            output.data(f"  {i}. {step}")
        for line in rep.unknown:
            output.data(f"  not known without the hosts: {line}")
    output.status(f"{rep.command}: {rep.result}: {rep.reason} ({rep.seconds:.1f} s)")
    if as_json:
        output.data_json(rep.to_json())
    return int(rep.exit_code)


@click.command()
@_fleet_options
@_run_options
@click.option("--dry-run", is_flag=True, help="Print the plan, asking each host what it runs; change nothing.")
@click.option(
    "--plan", "plan_only", is_flag=True,
    help="Print the plan from the lock and the fleet file alone, contacting no host, and what it could not "
    "know; change nothing.",
)
@file_option(
    "--key", "key", help="Signing key for bundles made again [default: $BUILDER_SIGNING_KEY, else keys/builder.key "
    "under the project root]."
)
@allow_outside_key_option
@click.option(
    "--with-image", is_flag=True,
    help="Bundles made again carry the image (for hosts that lack it: a first deploy, a new image).",
)
@click.option(
    "--with-models", is_flag=True, help="Bundles made again carry the rank's model files (for hosts that lack them)."
)
@part_size_option
@click.option(
    "--parallel", type=click.IntRange(1, 64), default=_DEFAULT["parallel"], show_default=True,
    help="Hosts staged at once.",
)
@click.option(
    "--repair", is_flag=True,
    help="Hash every installed file on every host (in any --mode); place again, from the verified bundle, "
    "each model, kit, Engram and launch file that differs, make again each derivation that differs from "
    "its record, reinstall the release on those hosts (and where only the apply record drifted), then "
    "restart in order and audit.",
)
@click.option(
    "--accept-replay", is_flag=True,
    help="The new release may answer the replay prompts differently from the running one: its answers pass "
    "and become the baseline the next deploy is compared with.",
)
@insecure_option
def deploy(
    fleet: str, as_json: bool, hosts_dir: Path | None, connect_timeout: int, timeout: float, ssh_persist: float,
    start_timeout: float | None, stop_timeout: int, mode: str, checks_dir: Path | None, dry_run: bool,
    plan_only: bool, key: Path | None, allow_outside_key: bool, with_image: bool, with_models: bool, part_size: str,
    parallel: int, insecure: bool, repair: bool, accept_replay: bool,
) -> int:
    """Move fleet NAME to the lock: bundle, stage everywhere, make the derivations, audit (the gate),
    stop the head then the workers, switch, start in the lane's order, wait for the API, audit it
    serving; on any failure after the first switch, roll every host back and start and audit that.
    With --repair, every file that differs in content from its bundle or record is placed or made again
    and those hosts reinstalled (nothing to repair: it says so). The serving audit asks the lane's gates
    and replays its prompts against the running release's answers; --accept-replay takes a changed answer.

    Exit 0 deployed (or nothing to do and the audit passes), 1 refused, rolled back or failed,
    2 configuration error (nothing changed), 3 a host could not be reached.
    """
    opts = replace(
        _options(fleet, hosts_dir, connect_timeout, timeout, ssh_persist), checks_dir=checks_dir, key=key,
        allow_outside_key=allow_outside_key, with_image=with_image, with_models=with_models, part_size=part_size,
        dry_run=dry_run, plan=plan_only, parallel=parallel, start_timeout=start_timeout or 0.0,
        stop_timeout=stop_timeout, audit_mode=mode, insecure=insecure, repair=repair, accept_replay=accept_replay,
    )
    return _print(rollout.deploy(opts, _say), as_json)


@click.command()
@_fleet_options
@_run_options
def start(
    fleet: str, as_json: bool, hosts_dir: Path | None, connect_timeout: int, timeout: float, ssh_persist: float,
    start_timeout: float | None, stop_timeout: int, mode: str, checks_dir: Path | None,
) -> int:
    """Start fleet NAME's installed release: its derivations made where missing, the preflight audit
    (it refuses while another GPU workload runs), then the ranks in the lane's order, each until ready;
    wait for the API; the serving audit. A fleet partly up is stopped first (the head, then the
    workers)."""
    opts = replace(
        _options(fleet, hosts_dir, connect_timeout, timeout, ssh_persist), checks_dir=checks_dir,
        start_timeout=start_timeout or 0.0, stop_timeout=stop_timeout, audit_mode=mode,
    )
    return _print(startstop.start(opts, _say), as_json)


@click.command()
@_fleet_options
@_stop_timeout_option("each container")
def stop(
    fleet: str, as_json: bool, hosts_dir: Path | None, connect_timeout: int, timeout: float, ssh_persist: float,
    stop_timeout: int,
) -> int:
    """Stop fleet NAME's lane: the head first, then the workers; only the lane's own containers."""
    opts = replace(_options(fleet, hosts_dir, connect_timeout, timeout, ssh_persist), stop_timeout=stop_timeout)
    return _print(startstop.stop(opts, _say), as_json)


@click.command()
@_fleet_options
def status(
    fleet: str, as_json: bool, hosts_dir: Path | None, connect_timeout: int, timeout: float, ssh_persist: float
) -> int:
    """Show, per host of fleet NAME, which bundle, lock and image it runs and whether its rank is up.

    Exit 0 every rank up on the lock, 1 not (a rank down, another lock, a deploy or rollback that did
    not finish), 3 a host could not be reached."""
    st = fleet_status(_options(fleet, hosts_dir, connect_timeout, timeout, ssh_persist))
    cols, body = rows(st)
    if not as_json:
        output.table(f"fleet {st.fleet} (lane {st.lane}, lock {st.lock_hash[:12]})", cols, body)
    for h in sorted(st.hosts, key=lambda h: h.exited != "first"):  # (the rank that exited first: the cause, first)
        if h.message:
            output.status(named(h.host, h.message))
    if st.deploy:
        output.warn(st.deploy)
    output.status(f"{st.summary} ({st.seconds:.1f} s)")
    if as_json:
        output.data_json(st.to_json())
    return st.exit_code
