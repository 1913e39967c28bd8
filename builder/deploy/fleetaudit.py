"""A fleet command's audits: `builder audit --fleet F --phase PHASE` over the command's connections, on
the fleet file, pins and lock the command loaded (builder.audit.selection.Loaded), and the words for what failed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from builder.audit.run import run_audit
from builder.audit.selection import AuditOptions, Loaded
from builder.deploy.fleetwork import Fleetwork
from builder.errors import named


def audit(
    w: Fleetwork, phase: str, *, release: str = "current", snapshot: Path | None = None,
    only: list[str] | None = None, hosts: list[str] | None = None, baseline: str | None = None,
) -> Any:
    """The fleet's audit of `phase` over the command's connections (`release`: the installed or the
    staged one; `snapshot`: against the pins and lock kept there, for a rolled-back release; `only`:
    these concerns; `hosts`: only these of the fleet; `baseline`: the bundle whose serving record the
    replay is compared with, the running release's own by default). The fleet file, pins and lock are those the
    command loaded; a rolled-back release's audit reads the pins and lock kept with it."""
    opts, say = w.opts, w.say
    loaded = Loaded(w.fleet_path, w.fleet, None if snapshot else w.ctx.pins, None if snapshot else w.ctx.lock)
    ao = AuditOptions(
        root=snapshot or opts.root,
        pins=(snapshot / "pins.toml") if snapshot else opts.pins,
        lock=(snapshot / "pins.lock") if snapshot else opts.lock,
        store=opts.store,
        hosts_dir=w.ctx.hosts_dir,
        checks_dir=opts.checks_dir or opts.root / "checks",
        fleet=None if hosts else opts.fleet,
        names=[f"{opts.fleet}/{h}" for h in hosts or []],
        mode=opts.audit_mode,
        phase=phase,
        release=release,
        connect_timeout=float(opts.connect_timeout),
        # (the command's folder, "kept" for the audit's length: the command closes them)
        control_dir=w.shared.folder,
        ssh_persist=w.shared.persist,
        only=only,
        loaded=loaded,
        baseline=baseline,
        accept_replay=opts.accept_replay,
    )
    what = {"preflight": "preflight audit (the gate)", "serving": "serving audit", "all": "audit"}[phase]
    say(f"{what} of fleet {opts.fleet}{' (the staged release)' if release == 'staged' else ''}")
    return run_audit(ao, on_host=lambda h: say(f"{h.name}: {what}: {h.status} ({h.seconds:.1f} s)"))


def problems(report: Any) -> str:
    """The hosts that did not pass, and why (an AuditReport, or its JSON)."""
    if isinstance(report, dict):
        hosts = report.get("hosts") or {}
        bad = [named(n, h.get("message") or h.get("status")) for n, h in hosts.items() if h.get("status") != "pass"]
    else:
        bad = [named(h.name, h.first_problem() or h.status) for h in report.hosts if h.status != "pass"]
    return "; ".join(bad[:4]) + (f" (and {len(bad) - 4} more)" if len(bad) > 4 else "")
