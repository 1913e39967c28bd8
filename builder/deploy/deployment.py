"""One deploy's state, shared by its steps (plan, stage, switch, rollback): the fleet, the report, the
bundles and the journal, and the words for where each host stands (``on``: new, old, none, other)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from builder.deploy import journal as J
from builder.deploy.fleetwork import Fleetwork
from builder.deploy.report import DeployReport, HostOutcome, Side, outcomes

if TYPE_CHECKING:
    from builder.deploy.bundles import FleetBundle
    from builder.inputs.hosts import Host


class Deployment:
    def __init__(self, w: Fleetwork) -> None:
        self.w = w  # (with the command's options and where it says what it does: w.opts, w.say)
        self.rep = w.report("deploy")
        self.bundles: dict[str, FleetBundle] = {}
        self.journal: J.Journal | None = None
        self.repair: set[str] = set()  # hosts whose release is reinstalled from its bundle (--repair)
        self.rehash = False  # --repair: every file hashed as it is staged, none trusted by its stat
        self.replaced: dict[str, list[str]] = {}  # host -> what differed and was placed or made again

    def out(self, h: Host | str) -> HostOutcome:
        return self.rep.host(h if isinstance(h, str) else h.name)

    def phase(self, name: str) -> None:
        """Record in the journal the phase the deploy enters (a killed deploy's rerun reads it)."""
        assert self.journal is not None
        self.journal.phase = name
        J.save(self.w.opts.store, self.journal)

    def refuse(self, reason: str, *, unreachable: bool = False) -> DeployReport:
        """Nothing was switched: the report says why."""
        rep = self.rep
        rep.result, rep.reason, rep.unreachable = "refused", reason, rep.unreachable or unreachable
        for o in rep.hosts:
            if o.result in outcomes("pending", "staged"):
                o.result = "not-switched"
        if self.rep.resumed:
            rep.reason += f"; the fleet is as the earlier deploy left it ({self.sides()})"
        return rep

    def side(self, h: Host) -> Side:
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
        """The lock the host's old release was deployed from (what its rollback is audited against)."""
        if earlier is not None and h.name in earlier.origin_locks:
            return earlier.origin_locks[h.name]
        st = self.w.states[h.name]
        return (st.applied or {}).get("lock_hash") if st.applied else None
