"""One command's view of a fleet (`builder deploy`, `start`, `stop`, `status`): its inventory and lane,
one connection per host for the whole command (builder.deploy.connections), and the hosts' facts.
The options come from builder.deploy.options; stop and start in rank order are
builder.deploy.rankorder's, the fleet's audits builder.deploy.fleetaudit's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from builder.bundle import check_lane, load_bundle_inputs
from builder.deploy.connections import close_sockets, command_sockets, shared_view
from builder.deploy.fleetlock import fleet_lock
from builder.deploy.hoststate import HostOps, HostState
from builder.deploy.options import DeployOptions, Say
from builder.deploy.report import DeployReport, HostOutcome
from builder.errors import BuilderError
from builder.foundation.ssh import ControlSockets
from builder.inputs.hosts import Host, check_against_pins, find_fleet
from builder.ship import Remote

T = TypeVar("T")


def short(bid: str | None) -> str:
    return bid[:12] if bid else "none"


def each(items: Iterable[T], fn: Callable[[T], Any], limit: int) -> list[tuple[T, Any, BaseException | None]]:
    """fn over items, at most `limit` at once; (item, result, error) in the items' order."""
    items = list(items)
    if not items:
        return []

    def one(x: T) -> tuple[T, Any, BaseException | None]:
        try:
            return x, fn(x), None
        except Exception as e:  # every failure is reported for its host; none stops the others
            return x, None, e

    with ThreadPoolExecutor(max_workers=max(1, min(limit, len(items)))) as ex:
        return list(ex.map(one, items))


def explain(e: BaseException) -> str:
    return str(e) if isinstance(e, BuilderError) else f"{type(e).__name__}: {e}"


class Fleetwork:
    """One command's view of a fleet: its inventory, lane and the connection to every host."""

    def __init__(
        self, opts: DeployOptions, say: Say, *, strict: bool = True, sockets: ControlSockets | None = None
    ) -> None:
        """`strict`: the lane must be locked as pinned (what a deploy or start needs); otherwise it
        need only exist in the pins and the lock (what `builder status` needs to compare).
        `sockets`: the command's connections, when it made them already (see `command_sockets`)."""
        self.opts, self.say = opts, say
        self.ctx = load_bundle_inputs(opts.pins, opts.lock, opts.store, opts.hosts_dir)
        self.fleet_path, self.fleet = find_fleet(self.ctx.hosts_dir, opts.fleet)
        if strict:
            self.lane_name = check_lane(self.ctx, self.fleet_path, self.fleet)
        else:
            check_against_pins(self.fleet_path, self.fleet, set(self.ctx.pins.lanes), set(self.ctx.lock.lanes))
            self.lane_name = self.fleet.fleet.lane
        self.lane = self.ctx.pins.lanes[self.lane_name]
        self.hosts: list[Host] = self.fleet.by_rank()
        self.head = self.hosts[0]
        self.workers = self.hosts[1:]
        self.ops: dict[str, HostOps] = {}
        self.states: dict[str, HostState] = {}
        self.sockets = sockets or command_sockets(opts)
        self.shared = shared_view(self.sockets)

    @property
    def fleet_name(self) -> str:
        return self.fleet.fleet.name

    def op(self, h: Host) -> HostOps:
        if h.name not in self.ops:
            # (the command's sockets: its audits and ships use this host's one connection too)
            remote = Remote(self.fleet_path, self.fleet, h, self.opts.connect_timeout, sockets=self.shared)
            self.ops[h.name] = HostOps(remote, timeout=self.opts.timeout)
        return self.ops[h.name]

    def report(self, command: str) -> DeployReport:
        """An empty report of `command` on this fleet: every host pending."""
        return DeployReport(
            fleet=self.fleet_name, lane=self.lane_name, command=command, target_lock=self.ctx.lock.lock_hash(),
            hosts=[HostOutcome(h.name, h.rank, h.role) for h in self.hosts],
        )

    def close(self) -> None:
        for o in self.ops.values():
            o.close()
        close_sockets(self.sockets)

    def limit(self) -> int:
        return max(1, self.opts.parallel)

    # ------------------------------------------------------------------ facts

    def probe(self, hosts: list[Host] | None = None) -> dict[str, str]:
        """Refresh self.states; host -> why it could not be asked (empty when every host answered)."""
        port = self.lane.serve.port
        failed: dict[str, str] = {}
        for h, st, err in each(
            hosts or self.hosts,
            lambda h: self.op(h).state(self.lane_name, port if h.role == "head" else None),
            len(self.hosts),
        ):
            if err is not None:
                failed[h.name] = explain(err)
                self.states.pop(h.name, None)
            else:
                self.states[h.name] = st
        return failed


@contextmanager
def fleet_command(opts: DeployOptions, say: Say, command: str) -> Iterator[tuple[Fleetwork, DeployReport]]:
    """`builder start` or `stop`: the fleet (ConfigError before any host is contacted) under its lock,
    and the command's report, timed; the connections are closed at the end."""
    t0 = time.monotonic()
    w = Fleetwork(opts, say)
    rep = w.report(command)
    try:
        with fleet_lock(opts.store, w.fleet_name, command):
            yield w, rep
    finally:
        w.close()
        rep.seconds = time.monotonic() - t0
