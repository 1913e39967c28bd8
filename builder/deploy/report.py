"""What a deploy (or a start or stop) did, per host: the JSON scripts read and the exit code.

Per host: the release it ran before (``origin``), the one the deploy moves it to (``target``), what
happened to it (``result``, an `Outcome`) and which side it ends on (``on``, a `Side`). For the fleet:
``result`` (a `FleetResult`), the audits that ran, and the exit code (0 deployed or unchanged and
passing, planned, started or stopped; 1 refused, rolled back or failed; 3 a host could not be reached
and that decided it). docs/deploy.md says what each value means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from builder.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE
from builder.foundation.canon import attrs

#: what happened to one host (HostOutcome.result)
Outcome = Literal[
    "pending",
    "planned",
    "unchanged",
    "staged",
    "switched",
    "repaired",
    "rolled-back",
    "not-switched",
    "started",
    "stopped",
    "unreachable",
    "failed",
]
#: how the command ended for the fleet (DeployReport.result)
FleetResult = Literal["deployed", "unchanged", "planned", "refused", "rolled-back", "failed", "started", "stopped"]
#: which release a host ends on (HostOutcome.on)
Side = Literal["new", "old", "other", "none", "unknown"]


# A comparison with a plain string literal is not checked against the Literal by mypy; one with
# these tuples is, so a misspelt value in a test of a result fails the type check as an assignment does.
def outcomes(*values: Outcome) -> tuple[Outcome, ...]:
    return values


def fleet_results(*values: FleetResult) -> tuple[FleetResult, ...]:
    return values


@dataclass
class HostOutcome:
    host: str
    rank: int
    role: str
    origin: str | None = None
    target: str | None = None
    result: Outcome = "pending"
    on: Side = "unknown"
    message: str = ""
    plan: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            **attrs(self, "rank", "role", "origin", "target", "result", "on", "message"),
            **({"plan": self.plan} if self.plan else {}),
        }


@dataclass
class DeployReport:
    fleet: str
    lane: str
    command: str = "deploy"
    result: FleetResult = "failed"
    reason: str = ""
    unreachable: bool = False
    hosts: list[HostOutcome] = field(default_factory=list)
    audit: dict[str, Any] | None = None  # the last audit of the target (gate, serving or the no-op's)
    rollback_audit: dict[str, Any] | None = None
    resumed: str = ""  # what an earlier, unfinished deploy had left
    target_lock: str | None = None
    seconds: float = 0.0
    steps: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # what a plan could not know (deploy --plan)

    @property
    def exit_code(self) -> int:
        if self.result in fleet_results("deployed", "planned", "started", "stopped"):
            return EXIT_OK
        if self.result in fleet_results("unchanged"):
            return int(self.audit["exit"]) if self.audit and "exit" in self.audit else EXIT_OK
        if self.unreachable:
            return EXIT_UNREACHABLE
        return EXIT_FAILED

    def host(self, name: str) -> HostOutcome:
        for h in self.hosts:
            if h.host == name:
                return h
        raise KeyError(name)

    def fleet_on(self) -> Side | Literal["mixed"]:
        """new, old, none or mixed: which side every host ends on."""
        sides = {h.on for h in self.hosts}
        return sides.pop() if len(sides) == 1 else "mixed"

    def to_json(self) -> dict[str, Any]:
        return {
            **attrs(self, "command", "fleet", "lane", "result"),
            "exit": self.exit_code,
            "reason": self.reason,
            "fleet_on": self.fleet_on(),
            **attrs(self, "resumed", "target_lock"),
            "seconds": round(self.seconds, 3),
            "hosts": {h.host: h.to_json() for h in self.hosts},
            **attrs(self, "audit", "rollback_audit"),
            **({"steps": self.steps} if self.steps else {}),
            **({"unknown": self.unknown} if self.unknown else {}),
        }
