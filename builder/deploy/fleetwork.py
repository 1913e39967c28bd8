"""One command's view of a fleet (`builder deploy`, `start`, `stop`, `status`): its inventory and lane,
one connection per host for the whole command, the hosts' facts, stop and start in rank order, and the
fleet's audits over those connections.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from builder.audit import AuditOptions, run_audit
from builder.bundle import check_lane, load_bundle_inputs
from builder.deploy.fleetlock import fleet_lock
from builder.deploy.hoststate import HostOps, HostState
from builder.deploy.report import DeployReport, HostOutcome
from builder.errors import BuilderError, named
from builder.foundation.ssh import ControlSockets
from builder.inputs.hosts import Host, check_against_pins, find_fleet
from builder.launch import container_name
from builder.launch.order import start_groups, stop_groups
from builder.ship import Remote

T = TypeVar("T")
Say = Callable[[str], None]


@dataclass
class DeployOptions:
    root: Path
    pins: Path
    lock: Path
    store: Path
    fleet: str
    checks_dir: Path | None = None
    key: Path | None = None  # the signing key (bundles made again are signed with it)
    with_image: bool = False
    with_models: bool = False
    part_size: str = "256MiB"  # (as `builder bundle --part-size` takes it)
    dry_run: bool = False
    parallel: int = 4  # hosts staged at once
    connect_timeout: int = 10
    timeout: float = 60.0  # base seconds of each remote call
    start_timeout: float = 0.0  # each rank's start, and the head's health (0: the lane's start_timeout)
    stop_timeout: int = 30
    audit_mode: str = "fast"
    ssh_persist: float = 0.0  # seconds each host's connection is kept after the command (0: closed)
    insecure: bool = False
    repair: bool = False  # reinstall the lock's release on hosts that run it but drifted (deploy --repair)


def command(opts: DeployOptions, verb: str, *args: str, mode: bool = False) -> str:
    """The exact `builder` command a message tells the operator to run, as they would type it here: the
    fleet, the pins, lock and store this command used where the same shell would not get them by
    default (from BUILDER_PINS, BUILDER_LOCK and BUILDER_STORE, else the project's own), and, with
    `mode`, the audits' mode when it is not the default (a repair found by a full audit needs one)."""
    head = ["builder"]
    env = os.environ
    pins = Path(env.get("BUILDER_PINS") or "pins.toml")
    lock = Path(env["BUILDER_LOCK"]) if env.get("BUILDER_LOCK") else opts.pins.parent / "pins.lock"
    root = opts.pins.resolve().parent
    store = Path(env["BUILDER_STORE"]) if env.get("BUILDER_STORE") else root / ".cache" / "builder"
    if opts.pins.resolve() != pins.resolve():
        head += ["--pins", str(opts.pins)]
    if opts.lock.resolve() != lock.resolve():
        head += ["--lock", str(opts.lock)]
    if opts.store.resolve() != store.resolve():
        head += ["--store", str(opts.store)]
    tail = [verb, "--fleet", opts.fleet, *args]
    if mode and opts.audit_mode != "fast":
        tail += ["--mode", opts.audit_mode]
    return " ".join(shlex.quote(a) for a in head + tail)


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



def problems(report: Any) -> str:
    """The hosts that did not pass, and why (an AuditReport, or its JSON)."""
    if isinstance(report, dict):
        hosts = report.get("hosts") or {}
        bad = [named(n, h.get("message") or h.get("status")) for n, h in hosts.items() if h.get("status") != "pass"]
    else:
        bad = [named(h.name, h.first_problem() or h.status) for h in report.hosts if h.status != "pass"]
    return "; ".join(bad[:4]) + (f" (and {len(bad) - 4} more)" if len(bad) > 4 else "")


class Fleetwork:
    """One command's view of a fleet: its inventory, lane and the connection to every host."""

    def __init__(
        self, opts: DeployOptions, say: Say, *, strict: bool = True, sockets: ControlSockets | None = None
    ) -> None:
        """`strict`: the lane must be locked as pinned (what a deploy or start needs); otherwise it
        need only exist in the pins and the lock (what `builder status` needs to compare).
        `sockets`: the command's connections, when it made them already (see `command_sockets`)."""
        self.opts, self.say = opts, say
        self.ctx = load_bundle_inputs(opts.pins, opts.lock, opts.store)
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

    # ------------------------------------------------------------------ stop and start, in rank order

    def stop_all(self, only: set[str] | None = None) -> dict[str, str]:
        """Stop the lane's containers in the lane's stop order (builder.launch.order: the head first,
        then the workers), of `only` when given. host -> why not (empty: all stopped)."""
        failed: dict[str, str] = {}

        def stop(h: Host) -> None:
            st = self.states.get(h.name)
            self.op(h).stop(self.lane_name, bool(st and st.current), self.opts.stop_timeout)

        for group in stop_groups(self.fleet):
            group = [h for h in group if only is None or h.name in only]
            for h, _, err in each(group, stop, len(group)):
                if err is not None:
                    failed[h.name] = explain(err)
                else:
                    self.say(f"{h.name}: stopped rank {h.rank}")
        return failed

    def start_all(self) -> None:
        """Start the installed release in the lane's start order (builder.launch.order): each group's
        start.sh at once, each returning once its rank is ready by the lane's rule; then wait for the
        head's health. BuilderError naming the first rank that did not come up."""
        s = self.lane.serve
        t = self.opts.start_timeout or float(self.lane.start_timeout)

        def start(h: Host) -> None:
            self.op(h).start(t)
            self.say(f"{h.name}: rank {h.rank} is up ({h.role})")

        for group in start_groups(self.fleet, self.lane):
            for h, _, err in each(group, start, len(group)):
                if err is not None:
                    raise BuilderError(named(h.name, explain(err)))
        ok, reason = self.op(self.head).wait(
            container_name(self.lane_name, self.head.rank),
            ready={"kind": "health", "port": s.port, "path": self.lane.health}, timeout=t,
        )
        if not ok:
            raise BuilderError(f"{self.head.name}: rank 0 (head): {reason}")
        self.say(f"{self.head.name}: the lane is ready: {self.lane.health} answers on port {s.port}")

    # ------------------------------------------------------------------ audits

    def audit(
        self, phase: str, *, release: str = "current", snapshot: Path | None = None, only: list[str] | None = None,
        hosts: list[str] | None = None,
    ) -> Any:
        return run_fleet_audit(self.opts, self.shared, self.say, phase, release=release, snapshot=snapshot,
                               hosts_dir=self.ctx.hosts_dir, only=only, hosts=hosts)


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


def command_sockets(opts: DeployOptions) -> ControlSockets:
    """One connection per host for the whole command: every step, ship and audit of it reuses the
    host's one ControlMaster in the command's folder (the user's kept folder with --ssh-persist > 0:
    kept that long after the command; else a folder of the command's own, closed and removed at the
    end, and ended by ssh itself 60 s after its last use if the command is killed)."""
    return ControlSockets.for_run(opts.ssh_persist)


def shared_view(sockets: ControlSockets) -> ControlSockets:
    """What the command's steps, ships and audits see: its sockets, as connections to reuse (and to
    open, when there is none yet), never to close: the command closes them (close_sockets)."""
    return ControlSockets(sockets.folder, True, sockets.persist or 60.0)


def close_sockets(sockets: ControlSockets) -> None:
    """Close the command's own connections (every ControlMaster in its folder) and remove the folder;
    kept ones (--ssh-persist > 0) stay for the next command."""
    if sockets.shared:
        return
    try:
        entries = list(sockets.folder.iterdir())
    except OSError:
        entries = []
    procs = []
    for p in entries:  # (every host's at once)
        try:
            if stat.S_ISSOCK(p.lstat().st_mode):
                procs.append(subprocess.Popen(
                    ["ssh", "-o", f"ControlPath={p}", "-O", "exit", "--", "builder-control"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                ))
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    sockets.cleanup()


def run_fleet_audit(
    opts: DeployOptions, shared: ControlSockets, say: Say, phase: str, *, release: str = "current",
    snapshot: Path | None = None, hosts_dir: Path | None = None, only: list[str] | None = None,
    hosts: list[str] | None = None,
) -> Any:
    """`builder audit --fleet F --phase PHASE` over the command's connections (`snapshot`: against the
    pins and lock kept there, for a rolled-back release; `hosts`: only these of the fleet)."""
    ao = AuditOptions(
        root=snapshot or opts.root,
        pins=(snapshot / "pins.toml") if snapshot else opts.pins,
        lock=(snapshot / "pins.lock") if snapshot else opts.lock,
        store=opts.store,
        hosts_dir=hosts_dir or opts.root / "hosts",
        checks_dir=opts.checks_dir or opts.root / "checks",
        fleet=None if hosts else opts.fleet,
        names=[f"{opts.fleet}/{h}" for h in hosts or []],
        mode=opts.audit_mode,
        phase=phase,
        release=release,
        connect_timeout=float(opts.connect_timeout),
        # (the command's folder, "kept" for the audit's length: the command closes them)
        control_dir=shared.folder,
        ssh_persist=shared.persist,
        only=only,
    )
    what = {"preflight": "preflight audit (the gate)", "serving": "serving audit", "all": "audit"}[phase]
    say(f"{what} of fleet {opts.fleet}{' (the staged release)' if release == 'staged' else ''}")
    return run_audit(ao, on_host=lambda h: say(f"{h.name}: {what}: {h.status} ({h.seconds:.1f} s)"))
