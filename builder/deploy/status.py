"""`builder status --fleet NAME`: which bundle, lock and image every host runs, and whether its rank is up.

One remote call per host, all at once (builder.deploy.hoststate). Compared with this machine's lock:
``lock`` says whether the installed release was bundled from it, ``image`` whether its image is the
one the lock builds (from the store's build record). A rank is ``up`` when exactly one container of
the lane's rank runs the installed bundle; the head is up when ``/health`` also answers. An unfinished
deploy or rollback (its journal) is named, with the phase it stopped in and the command that resumes
it, and counts as not deployed: the serving audit of what runs never ran (or failed).

Exit: 0 every rank up on the lock and no deploy unfinished; 1 something is not (a rank down, a release
from another lock, a mix, an unfinished deploy or rollback); 3 a host could not be reached.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.audit.exits import RankExit, cause_and_consequences, describe_cause, describe_consequence
from builder.deploy import journal as J
from builder.deploy.fleetwork import Fleetwork
from builder.deploy.hoststate import HostState
from builder.deploy.options import DeployOptions, command
from builder.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, ConfigError
from builder.foundation.canon import attrs
from builder.image.imagerecord import read_record
from builder.image.plan import make_plan
from builder.store import servingrecord


@dataclass
class HostStatus:
    host: str
    rank: int
    role: str
    reachable: bool = True
    message: str = ""
    bundle: str | None = None
    lock_hash: str | None = None
    on_lock: bool | None = None
    image_id: str | None = None
    image: str | None = None
    image_is_lock: bool | None = None
    staged: str | None = None
    previous: str | None = None
    container: str = ""  # running | exited | none | several
    running_bundle: str | None = None
    up: bool = False
    health: int | None = None
    exit_code: str = ""  # (its container ended: the exit code, when, its last log lines)
    finished_at: str = ""
    log: str = ""
    exited: str = ""  # "first" (the cause) | "after rank K" (a consequence) | "" (did not exit)
    #: the head's release record of what it answered (builder.store.servingrecord): gates, replay, tok/s
    serving: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class FleetStatus:
    fleet: str
    lane: str
    lock_hash: str
    image_id: str | None
    hosts: list[HostStatus] = field(default_factory=list)
    deploy: str = ""  # an unfinished deploy, in words
    deploy_phase: str = ""  # the phase it stopped in ("" none)
    resume: str = ""  # the command that resumes it
    first_exit: dict[str, Any] | None = None  # the rank whose engine exited first (builder.audit.exits)
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        if any(not h.reachable for h in self.hosts):
            return EXIT_UNREACHABLE
        if not self.deploy and all(h.up and h.on_lock for h in self.hosts):
            return EXIT_OK
        return EXIT_FAILED

    @property
    def summary(self) -> str:
        if any(not h.reachable for h in self.hosts):
            return "not every host answered"
        up = sum(1 for h in self.hosts if h.up)
        on = sum(1 for h in self.hosts if h.on_lock)
        n = len(self.hosts)
        if self.deploy and not self.deploy_phase:  # (a journal that cannot be read)
            return (f"{up} of {n} ranks up; {on} of {n} hosts on the lock {self.lock_hash[:12]}; not deployed: "
                    f"{self.deploy}")
        if self.deploy:
            return (f"{up} of {n} ranks up; {on} of {n} hosts on the lock {self.lock_hash[:12]}; not deployed: "
                    f"a deploy stopped while {self.deploy_phase} ({self.resume} finishes it)")
        if up == n and on == n:
            return f"all {n} ranks up, on the lock {self.lock_hash[:12]}"
        cause = f"; {describe_cause(self.first_exit)}" if self.first_exit else ""
        after = len(self.first_exit["consequences"]) if self.first_exit else 0
        cause += f"; {after} rank(s) exited after it" if after else ""
        return f"{up} of {n} ranks up; {on} of {n} hosts on the lock {self.lock_hash[:12]}{cause}"

    def to_json(self) -> dict[str, Any]:
        return {
            **attrs(self, "fleet", "lane", "lock_hash", "image_id"),
            "exit": self.exit_code,
            "summary": self.summary,
            "deploy": self.deploy,
            "deploy_phase": self.deploy_phase,
            "resume": self.resume,
            "first_exit": self.first_exit,
            "seconds": round(self.seconds, 3),
            "hosts": {h.host: {k: v for k, v in h.to_json().items() if k != "host"} for h in self.hosts},
        }


def _image_id(w: Fleetwork) -> str | None:
    try:
        plan = make_plan(w.ctx.pins, w.ctx.lock, w.lane.image, w.ctx.root)
    except Exception:
        return None
    rec = read_record(w.ctx.store, plan.address)
    return rec.image_id if rec is not None else None


def _host(h: Any, st: HostState, lock_hash: str, image_id: str | None, store: Path, fleet: str) -> HostStatus:
    s = HostStatus(h.name, h.rank, h.role)
    s.bundle = st.installed
    s.staged, s.previous = st.staged, st.previous
    a = st.applied or {}
    if st.installed:
        s.lock_hash, s.image_id, s.image = a.get("lock_hash"), a.get("image_id"), a.get("image")
        s.on_lock = s.lock_hash == lock_hash
        s.image_is_lock = None if image_id is None else s.image_id == image_id
    if st.docker:
        s.container, s.message = "unknown", st.docker
    elif not st.containers:
        s.container = "none"
    elif len(st.containers) > 1:
        s.container = "several"
    else:
        c = st.containers[0]
        s.container, s.running_bundle = c.state, c.bundle
        s.exit_code, s.finished_at, s.log = c.exit_code, c.finished_at, c.log
    s.up = st.up_on(st.installed)
    if h.role == "head":
        s.health = (st.health or {}).get("status")
        s.up = s.up and st.healthy
        if st.installed:
            s.serving = servingrecord.load(store, fleet, st.installed)
    return s


def serving_summary(rec: dict[str, Any] | None) -> str:
    """The release record in one cell: gates passed, the replay's prompts, tok/s and when."""
    if rec is None:
        return "-"
    gates = rec.get("gates") or {}
    passed = sum(1 for ok in gates.values() if ok)
    tok = (rec.get("speed") or {}).get("tok_s")
    return (f"gates {passed}/{len(gates)}, replay {len(rec.get('replay') or [])}"
            f"{' (accepted)' if rec.get('accepted') else ''}{f', {tok:g} tok/s' if tok is not None else ''}, "
            f"{rec.get('at', '?')}")


