"""Which rank's engine exited first: the cause, told apart from the ranks that fell after it.

When one rank's engine dies, the others lose their peer and exit too, so every host reports an exited
container. The serving check records each exited rank's exit code, finish time and last log lines
(``exit`` in its facts); `builder audit` and `builder status` name the rank that ended first as the
cause and the others as its consequences. Exits within five seconds of the first count as at once, and
among those a rank killed by SIGKILL (137: also the OOM killer) or SIGSEGV (139) is the cause; a
SIGABRT (134) is what an engine does to itself once its peer is gone, so it is not the cause's mark.
The window exists because the first exit is judged by each host's own clock, as its Docker stamps a
container's end: late by milliseconds on an idle host, by more on a loaded one, and off by however far
the hosts' clocks are apart (keep them in sync: chrony or NTP). Docker's finish times are RFC 3339 with
up to nine fraction digits, trailing zeros dropped, so they are compared as numbers, not as text.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import Any

from builder.audit.findings import AuditReport, CheckOutcome

#: the check whose facts carry a rank's exit
EXIT_CHECK = "serving::rank_runs_the_release"
_TIME = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)$")


@dataclass
class RankExit:
    host: str
    rank: int
    exit_code: int | None
    finished_at: str
    log: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def finished_ns(when: str) -> int | None:
    """Docker's FinishedAt in nanoseconds since the epoch (None when it is not a time, or the zero time
    of a container that never ran)."""
    m = _TIME.match(when.strip())
    if m is None or when.startswith("0001-"):
        return None
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    secs = datetime.datetime.fromisoformat(m.group(1) + zone).timestamp()
    return int(secs) * 10**9 + int((m.group(2) or "0").ljust(9, "0"))


#: exits this close together happened at once, as far as docker's finish times can tell: each host's
#: engine stamps a container's end when it handles the event, some milliseconds late (measured on the
#: simulator fleet: a SIGKILLed worker stamped 9 ms after a follower that lost the head it took down),
#: later on a loaded host, and each by its own host's clock, which may be apart from its peers' by as
#: much as NTP lets it drift; five seconds covers both, and a peer's fall comes within it
AT_ONCE_NS = 5_000_000_000

#: the exit codes of a rank killed from outside or by its own fault: SIGKILL (also the OOM killer) and
#: SIGSEGV; not SIGABRT (134), which an engine raises itself after losing its peer
KILLED = (137, 139)


def killed(e: RankExit) -> bool:
    """Ended by SIGKILL or SIGSEGV, not by its own exit (or abort) after a lost peer."""
    return e.exit_code in KILLED


def order(exits: list[RankExit]) -> list[RankExit]:
    """The exits, the cause first: of those that ended at once with the earliest (AT_ONCE_NS), one killed
    by a signal, else the earliest; then the rest by time (a time that cannot be read goes last)."""
    timed = sorted(exits, key=lambda e: (finished_ns(e.finished_at) is None, finished_ns(e.finished_at) or 0, e.rank))
    known = [(ns, e) for e in timed if (ns := finished_ns(e.finished_at)) is not None]
    if not known:
        return timed
    at_once = [e for ns, e in known if ns - known[0][0] <= AT_ONCE_NS]
    first = next((e for e in at_once if killed(e)), at_once[0])
    return [first, *(e for e in timed if e is not first)]


def cause_and_consequences(exits: list[RankExit]) -> dict[str, Any] | None:
    """{"host", "rank", "exit_code", "finished_at", "log", "consequences": [{host, rank, …}]}: the rank
    that exited first and those that exited after it; None when no rank exited."""
    if not exits:
        return None
    first, *rest = order(exits)
    return {**first.to_json(), "consequences": [e.to_json() for e in rest]}


def describe_cause(e: dict[str, Any]) -> str:
    return (f"rank {e['rank']} ({e['host']}) exited first (exit code {e['exit_code']} at {e['finished_at']}): "
            f"the cause; its last log lines: {e.get('log') or '(none)'}")


def describe_consequence(e: dict[str, Any], cause: dict[str, Any]) -> str:
    return (f"rank {e['rank']} exited after rank {cause['rank']} ({cause['host']}) (exit code {e['exit_code']} at "
            f"{e['finished_at']}): a consequence")


def name_the_cause(report: AuditReport) -> AuditReport:
    """Find each exited rank in the report (its serving check's facts), name the first as the cause and
    the others as its consequences in their check's message, that check put first on its host (what
    the host's one-line problem shows), and keep the finding as ``report.first_exit``."""
    exits: list[RankExit] = []
    where: dict[str, CheckOutcome] = {}
    for h in report.hosts:
        for c in h.checks:
            fact = c.facts.get("exit") if c.check == EXIT_CHECK else None
            if isinstance(fact, dict):
                code = fact.get("exit_code")
                exits.append(RankExit(h.name, int(fact.get("rank") or 0), code if isinstance(code, int) else None,
                                      str(fact.get("finished_at") or ""), str(fact.get("log") or "")))
                where[h.name] = c
    found = cause_and_consequences(exits)
    report.first_exit = found
    if found is None:
        return report
    for h in report.hosts:
        if h.name not in where:
            continue
        c = where[h.name]
        if h.name == found["host"]:
            c.message = describe_cause(found)
        else:
            e = next(x for x in found["consequences"] if x["host"] == h.name)
            c.message = f"{describe_consequence(e, found)}; its last log lines: {e.get('log') or '(none)'}"
        h.checks.remove(c)
        h.checks.insert(0, c)
    return report
