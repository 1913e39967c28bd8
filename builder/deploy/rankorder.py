"""A fleet's lane stopped and started in rank order (builder.launch.order): the stop, the head first;
the start, in the lane's order, each rank until it is ready, then the head's health."""

from __future__ import annotations

from builder.deploy.fleetwork import Fleetwork, each, explain
from builder.errors import BuilderError, named
from builder.inputs.hosts import Host
from builder.launch import container_name
from builder.launch.order import start_groups, stop_groups


def stop_all(w: Fleetwork, only: set[str] | None = None) -> dict[str, str]:
    """Stop the lane's containers in the lane's stop order (builder.launch.order: the head first,
    then the workers), of `only` when given. host -> why not (empty: all stopped)."""
    failed: dict[str, str] = {}

    def stop(h: Host) -> None:
        st = w.states.get(h.name)
        w.op(h).stop(w.lane_name, bool(st and st.current), w.opts.stop_timeout)

    for group in stop_groups(w.fleet):
        group = [h for h in group if only is None or h.name in only]
        for h, _, err in each(group, stop, len(group)):
            if err is not None:
                failed[h.name] = explain(err)
            else:
                w.say(f"{h.name}: stopped rank {h.rank}")
    return failed

def start_all(w: Fleetwork) -> None:
    """Start the installed release in the lane's start order (builder.launch.order): each group's
    start.sh at once, each returning once its rank is ready by the lane's rule; then wait for the
    head's health. BuilderError naming the first rank that did not come up."""
    s = w.lane.serve
    t = w.opts.start_timeout or float(w.lane.start_timeout)

    def start(h: Host) -> None:
        w.op(h).start(t)
        w.say(f"{h.name}: rank {h.rank} is up ({h.role})")

    for group in start_groups(w.fleet, w.lane):
        for h, _, err in each(group, start, len(group)):
            if err is not None:
                raise BuilderError(named(h.name, explain(err)))
    ok, reason = w.op(w.head).wait(
        container_name(w.lane_name, w.head.rank),
        ready={"kind": "health", "port": s.port, "path": w.lane.health}, timeout=t,
    )
    if not ok:
        raise BuilderError(f"{w.head.name}: rank 0 (head): {reason}")
    w.say(f"{w.head.name}: the lane is ready: {w.lane.health} answers on port {s.port}")
