"""What a deploy (or a start or stop) did, per host: the JSON scripts read and the exit code.

Per host: the release it ran before (``origin``), the one the deploy moves it to (``target``), what
happened to it (``result``) and which side it ends on (``on``: ``new``, ``old``, ``none`` when nothing
is installed, ``unknown`` when it could not be reached). For the fleet: ``result`` (``deployed``,
``unchanged``, ``planned``, ``refused``: nothing was switched; ``rolled-back``: every host is back on
what it ran; ``failed``: the rollback did not finish; the message says which hosts are where), the
audits that ran, and the exit code (0 deployed or unchanged and passing, or planned; 1 refused,
rolled back or failed; 3 a host could not be reached and that decided it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from builder.canon import attrs
from builder.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE

RESULTS = ("deployed", "unchanged", "planned", "refused", "rolled-back", "failed", "started", "stopped")


@dataclass
class HostOutcome:
    host: str
    rank: int
    role: str
    origin: str | None = None
    target: str | None = None
    #: unchanged | staged | switched | rolled-back | not-switched | stopped | started | unreachable | failed
    result: str = "pending"
    on: str = "unknown"  # new | old | none | unknown
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
    result: str = "failed"
    reason: str = ""
    unreachable: bool = False
    hosts: list[HostOutcome] = field(default_factory=list)
    audit: dict[str, Any] | None = None  # the last audit of the target (gate, serving or the no-op's)
    rollback_audit: dict[str, Any] | None = None
    resumed: str = ""  # what an earlier, unfinished deploy had left
    target_lock: str | None = None
    seconds: float = 0.0
    steps: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.result in ("deployed", "planned", "started", "stopped"):
            return EXIT_OK
        if self.result == "unchanged":
            return int(self.audit["exit"]) if self.audit and "exit" in self.audit else EXIT_OK
        if self.unreachable:
            return EXIT_UNREACHABLE
        return EXIT_FAILED

    def host(self, name: str) -> HostOutcome:
        for h in self.hosts:
            if h.host == name:
                return h
        raise KeyError(name)

    def fleet_on(self) -> str:
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
        }
