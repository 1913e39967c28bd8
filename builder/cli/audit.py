"""`builder audit`: thin command over builder.audit."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from builder import output
from builder.audit.concerns import declared
from builder.audit.exits import describe_cause
from builder.audit.findings import AuditReport, HostResult, burn_rows, matrix_rows, problem_rows, write_junit
from builder.audit.run import run_audit
from builder.audit.selection import PACKAGE_CHECKS, AuditOptions, audit_targets, parse_only
from builder.cli import get_ctx
from builder.cli.options import (
    checks_option,
    choice_option,
    file_option,
    fleet_option,
    hosts_dir_option,
    json_option,
    mode_option,
    ssh_persist_option,
)
from builder.errors import BuilderError, named

if TYPE_CHECKING:
    from builder.inputs.hosts import FleetHost


def only_help() -> str:
    """--only's help, naming the concerns the check modules beside this package declare."""
    names = [c.name for c in declared(PACKAGE_CHECKS)] if PACKAGE_CHECKS.is_dir() else []
    return "Comma-separated concerns" + (f": {', '.join(names)}." if names else " (the checks folder's test_NAME.py).")


@click.command()
@click.argument("hosts", nargs=-1)
@fleet_option("Audit every host of this fleet (hosts/*.toml).", default=None)
@mode_option("Models: fast = size, mtime, inode against the apply record; full = sha256 on the host.")
@choice_option("--phase", choices=["preflight", "serving", "all"], default="preflight",
               help="preflight = before start; serving = the API after start; all = both.")
@click.option("--only", "only", default=None, metavar="CONCERNS", help=only_help())
@json_option("Print per-host, per-check results as JSON on stdout.")
@file_option("--junit", "junit", help="Write a JUnit XML report (one testsuite per host).")
@choice_option("--backend", choices=["native", "ansible"], default="native",
               help="native = testinfra ssh/docker/local per host; ansible = testinfra's Ansible backend.")
@file_option("--inventory", help="Ansible inventory for --backend ansible (from `builder hosts --ansible FILE`).")
@hosts_dir_option
@checks_option
@click.option("--connect-timeout", type=float, default=8.0, show_default=True,
              help="Seconds to wait for a host to answer before calling it unreachable.")
@click.option("--timeout", "host_timeout", type=float, default=900.0, show_default=True,
              help="Seconds all checks of one host may take.")
@ssh_persist_option("Keep each host's ssh connection open this long after the audit, for the next audit to "
                    "reuse (0: each connection is this audit's own, closed when its host is done).")
@click.option("--hash-jobs", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Files hashed in parallel on each host in --mode full.")
def audit(
    hosts: tuple[str, ...],
    fleet: str | None,
    mode: str,
    phase: str,
    only: str | None,
    as_json: bool,
    junit: Path | None,
    backend: str,
    inventory: Path | None,
    hosts_dir: Path | None,
    checks_dir: Path | None,
    connect_timeout: float,
    host_timeout: float,
    hash_jobs: int,
    ssh_persist: float,
) -> int:
    """Check that hosts match the lock and inventory (testinfra; hosts in parallel).

    Exit 0 all pass, 1 drift, 2 usage or configuration error (no host contacted), 3 a host unreachable.
    """
    c = get_ctx()
    opts = AuditOptions(
        root=c.root,
        pins=c.pins,
        lock=c.lock,
        store=c.store,
        hosts_dir=hosts_dir,
        names=list(hosts),
        fleet=fleet,
        mode=mode,
        phase=phase,
        only=parse_only(only),
        backend=backend,
        inventory=inventory,
        checks_dir=checks_dir,
        connect_timeout=connect_timeout,
        host_timeout=host_timeout,
        hash_jobs=hash_jobs,
        ssh_persist=ssh_persist,
    )

    # fast mode is done in seconds: no bars; full mode hashes every model file on each host
    full = mode == "full"
    bars: Any = output.progress(unit="items") if full else contextlib.nullcontext()
    with bars as bar:
        tasks: dict[str, int] = {}
        if full:
            tasks = {t.name: bar.add_task(f"audit {t.name} (full)", total=1) for t in _targets(opts)}

        def on_host(h: HostResult) -> None:
            output.status(f"{h.name}: {h.status} ({h.seconds:.1f} s)")
            if h.name in tasks:
                bar.update(tasks[h.name], description=f"audit {h.name}: {h.status}", advance=1)

        report = run_audit(opts, on_host=on_host)
    _print(report, as_json)
    if junit is not None:
        write_junit(report, junit)
    n_bad = sum(1 for h in report.hosts if h.status != "pass")
    output.status(f"{len(report.hosts)} host(s), {n_bad} not passing, {report.seconds:.1f} s")
    return report.exit_code


def _print(report: AuditReport, as_json: bool) -> None:
    """The report: the matrix, the burn and every reason a host did not pass as tables on stdout (or
    the JSON, and the reasons on stderr for the person watching); what it means on stderr."""
    if as_json:
        output.data_json(report.to_json())
        for h in report.hosts:  # (for the person watching: stdout is the script's)
            for p in h.problems():
                output.status(named(h.name, p["message"], h.status + (f": {p['check']}" if p["check"] else "")))
    else:
        output.table(f"audit ({report.mode}, {report.phase})", *matrix_rows(report))
        if report.burn():
            output.table("burn", *burn_rows(report))
        cols, rows = problem_rows(report)
        if rows:  # every reason, not only the first: the matrix says which check, this says why
            output.table("not passing", cols, rows)
    if report.burn():
        for name, why in report.burn()["outliers"].items():
            output.status(f"{name}: burn: {why}")
    if report.mode == "fast":
        output.status("fast mode: model, kit, Engram and derived files are vouched for by the size, mtime and inode "
                      "recorded when each was last hashed (at install, or when its derivation was made), not hashed "
                      "now; `builder audit --mode full` hashes every one")
    if report.first_exit:
        output.status(f"a rank's engine exited: {describe_cause(report.first_exit)}")


def _targets(opts: AuditOptions) -> list[FleetHost]:
    """The hosts the audit will reach, for their progress bars; none when the selection is wrong
    (run_audit then names the problem, in its own order of checks)."""
    try:
        return audit_targets(opts)
    except BuilderError:
        return []
