"""`builder deploy`, `builder start`, `builder stop`: a whole fleet, in rank order, under the fleet lock.

A deploy, in order (each step bounded; hosts in parallel where the order allows it):

1. validate the inventory, pins and lock (exit 2 before any host is contacted); take the fleet lock;
2. the bundles (builder.deploy.bundles: the ones in out/bundles when current, else made again);
3. what every host runs (one call each; a host that cannot be reached stops it here: exit 3);
4. nothing to do when every host runs its new bundle already and the head answers: the deploy only
   audits (``--phase all``) and exits with the audit's code;
5. stage everywhere (ship with ``install --stage``: copy, verify, load the image, place the model
   files, stage the release; ``current`` is not touched), at most ``parallel`` hosts at once;
6. the gate: the preflight audit of the staged release on every host (image, release, models, Engram,
   GPU, memory, fabric, storage, runtime; another GPU workload than the lane's own fails it). If any
   host failed to stage, drifts or cannot be reached, no host is switched (exit 1, or 3);
7. from here on the journal (builder.deploy.journal) records the old and new release of every host;
   stop the running release: the head first, then the workers (only the lane's containers);
8. switch every host (``installer switch``); start the workers, wait until each answers, then the
   head, and wait for its ``/health`` (``start_timeout``); the serving audit of the fleet;
9. any failure in 7-8 rolls back: stop what started (head first), switch every host whose release
   moved back to what it ran before, start that in order, wait for it and audit it (against the pins
   and lock it was deployed from, kept by the deploy that put it there). The exit code is 1 and the
   report says, per host, what happened and which side it ends on.

A deploy killed at any point leaves the journal behind; the next deploy reads it, so "the old release"
stays what the fleet ran before the killed one, and moves every host to the new release (or, on a
failure, every host back to the old one), and says which.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from builder.deploy import journal as J
from builder.deploy.fleetlock import fleet_lock
from builder.deploy.report import DeployReport, HostOutcome
from builder.errors import BuilderError, ConfigError, UnreachableError
from builder.ssh import ControlSockets

if TYPE_CHECKING:  # (loaded where used: the likely no-op's audit starts before they are imported)
    from builder.deploy.bundles import FleetBundle
    from builder.deploy.hoststate import HostOps, HostState
    from builder.hosts import Host

T = TypeVar("T")
Say = Callable[[str], None]
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")  # (a fleet's name, as the inventory allows it)


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
    start_timeout: float = 600.0  # each rank's start, and the head's /health
    stop_timeout: int = 30
    audit_mode: str = "fast"
    ssh_persist: float = 0.0  # seconds each host's connection is kept after the command (0: closed)
    insecure: bool = False


def _short(bid: str | None) -> str:
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


def _why(e: BaseException) -> str:
    return str(e) if isinstance(e, BuilderError) else f"{type(e).__name__}: {e}"


class Fleetwork:
    """One command's view of a fleet: its inventory, lane and the connection to every host."""

    def __init__(
        self, opts: DeployOptions, say: Say, *, strict: bool = True, sockets: ControlSockets | None = None
    ) -> None:
        """`strict`: the lane must be locked as pinned (what a deploy or start needs); otherwise it
        need only exist in the pins and the lock (what `builder status` needs to compare).
        `sockets`: the command's connections, when it made them already (see `command_sockets`)."""
        from builder.bundle import check_lane, load_bundle_inputs
        from builder.hosts import check_against_pins, find_fleet

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
        from builder.deploy.hoststate import HostOps

        if h.name not in self.ops:
            self.ops[h.name] = HostOps(
                self.fleet_path, self.fleet, h, connect_timeout=self.opts.connect_timeout, timeout=self.opts.timeout,
                sockets=self.shared,
            )
        return self.ops[h.name]

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
                failed[h.name] = _why(err)
                self.states.pop(h.name, None)
            else:
                self.states[h.name] = st
        return failed

    # ------------------------------------------------------------------ stop and start, in rank order

    def stop_all(self, only: set[str] | None = None) -> dict[str, str]:
        """Stop the lane's containers: the head first, then the workers (of `only`, when given).
        host -> why not (empty: all stopped)."""
        failed: dict[str, str] = {}

        def stop(h: Host) -> None:
            st = self.states.get(h.name)
            self.op(h).stop(self.lane_name, bool(st and st.current), self.opts.stop_timeout)

        for group in ([self.head], self.workers):
            group = [h for h in group if only is None or h.name in only]
            for h, _, err in each(group, stop, len(group)):
                if err is not None:
                    failed[h.name] = _why(err)
                else:
                    self.say(f"{h.name}: stopped rank {h.rank}")
        return failed

    def start_all(self) -> None:
        """Start the installed release: the workers, wait until each answers, then the head, and wait
        for its /health. BuilderError naming the first rank that did not come up."""
        from builder.launch import container_name, host_address

        s = self.lane.serve
        t = self.opts.start_timeout

        def start_worker(h: Host) -> None:
            o = self.op(h)
            o.start(t)
            ok, why = o.wait(
                container_name(self.lane_name, h.rank),
                ports=[s.port, s.rendezvous_port],
                addrs=[host_address(self.fleet, h), "127.0.0.1"],
                health_port=None,
                timeout=t,
            )
            if not ok:
                raise BuilderError(f"{h.name}: rank {h.rank}: {why}")
            self.say(f"{h.name}: rank {h.rank} is up")

        for h, _, err in each(self.workers, start_worker, len(self.workers)):
            if err is not None:
                raise BuilderError(_why(err) if str(err).startswith(h.name) else f"{h.name}: {_why(err)}")
        o = self.op(self.head)
        o.start(t)
        ok, why = o.wait(
            container_name(self.lane_name, self.head.rank), ports=[s.port], addrs=["127.0.0.1"],
            health_port=s.port, timeout=t,
        )
        if not ok:
            raise BuilderError(f"{self.head.name}: rank 0 (head): {why}")
        self.say(f"{self.head.name}: rank 0 is up and /health answers on port {s.port}")

    # ------------------------------------------------------------------ audits

    def audit(self, phase: str, *, release: str = "current", snapshot: Path | None = None) -> Any:
        return run_fleet_audit(self.opts, self.shared, self.say, phase, release=release, snapshot=snapshot,
                               hosts_dir=self.ctx.hosts_dir)


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
    import stat
    import subprocess

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
    snapshot: Path | None = None, hosts_dir: Path | None = None,
) -> Any:
    """`builder audit --fleet F --phase PHASE` over the command's connections (`snapshot`: against the
    pins and lock kept there, for a rolled-back release)."""
    from builder.audit import AuditOptions, run_audit

    ao = AuditOptions(
        root=snapshot or opts.root,
        pins=(snapshot / "pins.toml") if snapshot else opts.pins,
        lock=(snapshot / "pins.lock") if snapshot else opts.lock,
        store=opts.store,
        hosts_dir=hosts_dir or opts.root / "hosts",
        checks_dir=opts.checks_dir or opts.root / "checks",
        fleet=opts.fleet,
        mode=opts.audit_mode,
        phase=phase,
        release=release,
        connect_timeout=float(opts.connect_timeout),
        # (the command's folder, "kept" for the audit's length: the command closes them)
        control_dir=shared.folder,
        ssh_persist=shared.persist,
    )
    what = {"preflight": "preflight audit (the gate)", "serving": "serving audit", "all": "audit"}[phase]
    say(f"{what} of fleet {opts.fleet}{' (the staged release)' if release == 'staged' else ''}")
    return run_audit(ao, on_host=lambda h: say(f"{h.name}: {what}: {h.status} ({h.seconds:.1f} s)"))


