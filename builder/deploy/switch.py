"""A deploy's switch: stop the running release (the head first), switch every host, start the new one
(the workers first) and audit it serving. Any failure raises: the deploy then rolls back."""

from __future__ import annotations

from typing import TYPE_CHECKING

from builder.deploy.deployment import Deployment
from builder.deploy.fleetaudit import audit, problems
from builder.deploy.fleetwork import each, explain, short
from builder.deploy.rankorder import start_all, stop_all
from builder.deploy.report import outcomes
from builder.deploy.servingrecords import keep
from builder.errors import BuilderError, UnreachableError, named

if TYPE_CHECKING:
    from builder.inputs.hosts import Host


def forward(d: Deployment) -> None:
    """From the running release to the new one: stop (the head first), switch, start (the workers
    first), the serving audit. BuilderError on any failure (the deploy then rolls back)."""
    w = d.w
    failed = stop_all(w, only={w.head.name})  # the head first: no new worker ever meets an old head
    if failed:
        raise BuilderError("; ".join(named(n, why) for n, why in failed.items()))
    d.phase("switching")

    def stop_and_switch(h: Host) -> str:
        """A worker stops (once the head has); then each host switches as soon as it is stopped."""
        if h.role == "worker":
            st = w.states.get(h.name)
            w.op(h).stop(w.lane_name, bool(st and st.current), w.opts.stop_timeout)
            w.say(f"{h.name}: stopped rank {h.rank}")
        if h.name in d.repair:  # the release shipped again: its apply record written again too
            w.op(h).switch(d.bundles[h.name].bundle_id, force=True)
            return "repaired"
        if w.states[h.name].installed == d.out(h).target:
            return "unchanged"
        w.op(h).switch(d.bundles[h.name].bundle_id)
        return "switched"

    errors = []
    for h, res, err in each(w.hosts, stop_and_switch, w.limit()):
        o = d.out(h)
        if err is not None:
            o.result, o.message = ("unreachable" if isinstance(err, UnreachableError) else "failed"), explain(err)
            errors.append(o.message)
        elif res == "switched":
            o.result, o.on = "switched", "new"
            w.say(f"{h.name}: switched {short(o.origin)} -> {short(o.target)}")
        elif res == "repaired":
            o.result, o.on = "repaired", "new"
            w.say(f"{h.name}: repaired {short(o.target)} (reinstalled from its bundle)")
    if errors:
        raise BuilderError("; ".join(errors))
    for h in w.hosts:
        o = d.out(h)
        if o.result not in outcomes("switched", "repaired"):
            o.result, o.on = "unchanged", "new"
    burn_window(d)
    d.phase("starting")
    for h in w.hosts:
        st = w.states[h.name]
        st.current = d.out(h).target  # (what stop_all reads: a release is installed now)
    start_all(w)
    d.phase("verifying")
    # (the replay is compared with the release the head ran before: a new release must answer as it did)
    report = audit(w, "serving", baseline=d.out(w.head).origin)
    d.rep.audit = report.to_json()
    if report.exit_code != 0:
        raise BuilderError(f"the serving audit failed: {problems(report)}")
    keep(w, d.rep.audit, d.out(w.head).target)



def burn_window(d: Deployment) -> None:
    """The burn (checks/test_burn.py) on the hosts whose gate skipped it because the lane's running
    release held the GPU: run now, every rank stopped and none started, seconds against a boot of
    minutes. BuilderError when a GPU fails it (the deploy then rolls back; the message names the host
    and the fix, a power cycle for a latched GPU)."""
    gate = (d.rep.audit or {}).get("hosts") or {}
    waiting = [n for n, h in gate.items()
               if ((h.get("checks") or {}).get("burn::gpu", {}).get("facts") or {}).get("deferred") is True]
    if not waiting:
        return
    report = audit(d.w, "preflight", only=["burn"], hosts=waiting)
    if report.exit_code != 0:
        raise BuilderError(f"the burn failed with the GPUs free: {problems(report)}")
