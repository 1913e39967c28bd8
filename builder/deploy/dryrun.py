"""A deploy's plan (``--dry-run``, asking the hosts; ``--plan``, from the lock and fleet file alone),
its no-op (every host runs its new bundle already: only audit), and what it says of an earlier deploy
that did not finish."""

from __future__ import annotations

from builder.deploy import journal as J
from builder.deploy.deployment import Deployment
from builder.deploy.fleetaudit import audit, problems
from builder.deploy.fleetwork import short
from builder.deploy.options import command
from builder.deploy.report import DeployReport
from builder.deploy.servingrecords import keep
from builder.launch.order import start_groups


def describe_earlier(d: Deployment, j: J.Journal) -> str:
    """What an unfinished earlier deploy left, host by host, and what this one will do about it."""
    same = all(d.out(h).target == j.target.get(h.name) for h in d.w.hosts)
    where = "; ".join(
        f"{h.name} on {'the new' if d.w.states[h.name].current == j.target.get(h.name) else 'the old' if d.w.states[h.name].current == j.origin.get(h.name) else 'another'} release"  # noqa: E501
        for h in d.w.hosts
    )
    return (
        f"an earlier deploy of fleet {j.fleet} (pid {j.pid}, started {j.started}) did not finish "
        f"(it stopped while {j.phase}{': ' + j.reason if j.reason else ''}); {where}. This deploy moves "
        f"every host to {'that' if same else 'the new'} release, or on a failure back to the release "
        "each ran before it"
    )


def is_noop(d: Deployment) -> bool:
    return not changes(d)


def changes(d: Deployment) -> list[str]:
    """Why the fleet is not already deployed and serving (empty: it is)."""
    w, why = d.w, []
    for h in w.hosts:
        st, o = w.states[h.name], d.out(h)
        if o.target is None or st.installed != o.target:
            why.append(f"{h.name}: {short(st.installed)} installed, new bundle {short(o.target)}")
        elif not st.up_on(o.target):
            why.append(f"{h.name}: rank {h.rank} is not up on it")
    head = w.states[w.head.name]
    if not why and not head.healthy:
        why.append(f"{w.head.name}: /health does not answer ({(head.health or {}).get('error') or head.health})")
    return why


def plan(d: Deployment, stale: dict[str, str]) -> DeployReport:
    """The dry run: what each host runs and would get, and the steps a deploy would take."""
    w, rep = d.w, d.rep
    rep.result = "planned"
    for h in w.hosts:
        o, st = d.out(h), w.states[h.name]
        up = st.running[0].bundle if st.running else None
        o.result = "planned"
        new = o.target or f"(a new bundle: {stale.get(h.name, '?')})"
        o.plan = [
            f"runs {short(up) if up else 'nothing'}; installed {short(st.installed)}",
            f"bundle: {short(o.target) if o.target else new}"
            + ("" if o.target is None or st.installed != o.target else " (installed already)"),
            "stage: "
            + ("the release already on the host" if o.target and o.target in st.releases else "ship the bundle"),
        ]
    if is_noop(d):
        rep.reason = "every host runs its bundle already: a deploy would only audit the fleet (--phase all)"
        rep.steps = ["audit --phase all"]
        return rep
    rep.steps = _steps(d, stale)
    rep.reason = "dry run: nothing was changed"
    return rep


#: what a plan made from the lock and the fleet file alone cannot know (deploy --plan)
NOT_KNOWN = [
    "what each host runs and has installed (its release, its containers): a host may run this lock "
    "already, in which case a deploy only audits",
    "which releases each host holds (a staged one is not shipped again)",
    "whether the head answers its health check",
    "what the gate, the burn and the serving audit will find",
]


def plan_offline(d: Deployment, stale: dict[str, str]) -> DeployReport:
    """The plan from the lock and the fleet file alone (``--plan``): each host's bundle and the steps a
    deploy would take, with what only the hosts could tell (NOT_KNOWN); no host is contacted."""
    w, rep = d.w, d.rep
    rep.result = "planned"
    for h in w.hosts:
        o = d.out(h)
        o.result = "planned"
        o.plan = [
            "runs: not known (no host was contacted)",
            f"bundle: {short(o.target) if o.target else f'(a new bundle: {stale.get(h.name, chr(63))})'}",
            "stage: ship the bundle, unless the host holds its release already",
        ]
    rep.steps = _steps(d, stale)
    rep.unknown = list(NOT_KNOWN)
    rep.reason = "plan from the lock and the fleet file; no host was contacted, nothing was changed"
    return rep


def _steps(d: Deployment, stale: dict[str, str]) -> list[str]:
    """The steps a deploy that changes the fleet takes, in order."""
    w = d.w
    s = w.lane.serve
    heads, workers = w.head.name, ", ".join(h.name for h in w.workers) or "no workers"
    order = ", then ".join(" and ".join(h.name for h in g) for g in start_groups(w.fleet, w.lane))
    return [
        f"bundle: {', '.join(stale) + ' made again' if stale else 'every bundle is current'}",
        f"stage on every host, {w.limit()} at once (ship with install --stage; current is not touched)",
        "gate: the preflight audit of the staged release on every host (no host switches unless all pass)",
        f"stop the running release: the head {heads} first, then {workers}",
        "switch every host to its new release",
        f"start in the lane's order ({order}), each until it is ready; wait for {w.lane.health} on port "
        f"{s.port} (at most {w.opts.start_timeout or w.lane.start_timeout:g} s a rank)",
        "serving audit of the fleet",
        "on any failure after the first switch: stop, switch every host back to what it ran, start that "
        "in order and audit it",
    ]


def noop(d: Deployment, earlier: J.Journal | None) -> DeployReport:
    """Every host runs its new bundle already: only the audit."""
    w, rep = d.w, d.rep
    w.say(f"fleet {w.fleet_name}: every host runs its new bundle already; auditing")
    rep.audit = audit(w, "all").to_json()
    code = int(rep.audit.get("exit", 1))
    for h in w.hosts:
        d.out(h).result = "unchanged"
    if code == 0:
        keep(w, rep.audit, d.out(w.head).target)
        if earlier is not None:
            J.clear(w.opts.store, w.fleet_name)
            rep.result = "deployed"
            rep.reason = "the earlier deploy had moved every host; the fleet serves and passes its audit"
            return rep
        rep.result = "unchanged"
        rep.reason = "already deployed and serving; the audit passes"
    else:
        rep.result = "unchanged"
        rep.unreachable = code == 3
        rep.reason = (
            f"already deployed, but the audit fails: {problems(rep.audit)}; "
            f"`{command(w.opts, 'deploy', '--repair', mode=True)}` places again every file that differs "
            "from its bundle or record, and reinstalls the lock's release on the hosts that drifted"
        )
    return rep