def fleet_status(opts: DeployOptions) -> FleetStatus:
    t0 = time.monotonic()
    w = Fleetwork(opts, lambda _: None, strict=False)
    try:
        lock_hash = w.ctx.lock.lock_hash()
        out = FleetStatus(fleet=w.fleet_name, lane=w.lane_name, lock_hash=lock_hash, image_id=_image_id(w))
        failed = w.probe()
        for h in w.hosts:
            if h.name in failed:
                out.hosts.append(HostStatus(h.name, h.rank, h.role, reachable=False, message=failed[h.name]))
            else:
                out.hosts.append(_host(h, w.states[h.name], lock_hash, out.image_id, opts.store, w.fleet_name))
    finally:
        w.close()
    name_the_cause(out)
    try:
        j = J.load(opts.store, w.fleet_name)
    except ConfigError as e:  # (shown, not raised: the hosts' state is what its fix asks to check)
        j, out.deploy = None, str(e)
    if j is not None:
        out.deploy_phase = j.phase
        out.resume = command(opts, "deploy")
        what = "a deploy's rollback" if J.rolling_back(j) else "a deploy"
        also = f" (or `{command(opts, 'start')}`)" if J.rolling_back(j) else ""
        out.deploy = (
            f"{what} did not finish (pid {j.pid}, started {j.started}, stopped while {j.phase}"
            f"{': ' + j.reason if j.reason else ''}); the fleet is not deployed; `{out.resume}`{also} finishes it"
        )
    out.seconds = time.monotonic() - t0
    return out


def name_the_cause(st: FleetStatus) -> None:
    """Of the ranks whose container exited, the first to finish is the cause; the others fell after it."""
    exits = [RankExit(h.host, h.rank, int(h.exit_code) if h.exit_code.lstrip("-").isdigit() else None,
                      h.finished_at, h.log) for h in st.hosts if h.container in ("exited", "dead")]
    st.first_exit = cause_and_consequences(exits)
    if st.first_exit is None:
        return
    for h in st.hosts:
        if h.host == st.first_exit["host"]:
            h.exited = "first"
            h.message = describe_cause(st.first_exit)
        elif any(e["host"] == h.host for e in st.first_exit["consequences"]):
            h.exited = f"after rank {st.first_exit['rank']}"
            e = next(e for e in st.first_exit["consequences"] if e["host"] == h.host)
            h.message = describe_consequence(e, st.first_exit)


def rows(st: FleetStatus) -> tuple[list[str], list[list[str]]]:
    cols = ["host", "rank", "bundle", "lock", "image", "container", "up", "serving"]
    out = []
    for h in st.hosts:
        if not h.reachable:
            out.append([h.host, str(h.rank), "?", "?", "?", "unreachable", "no", "?"])
            continue
        lock = "-" if h.lock_hash is None else ("= lock" if h.on_lock else f"{h.lock_hash[:12]} (other)")
        img = "-" if h.image_id is None else (
            h.image_id.removeprefix("sha256:")[:12] + ("" if h.image_is_lock is not False else " (other)")
        )
        cont = h.container + (
            f" ({h.running_bundle[:12]})" if h.running_bundle and h.running_bundle != h.bundle else ""
        ) + (f" (code {h.exit_code}, {'first: the cause' if h.exited == 'first' else h.exited})" if h.exited else "")
        up = "yes" if h.up else "no"
        if h.role == "head" and h.health is not None and h.health != 200:
            up += f" (/health {h.health})"
        elif h.role == "head" and h.health is None and h.container == "running":
            up += " (/health does not answer)"
        out.append([h.host, f"{h.rank} ({h.role})", (h.bundle or "none")[:12], lock, img, cont, up,
                    serving_summary(h.serving) if h.role == "head" else ""])
    return cols, out
