"""`builder start` and `builder stop`: a fleet's installed release, in rank order, under the fleet lock.

Start: the derivations the installed release lacks, then the preflight audit; a fleet partly up is
stopped first (a new worker never joins an old head); the ranks in the lane's order, each until it is
ready; wait for the API; the serving audit. A rollback that did not finish (its journal, every host
back on its old release) is finished by start: audited against the pins and lock that release was
deployed from, then the journal is removed; any other unfinished deploy is left to `builder deploy`.
Stop: the head first, then the workers; only the lane's containers.
"""

from __future__ import annotations

from pathlib import Path

from builder.deploy import journal as J
from builder.deploy.derivations import make_all
from builder.deploy.fleetaudit import audit, problems
from builder.deploy.fleetwork import Fleetwork, explain, fleet_command
from builder.deploy.options import DeployOptions, Say, command
from builder.deploy.rankorder import start_all, stop_all
from builder.deploy.report import DeployReport, FleetResult, outcomes
from builder.deploy.servingrecords import keep
from builder.errors import named


def start(opts: DeployOptions, say: Say = lambda _: None) -> DeployReport:
    """Start the installed release of every host in rank order (workers, then the head), after the
    preflight audit; a fleet partly up is stopped first (a new worker never joins an old head)."""
    with fleet_command(opts, say, "start") as (w, rep):
        _start(w, rep)
    return rep


def _start(w: Fleetwork, rep: DeployReport) -> None:
    if not _installed_everywhere(w, rep):
        return
    # an interrupted rollback (its journal, every host back on its old release): finished here, the
    # old release started and audited against the pins and lock it was deployed from
    j = J.load(w.opts.store, w.fleet_name)
    snap: Path | None = None
    if j is not None:
        finishing, snap = _finishing_rollback(w, rep, j)
        if not finishing:
            return
    if all(w.states[h.name].up_on(w.states[h.name].installed) for h in w.hosts) and w.states[w.head.name].healthy:
        w.say(f"fleet {w.fleet_name}: every rank is up already")
        for h in w.hosts:
            rep.host(h.name).result = "unchanged"
    elif not _bring_up(w, rep, snap):
        return
    if not _audit(w, rep, "serving", "failed", "started, but the serving audit fails", snap):
        return
    keep(w, rep.audit or {}, w.states[w.head.name].installed)
    if j is not None:
        J.clear(w.opts.store, w.fleet_name)  # the rollback is finished: the old release serves, audited
    rep.result, rep.reason = "started", "every rank is up and the fleet passes its serving audit"


def _installed_everywhere(w: Fleetwork, rep: DeployReport) -> bool:
    """Every host answers and has a release installed; else the report says which do not, and False."""
    failed = w.probe()
    for name, why in failed.items():
        rep.host(name).result, rep.host(name).message = "unreachable", why
    if failed:
        rep.result, rep.reason, rep.unreachable = "refused", "not every host answered; nothing was started", True
        return False
    missing = [h.name for h in w.hosts if w.states[h.name].installed is None]
    for h in w.hosts:
        o, st = rep.host(h.name), w.states[h.name]
        o.origin = o.target = st.installed
        o.on = "none" if st.installed is None else "old"
    if missing:
        rep.result = "refused"
        rep.reason = f"no release installed on {', '.join(missing)} (run `{command(w.opts, 'deploy')}`)"
        return False
    return True


def _finishing_rollback(w: Fleetwork, rep: DeployReport, j: J.Journal) -> tuple[bool, Path | None]:
    """Whether start may finish the unfinished deploy of journal ``j`` (a rollback with every host back on
    its old release; else the report refuses), and the snapshot of the pins and lock that release was
    deployed from, when its hosts agree on one."""
    back = J.rolling_back(j) and all(w.states[h.name].installed == j.origin.get(h.name) for h in w.hosts)
    if not back:
        rep.result = "refused"
        rep.reason = (f"a deploy did not finish (it stopped while {j.phase}); run `{command(w.opts, 'deploy')}`:"
                      " it moves every host to the new release or back to the old one")
        return False, None
    locks = {j.origin_locks.get(h.name) for h in w.hosts}
    snap = J.find_snapshot(w.opts.store, locks.pop()) if len(locks) == 1 else None
    w.say(f"fleet {w.fleet_name}: finishing a rollback that did not finish (it stopped while {j.phase})")
    return True, snap


def _bring_up(w: Fleetwork, rep: DeployReport, snap: Path | None) -> bool:
    """The derivations the installed release lacks, the preflight audit, a fleet partly up stopped, then
    every rank started in order; False (the report saying why) when a step fails."""
    failed = make_all(w, "current")
    if failed:
        for name, why in failed.items():
            rep.host(name).result, rep.host(name).message = "failed", why
        rep.result = "refused"
        rep.reason = "making the derivations failed; nothing was started: " + "; ".join(
            named(n, why) for n, why in failed.items())
        return False
    if not _audit(w, rep, "preflight", "refused", "the preflight audit failed; nothing was started", snap):
        return False
    if any(w.states[h.name].containers for h in w.hosts):
        stopped = stop_all(w)  # a fleet partly up: stop every rank first, head first
        if stopped:
            rep.result, rep.reason = "failed", "; ".join(named(n, why) for n, why in stopped.items())
            return False
    try:
        start_all(w)
    except Exception as e:
        rep.result, rep.reason = "failed", explain(e)
        return False
    for h in w.hosts:
        rep.host(h.name).result = "started"
    return True


def _audit(
    w: Fleetwork, rep: DeployReport, phase: str, result: FleetResult, why: str, snapshot: Path | None = None
) -> bool:
    """The fleet's audit of `phase`, recorded in the report; on a failure, the report's `result` and
    `why` (with the hosts that failed), and False."""
    report = audit(w, phase, snapshot=snapshot)
    rep.audit = report.to_json()
    if report.exit_code == 0:
        return True
    rep.result, rep.unreachable = result, report.exit_code == 3
    rep.reason = f"{why}: {problems(report)}"
    return False


def stop(opts: DeployOptions, say: Say = lambda _: None) -> DeployReport:
    """Stop the lane's containers on every host: the head first, then the workers (only the lane's)."""
    with fleet_command(opts, say, "stop") as (w, rep):
        failed = w.probe()
        for name, why in failed.items():
            rep.host(name).result, rep.host(name).message = "unreachable", why
        for h in w.hosts:
            st = w.states.get(h.name)
            if st is not None:
                rep.host(h.name).origin = st.installed
                rep.host(h.name).on = "none" if st.installed is None else "old"
        errors = stop_all(w, only=set(w.states))  # (what answered: a host that did not is named)
        for name, why in errors.items():
            rep.host(name).result, rep.host(name).message = "failed", why
        for h in w.hosts:
            if rep.host(h.name).result in outcomes("pending"):
                rep.host(h.name).result = "stopped"
        if failed or errors:
            rep.unreachable = bool(failed)
            rep.result, rep.reason = "failed", "not every rank could be stopped"
        else:
            rep.result, rep.reason = "stopped", "every rank of the lane is stopped"
    return rep
