"""What an audit found: each check's outcome per host, the fleet's exit code, and the three ways it is
shown (the matrix and every reason a host did not pass, or JSON, on stdout; a JUnit file)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, unnamed
from builder.foundation.canon import atomic_write, attrs


@dataclass
class CheckOutcome:
    check: str  # "<concern>::<name>"
    concern: str
    status: str  # pass | fail | skip | error
    message: str = ""
    #: what the check recorded beside its outcome (its item's user_properties): the burn's figures, a
    #: rank's exit, ``kind = "hardware"`` for an unhealthy GPU rather than drift
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class HostResult:
    name: str
    fleet: str
    status: str  # pass | drift | unhealthy (a hardware finding) | unreachable | error
    message: str = ""
    checks: list[CheckOutcome] = field(default_factory=list)
    seconds: float = 0.0

    def first_problem(self) -> str:
        """Every failing check's message, hardware findings first (named `first_problem` for what
        callers print: the one line that says why the host did not pass)."""
        if self.status in ("unreachable", "error"):
            return self.message
        return "; ".join(f"{p['check']}: {p['message']}" for p in self.problems())

    def problems(self) -> list[dict[str, str]]:
        """Every reason this host did not pass, one entry each: the host's own (unreachable, the checks
        did not report; check ``""``), then each failing or erroring check, hardware findings first."""
        own = [{"check": "", "status": self.status, "message": self.message}] if self.message else []
        bad = [c for c in self.checks if c.status in ("fail", "error")]
        bad.sort(key=lambda c: c.facts.get("kind") != "hardware")
        return own + [{"check": c.check, "status": c.status, "message": c.message} for c in bad]


@dataclass
class AuditReport:
    hosts: list[HostResult]
    mode: str
    phase: str
    concerns: list[str]
    seconds: float = 0.0
    first_exit: dict[str, Any] | None = None  # the rank whose engine exited first (builder.audit.exits)

    @property
    def exit_code(self) -> int:
        """0 all pass, 1 drift or an unhealthy GPU (or a check errored), 3 a host unreachable (wins over 1)."""
        if any(h.status == "unreachable" for h in self.hosts):
            return EXIT_UNREACHABLE
        if any(h.status in ("drift", "unhealthy", "error") for h in self.hosts):
            return EXIT_FAILED
        return EXIT_OK

    def burn(self) -> dict[str, Any]:
        """The burn's figures per host (the `burn::gpu` check's) and the hosts well under the fleet's
        median TFLOPS (builder.gpu.burn.fleet_outliers); {} when no burn ran."""
        from builder.gpu.burn import fleet_outliers

        hosts = {h.name: c.facts["burn"] for h in self.hosts for c in h.checks if "burn" in c.facts}
        if not hosts:
            return {}
        tflops = {n: float(b["tflops"]) for n, b in hosts.items() if b.get("tflops") is not None}
        return {"hosts": hosts, "outliers": fleet_outliers(tflops)}

    def to_json(self) -> dict[str, Any]:
        burn = self.burn()
        return ({"burn": burn} if burn else {}) | {
            **attrs(self, "mode", "phase", "concerns"),
            "exit": self.exit_code,
            "seconds": round(self.seconds, 3),
            "content": "sha256" if self.mode == "full" else "stat",
            "first_exit": self.first_exit,
            "hosts": {
                h.name: {
                    "fleet": h.fleet,
                    "status": h.status,
                    "message": h.message or h.first_problem(),
                    "problems": h.problems(),
                    "seconds": round(h.seconds, 3),
                    "checks": {c.check: {"status": c.status, "message": c.message,
                                         **({"facts": c.facts} if c.facts else {})} for c in h.checks},
                }
                for h in self.hosts
            },
        }


CELL = {"pass": "pass", "fail": "FAIL", "skip": "skip", "error": "ERROR"}


def burn_rows(report: AuditReport) -> tuple[list[str], list[list[str]]]:
    """host x (TFLOPS, clock, power, temperature, verdict, against the fleet's median)."""
    burn = report.burn()
    cols = ["host", "TFLOPS", "clock MHz", "power W", "max C", "verdict", "fleet"]
    rows = []
    for name, b in (burn.get("hosts") or {}).items():
        cells = ["?" if b.get(k) is None else fmt.format(b[k]) for k, fmt in (
            ("tflops", "{:.1f}"), ("clock_mhz", "{:.0f}"), ("power_w", "{:.0f}"), ("temperature_c", "{:.0f}"))]
        rows.append([name, *cells, str(b.get("verdict")), "SLOW" if name in burn["outliers"] else "ok"])
    return cols, rows


def problem_rows(report: AuditReport) -> tuple[list[str], list[list[str]]]:
    """host x every reason it did not pass (HostResult.problems), hosts in the report's order."""
    rows = [[h.name, h.status, p["check"] or "-", unnamed(h.name, p["message"]) or p["status"]]
            for h in report.hosts if h.status != "pass" for p in h.problems()]
    rows += [[h.name, h.status, "-", h.status] for h in report.hosts if h.status != "pass" and not h.problems()]
    return ["host", "status", "check", "reason"], rows


def _concern_order(concerns: list[str], check_id: str) -> int:
    concern = check_id.split("::")[0]
    return concerns.index(concern) if concern in concerns else len(concerns)


def matrix_rows(report: AuditReport) -> tuple[list[str], list[list[str]]]:
    """Checks x hosts: pass / FAIL / skip / ERROR / unreachable."""
    cols = ["check"] + [h.name for h in report.hosts]
    order: list[str] = []
    for h in report.hosts:
        for c in h.checks:
            if c.check not in order:
                order.append(c.check)
    order.sort(key=lambda cid: _concern_order(report.concerns, cid))
    rows: list[list[str]] = []
    for cid in order:
        row = [cid]
        for h in report.hosts:
            if h.status == "unreachable" and not h.checks:
                row.append("unreachable")
                continue
            found = next((c for c in h.checks if c.check == cid), None)
            row.append(CELL.get(found.status, found.status) if found else "-")
        rows.append(row)
    if not order:
        rows.append(["reachable"] + [h.status for h in report.hosts])
    return cols, rows


def junit_xml(report: AuditReport) -> bytes:
    """One testsuite per host, one testcase per check (drift is a failure, the rest errors)."""
    suites = ET.Element("testsuites", name="builder audit", time=f"{report.seconds:.3f}")
    for h in report.hosts:
        s = ET.SubElement(suites, "testsuite", name=h.name, hostname=h.name, time=f"{h.seconds:.3f}")
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if h.status in ("unreachable", "error") and not h.checks:
            tc = ET.SubElement(s, "testcase", classname=h.name, name="reachable")
            ET.SubElement(tc, "error", message=f"{h.status}: {h.message}", type=h.status)
            counts["tests"] += 1
            counts["errors"] += 1
        for c in h.checks:
            tc = ET.SubElement(s, "testcase", classname=f"{h.fleet}.{h.name}", name=c.check)
            counts["tests"] += 1
            if c.status == "fail":
                ET.SubElement(tc, "failure", message=c.message,
                              type="unhealthy" if c.facts.get("kind") == "hardware" else "drift")
                counts["failures"] += 1
            elif c.status == "error":
                ET.SubElement(tc, "error", message=c.message, type="error")
                counts["errors"] += 1
            elif c.status == "skip":
                ET.SubElement(tc, "skipped", message=c.message)
                counts["skipped"] += 1
        for k, v in counts.items():
            s.set(k, str(v))
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True) + b"\n"


def write_junit(report: AuditReport, path: Path) -> None:
    atomic_write(path, junit_xml(report))