_EARLY_AUDIT = """
import json, sys
from pathlib import Path
from builder.audit import AuditOptions, run_audit
from builder.errors import BuilderError
req = json.loads(sys.argv[1])
paths = ("root", "pins", "lock", "store", "hosts_dir", "checks_dir", "control_dir")
opts = AuditOptions(**{k: Path(v) if k in paths else v for k, v in req.items()})
def progress(h):
    sys.stderr.write("%s: %s (%.1f s)\\n" % (h.name, h.status, h.seconds))
    sys.stderr.flush()
try:
    report = run_audit(opts, on_host=progress)
except BuilderError as e:
    sys.stderr.write("error: %s\\n" % e)
    sys.exit(2)
sys.stdout.write(json.dumps(report.to_json()))
"""


class EarlyAudit:
    """The no-op's audit (as ``builder audit --fleet F --phase all --json``), started before the deploy
    loads anything when the fleet most likely runs its bundles already (no unfinished deploy, and
    every bundle in out/bundles was made from this lock). It runs as a process of its own, over the
    command's connections (it opens them; the deploy's steps reuse them), so its pytest start and its
    checks overlap the deploy's own loading and bundle checks on another core. Its report (the audit's
    JSON) is used only when the deploy finds the fleet deployed; it is always waited for."""

    def __init__(self, opts: DeployOptions, shared: ControlSockets, say: Say) -> None:
        import json
        import os
        import subprocess
        import sys
        import threading

        import builder

        req = {
            "root": str(opts.root.resolve()), "pins": str(opts.pins.resolve()), "lock": str(opts.lock.resolve()),
            "store": str(opts.store.resolve()), "hosts_dir": str((opts.root / "hosts").resolve()),
            "checks_dir": str((opts.checks_dir or opts.root / "checks").resolve()), "fleet": opts.fleet,
            "mode": opts.audit_mode, "phase": "all", "connect_timeout": float(opts.connect_timeout),
            "control_dir": str(shared.folder), "ssh_persist": shared.persist,
        }
        # the same builder as this process (whatever put it on the path); no CLI, no table to render
        here = str(Path(builder.__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.report: dict[str, Any] | None = None
        self.say = say
        say(f"audit of fleet {opts.fleet}")
        self.proc = subprocess.Popen([sys.executable, "-c", _EARLY_AUDIT, json.dumps(req)], cwd=shared.folder,
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.err = threading.Thread(target=self._progress, daemon=True)
        self.err.start()

    def _progress(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            m = re.match(r"^(\S+): (pass|drift|unreachable|error) \((.*)\)$", line)
            if m:
                self.say(f"{m.group(1)}: audit: {m.group(2)} ({m.group(3)})")

    def wait(self) -> dict[str, Any] | None:
        import json

        assert self.proc.stdout is not None
        out = self.proc.stdout.read()  # (stderr is the progress thread's)
        self.proc.wait()
        self.err.join()
        try:
            got = json.loads(out)
        except ValueError:  # (a configuration error is the deploy's to report)
            return None
        self.report = got if isinstance(got, dict) and "exit" in got else None
        return self.report

    @staticmethod
    def likely(opts: DeployOptions) -> bool:
        import json

        if opts.dry_run or J.load(opts.store, opts.fleet) is not None:
            return False
        try:
            seal = json.loads(opts.lock.read_bytes())["seal"]  # (the lock's hash, as bundles record it)
            manifests = list((opts.root / "out" / "bundles" / opts.fleet).glob("*/manifest.json"))
            return bool(manifests) and all(json.loads(m.read_bytes()).get("lock_hash") == seal for m in manifests)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False


def _problems(report: Any) -> str:
    """The hosts that did not pass, and why (an AuditReport, or its JSON)."""
    if isinstance(report, dict):
        hosts = report.get("hosts") or {}
        bad = [f"{n}: {h.get('message') or h.get('status')}" for n, h in hosts.items() if h.get("status") != "pass"]
    else:
        bad = [f"{h.name}: {h.first_problem() or h.status}" for h in report.hosts if h.status != "pass"]
    return "; ".join(bad[:4]) + (f" (and {len(bad) - 4} more)" if len(bad) > 4 else "")


# ====================================================================== deploy


def deploy(opts: DeployOptions, say: Say = lambda _: None) -> DeployReport:
    start = time.monotonic()
    if opts.dry_run:
        w = Fleetwork(opts, say)  # ConfigError (exit 2) before any host is contacted
        try:
            rep = _Deploy(w).run()
        finally:
            w.close()
    else:
        if not NAME.fullmatch(opts.fleet):
            raise ConfigError(f"--fleet: not a fleet name: {opts.fleet!r}")
        with fleet_lock(opts.store, opts.fleet, "deploy"):
            sockets = command_sockets(opts)
            early = EarlyAudit(opts, shared_view(sockets), say) if EarlyAudit.likely(opts) else None
            try:
                w = Fleetwork(opts, say, sockets=sockets)  # ConfigError (exit 2): nothing was changed
            except BaseException:
                if early is not None:
                    early.wait()
                close_sockets(sockets)
                raise
            try:
                rep = _Deploy(w, early).run()
            finally:
                if early is not None:
                    early.wait()
                w.close()
    rep.seconds = time.monotonic() - start
    return rep


class _Deploy:
    def __init__(self, w: Fleetwork, early: EarlyAudit | None = None) -> None:
        self.early = early
        self.w = w
        self.opts = w.opts
        self.say = w.say
        self.rep = DeployReport(fleet=w.fleet_name, lane=w.lane_name, target_lock=w.ctx.lock.lock_hash())
        self.rep.hosts = [HostOutcome(h.name, h.rank, h.role) for h in w.hosts]
        self.bundles: dict[str, FleetBundle] = {}
        self.journal: J.Journal | None = None

    def out(self, h: Host | str) -> HostOutcome:
        return self.rep.host(h if isinstance(h, str) else h.name)

    # ------------------------------------------------------------------ the whole run

    def run(self) -> DeployReport:
        from builder.deploy.bundles import FleetBundle, ensure_bundles

        w, opts, rep = self.w, self.opts, self.rep
        made = ensure_bundles(
            w.ctx, w.fleet_path, w.fleet, key=opts.key, with_image=opts.with_image, with_models=opts.with_models,
            part_size=opts.part_size, dry_run=opts.dry_run, say=self.say,
        )
        stale = {n: b for n, b in made.items() if isinstance(b, str)}
        self.bundles = {n: b for n, b in made.items() if isinstance(b, FleetBundle)}
        earlier = J.load(opts.store, w.fleet_name)
        failed = w.probe()  # (beside the early audit, if one runs: the hosts' connections are shared)
        early = self.early.wait() if self.early is not None else None  # (always over before anything changes)
        if earlier is not None or any(b.made for b in self.bundles.values()):
            early = None  # (audited before the journal or the bundles said otherwise: not the no-op's)
        if failed:
            for name, why in failed.items():
                self.out(name).result, self.out(name).message = "unreachable", why
            return self.refuse("not every host answered; nothing was changed", unreachable=True)
        for h in w.hosts:
            o, st = self.out(h), w.states[h.name]
            o.target = self.bundles[h.name].bundle_id if h.name in self.bundles else None
            o.origin = st.installed or st.current
            if earlier is not None and h.name in earlier.origin:
                o.origin = earlier.origin[h.name]
            o.on = self.side(h)
        if earlier is not None:
            rep.resumed = self.describe_earlier(earlier)
            self.say(rep.resumed)
        if opts.dry_run:
            return self.plan(stale)
        if self.is_noop():
            return self.noop(earlier, early)
        for line in self.changes():
            self.say(f"to deploy: {line}")
        recipe = w.ctx.pins.images[w.lane.image].recipe
        J.snapshot(opts.store, rep.target_lock or "", opts.pins, opts.lock, opts.root, recipe)
        if not self.stage():
            return self.refuse("staging failed; no host was switched", unreachable=rep.unreachable)
        gate = w.audit("preflight", release="staged")
        rep.audit = gate.to_json()
        if gate.exit_code != 0:
            for hr in gate.hosts:
                if hr.status != "pass":
                    self.out(hr.name).message = hr.first_problem() or hr.status
                    self.out(hr.name).result = "unreachable" if hr.status == "unreachable" else "not-switched"
            return self.refuse(f"the preflight audit failed, no host was switched: {_problems(gate)}",
                               unreachable=gate.exit_code == 3)
        self.journal = J.Journal(
            fleet=w.fleet_name,
            target={h.name: self.bundles[h.name].bundle_id for h in w.hosts},
            origin={h.name: self.out(h).origin for h in w.hosts},
            origin_locks={h.name: self.origin_lock(h, earlier) for h in w.hosts},
            target_lock=rep.target_lock or "",
            phase="stopping",
        )
        if earlier is not None:
            self.journal.started = earlier.started
        J.save(opts.store, self.journal)
        try:
            self.forward()
        except Exception as e:  # anything after the first change: roll every host back
            return self.recover(_why(e))
        J.clear(opts.store, w.fleet_name)
        rep.result = "deployed"
        rep.reason = f"every host runs its new bundle (lock {_short(rep.target_lock)}) and the fleet serves"
        return rep

    def refuse(self, reason: str, *, unreachable: bool = False) -> DeployReport:
        rep = self.rep
        rep.result, rep.reason, rep.unreachable = "refused", reason, rep.unreachable or unreachable
        for o in rep.hosts:
            if o.result in ("pending", "staged", "unchanged"):
                o.result = "not-switched" if o.result != "unchanged" else o.result
        if self.rep.resumed:
            rep.reason += f"; the fleet is as the earlier deploy left it ({self.sides()})"
        return rep

    # ------------------------------------------------------------------ state words

    def side(self, h: Host) -> str:
        st = self.w.states.get(h.name)
        o = self.out(h)
        if st is None:
            return "unknown"
        if st.current is None:
            return "none"
        if o.target is not None and st.current == o.target:
            return "new"
        if st.current == o.origin:
            return "old"
        return "other"

    def sides(self) -> str:
        by: dict[str, list[str]] = {}
        for o in self.rep.hosts:
            by.setdefault(o.on, []).append(o.host)
        return "; ".join(f"on {k}: {', '.join(v)}" for k, v in sorted(by.items()))

    def origin_lock(self, h: Host, earlier: J.Journal | None) -> str | None:
        if earlier is not None and h.name in earlier.origin_locks:
            return earlier.origin_locks[h.name]
        st = self.w.states[h.name]
        return (st.applied or {}).get("lock_hash") if st.applied else None

    def describe_earlier(self, j: J.Journal) -> str:
        same = all(self.out(h).target == j.target.get(h.name) for h in self.w.hosts)
        where = "; ".join(
            f"{h.name} on {'the new' if self.w.states[h.name].current == j.target.get(h.name) else 'the old' if self.w.states[h.name].current == j.origin.get(h.name) else 'another'} release"  # noqa: E501
            for h in self.w.hosts
        )
        return (
            f"an earlier deploy of fleet {j.fleet} (pid {j.pid}, started {j.started}) did not finish "
            f"(it stopped while {j.phase}{': ' + j.reason if j.reason else ''}); {where}. This deploy moves "
            f"every host to {'that' if same else 'the new'} release, or on a failure back to the release "
            "each ran before it"
        )

    # ------------------------------------------------------------------ dry run and no-op

    def is_noop(self) -> bool:
        return not self.changes()

    def changes(self) -> list[str]:
        """Why the fleet is not already deployed and serving (empty: it is)."""
        w, why = self.w, []
        for h in w.hosts:
            st, o = w.states[h.name], self.out(h)
            if o.target is None or st.installed != o.target:
                why.append(f"{h.name}: {_short(st.installed)} installed, new bundle {_short(o.target)}")
            elif not st.up_on(o.target):
                why.append(f"{h.name}: rank {h.rank} is not up on it")
        head = w.states[w.head.name]
        if not why and not head.healthy:
            why.append(f"{w.head.name}: /health does not answer ({(head.health or {}).get('error') or head.health})")
        return why

    def plan(self, stale: dict[str, str]) -> DeployReport:
        w, rep = self.w, self.rep
        rep.result = "planned"
        s = w.lane.serve
        for h in w.hosts:
            o, st = self.out(h), w.states[h.name]
            up = st.running[0].bundle if st.running else None
            o.result = "planned"
            new = o.target or f"(a new bundle: {stale.get(h.name, '?')})"
            o.plan = [
                f"runs {_short(up) if up else 'nothing'}; installed {_short(st.installed)}",
                f"bundle: {_short(o.target) if o.target else new}"
                + ("" if o.target is None or st.installed != o.target else " (installed already)"),
                "stage: "
                + ("the release already on the host" if o.target and o.target in st.releases else "ship the bundle"),
            ]
        if self.is_noop():
            rep.reason = "every host runs its bundle already: a deploy would only audit the fleet (--phase all)"
            rep.steps = ["audit --phase all"]
            return rep
        heads, workers = w.head.name, ", ".join(h.name for h in w.workers) or "no workers"
        rep.steps = [
            f"bundle: {', '.join(stale) + ' made again' if stale else 'every bundle is current'}",
            f"stage on every host, {w.limit()} at once (ship with install --stage; current is not touched)",
            "gate: the preflight audit of the staged release on every host (no host switches unless all pass)",
            f"stop the running release: the head {heads} first, then {workers}",
            "switch every host to its new release",
            f"start {workers}, then the head {heads}; wait for /health on port {s.port} "
            f"(at most {self.opts.start_timeout:g} s a rank)",
            "serving audit of the fleet",
            "on any failure after the first switch: stop, switch every host back to what it ran, start that "
            "in order and audit it",
        ]
        rep.reason = "dry run: nothing was changed"
        return rep

    def noop(self, earlier: J.Journal | None, early: dict[str, Any] | None = None) -> DeployReport:
        w, rep = self.w, self.rep
        self.say(f"fleet {w.fleet_name}: every host runs its new bundle already" + ("" if early else "; auditing"))
        rep.audit = early if early is not None else w.audit("all").to_json()
        code = int(rep.audit.get("exit", 1))
        for h in w.hosts:
            self.out(h).result = "unchanged"
        if code == 0:
            if earlier is not None:
                J.clear(self.opts.store, w.fleet_name)
                rep.result = "deployed"
                rep.reason = "the earlier deploy had moved every host; the fleet serves and passes its audit"
                return rep
            rep.result = "unchanged"
            rep.reason = "already deployed and serving; the audit passes"
        else:
            rep.result = "unchanged"
            rep.unreachable = code == 3
            rep.reason = f"already deployed, but the audit fails: {_problems(rep.audit)}"
        return rep

    # ------------------------------------------------------------------ stage

    def stage(self) -> bool:
        w = self.w

        def one(h: Host) -> str:
            bid, st = self.bundles[h.name].bundle_id, w.states[h.name]
            if bid in st.releases:
                try:
                    w.op(h).stage_installed(bid)
                    return "staged (the release was on the host)"
                except UnreachableError:
                    raise
                except BuilderError as e:
                    self.say(f"{h.name}: {e}; shipping the bundle instead")
            from builder.ship import ShipOptions, ship

            r = ship(
                self.opts.root,
                f"{w.fleet_name}/{h.name}",
                ShipOptions(
                    bundle=self.bundles[h.name].path, signing_key=self.opts.key, timeout=self.opts.timeout,
                    connect_timeout=self.opts.connect_timeout, insecure=self.opts.insecure, stage=True,
                    sockets=w.shared,
                ),
            )
            return f"staged ({len(r.sent)} files sent, {len(r.skipped)} already there)"

        ok = True
        for h, msg, err in each(w.hosts, one, w.limit()):
            o = self.out(h)
            if err is not None:
                ok = False
                o.result = "unreachable" if isinstance(err, UnreachableError) else "failed"
                o.message = _why(err)
                self.rep.unreachable = self.rep.unreachable or isinstance(err, UnreachableError)
                self.say(f"{h.name}: staging failed: {o.message}")
            else:
                o.result, o.message = "staged", msg
                self.say(f"{h.name}: {msg}: bundle {_short(self.bundles[h.name].bundle_id)}")
        return ok

    # ------------------------------------------------------------------ forward

    def phase(self, name: str) -> None:
        assert self.journal is not None
        self.journal.phase = name
        J.save(self.opts.store, self.journal)

    def forward(self) -> None:
        w = self.w
        failed = w.stop_all(only={w.head.name})  # the head first: no new worker ever meets an old head
        if failed:
            raise BuilderError("; ".join(f"{n}: {why}" for n, why in failed.items()))
        self.phase("switching")

        def stop_and_switch(h: Host) -> str:
            """A worker stops (once the head has); then each host switches as soon as it is stopped."""
            if h.role == "worker":
                st = w.states.get(h.name)
                w.op(h).stop(w.lane_name, bool(st and st.current), self.opts.stop_timeout)
                self.say(f"{h.name}: stopped rank {h.rank}")
            if w.states[h.name].installed == self.out(h).target:
                return "unchanged"
            w.op(h).switch(self.bundles[h.name].bundle_id)
            return "switched"

        errors = []
        for h, res, err in each(w.hosts, stop_and_switch, w.limit()):
            o = self.out(h)
            if err is not None:
                o.result, o.message = ("unreachable" if isinstance(err, UnreachableError) else "failed"), _why(err)
                errors.append(o.message)
            elif res == "switched":
                o.result, o.on = "switched", "new"
                self.say(f"{h.name}: switched {_short(o.origin)} -> {_short(o.target)}")
        if errors:
            raise BuilderError("; ".join(errors))
        for h in w.hosts:
            o = self.out(h)
            if o.result != "switched":
                o.result, o.on = "unchanged", "new"
        self.phase("starting")
        for h in w.hosts:
            st = w.states[h.name]
            st.current = self.out(h).target  # (what stop_all reads: a release is installed now)
        w.start_all()
        self.phase("verifying")
        report = w.audit("serving")
        self.rep.audit = report.to_json()
        if report.exit_code != 0:
            raise BuilderError(f"the serving audit failed: {_problems(report)}")

    # ------------------------------------------------------------------ rollback

    def recover(self, reason: str) -> DeployReport:
        w, rep, opts = self.w, self.rep, self.opts
        assert self.journal is not None
        self.journal.phase, self.journal.reason = "rolling-back", reason
        J.save(opts.store, self.journal)
        rep.reason = reason
        self.say(f"deploy failed: {reason}; rolling every switched host back")
        lost = w.probe()
        for name, why in lost.items():
            self.out(name).result, self.out(name).on, self.out(name).message = "unreachable", "unknown", why
        for name, why in w.stop_all().items():
            if name not in lost:
                self.out(name).message = f"stop: {why}"
        whole = not lost
        back: list[Host] = [h for h in w.hosts if h.name not in lost]
        for h in back:
            o, st = self.out(h), w.states[h.name]
            if st.current == o.origin:
                o.on = "old" if o.origin else "none"
                if o.result not in ("switched",):
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
                self.say(f"{h.name}: rolled back {_short(st.current)} -> {_short(o.origin)}")
                st.current = o.origin
            except Exception as e:
                o.result, o.on, o.message = "failed", "new", f"rollback: {_why(e)}"
                whole = False
        rep.unreachable = bool(lost)
        if not whole:
            rep.result = "failed"
            rep.reason = (
                f"{reason}; the rollback did not finish ({self.sides()}); run `builder deploy` again once every "
                "host answers: it moves every host to the new release or back to the old one"
            )
            return rep
        J.clear(opts.store, w.fleet_name)  # every host is back on what it ran: the fleet is whole again
        rep.result = "rolled-back"
        try:
            w.start_all()
        except Exception as e:
            rep.reason = f"{reason}; every host is back on its old release, but it did not start: {_why(e)}"
            return rep
        locks = {self.journal.origin_locks.get(h.name) for h in w.hosts}
        snap = J.find_snapshot(opts.store, locks.pop()) if len(locks) == 1 else None
        if snap is None:
            rep.reason = (
                f"{reason}; every host is back on its old release and serves (not audited: no record here of "
                "the pins and lock it was deployed from)"
            )
            return rep
        try:
            report = w.audit("serving", snapshot=snap)
        except BuilderError as e:
            rep.reason = f"{reason}; every host is back on its old release and serves (its audit could not run: {e})"
            return rep
        rep.rollback_audit = report.to_json()
        ok = "passes its audit" if report.exit_code == 0 else f"fails its audit: {_problems(report)}"
        rep.reason = f"{reason}; every host is back on its old release, which serves and {ok}"
        return rep


# ====================================================================== start and stop


def start(opts: DeployOptions, say: Say = lambda _: None) -> DeployReport:
    """Start the installed release of every host in rank order (workers, then the head), after the
    preflight audit; a fleet partly up is stopped first (a new worker never joins an old head)."""
    t0 = time.monotonic()
    w = Fleetwork(opts, say)
    rep = DeployReport(fleet=w.fleet_name, lane=w.lane_name, command="start", target_lock=w.ctx.lock.lock_hash())
    rep.hosts = [HostOutcome(h.name, h.rank, h.role) for h in w.hosts]
    try:
        with fleet_lock(opts.store, w.fleet_name, "start"):
            _start(w, rep)
    finally:
        w.close()
    rep.seconds = time.monotonic() - t0
    return rep


def _start(w: Fleetwork, rep: DeployReport) -> None:
    failed = w.probe()
    for name, why in failed.items():
        rep.host(name).result, rep.host(name).message = "unreachable", why
    if failed:
        rep.result, rep.reason, rep.unreachable = "refused", "not every host answered; nothing was started", True
        return
    missing = [h.name for h in w.hosts if w.states[h.name].installed is None]
    for h in w.hosts:
        o, st = rep.host(h.name), w.states[h.name]
        o.origin = o.target = st.installed
        o.on = "none" if st.installed is None else "old"
    if missing:
        rep.result = "refused"
        rep.reason = f"no release installed on {', '.join(missing)} (run `builder deploy --fleet {w.fleet_name}`)"
        return
    if all(w.states[h.name].up_on(w.states[h.name].installed) for h in w.hosts) and w.states[w.head.name].healthy:
        w.say(f"fleet {w.fleet_name}: every rank is up already")
        for h in w.hosts:
            rep.host(h.name).result = "unchanged"
    else:
        gate = w.audit("preflight")
        rep.audit = gate.to_json()
        if gate.exit_code != 0:
            rep.result, rep.unreachable = "refused", gate.exit_code == 3
            rep.reason = f"the preflight audit failed; nothing was started: {_problems(gate)}"
            return
        if any(w.states[h.name].containers for h in w.hosts):
            stopped = w.stop_all()  # a fleet partly up: stop every rank first, head first
            if stopped:
                rep.result, rep.reason = "failed", "; ".join(f"{n}: {why}" for n, why in stopped.items())
                return
        try:
            w.start_all()
        except Exception as e:
            rep.result, rep.reason = "failed", _why(e)
            return
        for h in w.hosts:
            rep.host(h.name).result = "started"
    report = w.audit("serving")
    rep.audit = report.to_json()
    if report.exit_code != 0:
        rep.result, rep.unreachable = "failed", report.exit_code == 3
        rep.reason = f"started, but the serving audit fails: {_problems(report)}"
        return
    rep.result, rep.reason = "started", "every rank is up and the fleet passes its serving audit"


def stop(opts: DeployOptions, say: Say = lambda _: None) -> DeployReport:
    """Stop the lane's containers on every host: the head first, then the workers (only the lane's)."""
    t0 = time.monotonic()
    w = Fleetwork(opts, say)
    rep = DeployReport(fleet=w.fleet_name, lane=w.lane_name, command="stop", target_lock=w.ctx.lock.lock_hash())
    rep.hosts = [HostOutcome(h.name, h.rank, h.role) for h in w.hosts]
    try:
        with fleet_lock(opts.store, w.fleet_name, "stop"):
            failed = w.probe()
            for name, why in failed.items():
                rep.host(name).result, rep.host(name).message = "unreachable", why
            for h in w.hosts:
                st = w.states.get(h.name)
                if st is not None:
                    rep.host(h.name).origin = st.installed
                    rep.host(h.name).on = "none" if st.installed is None else "old"
            errors = w.stop_all(only=set(w.states))  # (what answered: a host that did not is named)
            for name, why in errors.items():
                rep.host(name).result, rep.host(name).message = "failed", why
            for h in w.hosts:
                if rep.host(h.name).result == "pending":
                    rep.host(h.name).result = "stopped"
            if failed or errors:
                rep.unreachable = bool(failed)
                rep.result, rep.reason = "failed", "not every rank could be stopped"
            else:
                rep.result, rep.reason = "stopped", "every rank of the lane is stopped"
    finally:
        w.close()
    rep.seconds = time.monotonic() - t0
    return rep


__all__ = ["DeployOptions", "deploy", "start", "stop"]
