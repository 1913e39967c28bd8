"""A deploy's rollback: stop what started, switch every host whose release moved back to what it ran,
start that in order and audit it against the pins and lock it was deployed from. The journal covers all
of it: it is cleared only once the old release is started and audited."""

from __future__ import annotations

from typing import TYPE_CHECKING

from builder.deploy import journal as J
from builder.deploy.deployment import Deployment
from builder.deploy.fleetaudit import audit, problems
from builder.deploy.fleetwork import explain, short
from builder.deploy.options import command
from builder.deploy.rankorder import start_all, stop_all
from builder.deploy.report import DeployReport, outcomes
from builder.errors import BuilderError

if TYPE_CHECKING:
    from builder.inputs.hosts import Host


def recover(d: Deployment, reason: str) -> DeployReport:
    """Every host back to what it ran before the deploy (after `reason`), started and audited; the
    report says which side each host ends on when that could not be finished."""
    w, rep = d.w, d.rep
    opts = w.opts
    assert d.journal is not None
    d.journal.phase, d.journal.reason = "rolling-back", reason
    J.save(opts.store, d.journal)
    rep.reason = reason
    w.say(f"deploy failed: {reason}; rolling every switched host back")
    lost = w.probe()
    for name, why in lost.items():
        d.out(name).result, d.out(name).on, d.out(name).message = "unreachable", "unknown", why
    for name, why in stop_all(w).items():
        if name not in lost:
            d.out(name).message = f"stop: {why}"
    whole = not lost
    back: list[Host] = [h for h in w.hosts if h.name not in lost]
    for h in back:
        o, st = d.out(h), w.states[h.name]
        if st.current == o.origin:
            o.on = "old" if o.origin else "none"
            if o.result not in outcomes("switched"):
                o.result = "not-switched"
            continue
        if o.origin is None:
            o.result, o.on = "stopped", "new"
            o.message = "no earlier release on this host to return to: left stopped"
            whole = False
            continue
        try:
            w.op(h).switch(o.origin, rollback=True)
            o.result, o.on = "rolled-back", "old"
            w.say(f"{h.name}: rolled back {short(st.current)} -> {short(o.origin)}")
            st.current = o.origin
        except Exception as e:
            o.result, o.on, o.message = "failed", "new", f"rollback: {explain(e)}"
            whole = False
    rep.unreachable = bool(lost)
    if not whole:
        rep.result = "failed"
        rep.reason = (
            f"{reason}; the rollback did not finish ({d.sides()}); run `{command(w.opts, 'deploy')}` again once "
            "every host answers: it moves every host to the new release or back to the old one"
        )
        return rep
    # every host is back on what it ran; the journal stays until that is started and audited, so a kill
    # from here on is still named by `builder status` and resumed by `builder deploy` or `builder start`
    d.phase("restarting-old")
    rep.result = "rolled-back"
    try:
        start_all(w)
    except Exception as e:
        rep.reason = (
            f"{reason}; every host is back on its old release, but it did not start: {explain(e)} "
            f"(`{command(w.opts, 'start')}` starts it)"
        )
        return rep
    d.phase("verifying-old")
    locks = {d.journal.origin_locks.get(h.name) for h in w.hosts}
    snap = J.find_snapshot(opts.store, locks.pop()) if len(locks) == 1 else None
    if snap is None:
        J.clear(opts.store, w.fleet_name)
        rep.reason = (
            f"{reason}; every host is back on its old release and serves (not audited: no record here of "
            "the pins and lock it was deployed from)"
        )
        return rep
    try:
        report = audit(w, "serving", snapshot=snap)
    except BuilderError as e:
        rep.reason = f"{reason}; every host is back on its old release and serves (its audit could not run: {e})"
        return rep
    J.clear(opts.store, w.fleet_name)  # started and audited: the fleet is whole again
    rep.rollback_audit = report.to_json()
    ok = "passes its audit" if report.exit_code == 0 else f"fails its audit: {problems(report)}"
    rep.reason = f"{reason}; every host is back on its old release, which serves and {ok}"
    return rep
