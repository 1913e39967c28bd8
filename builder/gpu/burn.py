"""The burn gate's judgment: a short load's TFLOPS and the clocks, power, temperature and clock event
reasons sampled while it ran (builder.hostscripts.burnload), against the GPU model's health band.

A latched GB10 (recipes.md §14 #4 and #5, §16 #8) names itself by no reason bit: it shows only as low
clocks at low power while busy, with few TFLOPS. A thermal or hardware slowdown does set a bit
(lessons.md §9.1). So the verdict reads both:

- ``pass``: TFLOPS at or above the band's floor and no trouble bit;
- ``throttled``: a hardware, thermal or power-brake slowdown bit was set under load (named);
- ``latched``: under the floor, with the sustained clock and power both under the band's latch
  ceilings; its fix is a power cycle, not a reboot;
- ``slow``: under the floor otherwise;
- ``error``: the load did not run or did not report (its own output says why).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from builder.gpu.events import decode_event_reasons, trouble_reasons
from builder.gpu.parse import parse_query, query_command
from builder.gpu.readings import GpuInfo
from builder.gpu.values import GpuError

#: What one sample reads, every ~0.5 s while the load runs.
SAMPLE_FIELDS: list[str] = [
    "index", "name", "clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu",
    "utilization.gpu", "clocks_event_reasons.active", "memory.used",
]

# One unknown field fails the whole query (lessons.md §9.1) and the GB10's field support was never
# captured: where SAMPLE_FIELDS is refused, the older event-reason name, without temperature and load
# (busy() then reads the idle bit).
FALLBACK_SAMPLE_FIELDS: list[str] = [
    "index", "name", "clocks.sm", "clocks.max.sm", "power.draw", "power.limit",
    "clocks_throttle_reasons.active", "memory.used",
]

LATCH_FIX = ("power-cycle the host with its power adapter unplugged for 30 to 60 s (a reboot does not clear "
             "the latch; recipes.md §14 #5)")
THROTTLE_FIX = "check the cooling and the power supply (airflow, fans, ambient temperature, the PSU and its cable)"


@dataclass(frozen=True)
class Band:
    """A GPU model's health under the burn's load (fp16 matmul, 4096²)."""

    model: str
    #: the floor: fewer TFLOPS fail
    min_tflops: float
    #: what healthy GPUs of this model were measured at (for the report; the floor judges)
    healthy: str
    #: under the floor, a sustained SM clock and power draw both at or below these is the latch
    latch_clock_mhz: int
    latch_power_w: float
    source: str


#: The bands builder knows, by the name nvidia-smi gives the GPU. A host profile may set its own
#: floor (`[hosts.expect.burn] min_tflops`).
BANDS: dict[str, Band] = {
    "NVIDIA GB10": Band(
        model="NVIDIA GB10", min_tflops=50.0,
        healthy="75-90 TFLOPS at 2200-2400 MHz and 80 W or more",
        # latched Sparks sat at 630-950 MHz and about 18 W; healthy ones at 2.2 GHz and 80 W or more
        latch_clock_mhz=1200, latch_power_w=40.0,
        source="recipes.md §14 #4-#5, §16 #8",
    ),
    "NVIDIA H200": Band(
        model="NVIDIA H200", min_tflops=450.0,
        healthy="580-650 TFLOPS at 1395-1485 MHz and 680-695 W (sw_power_cap set)",
        # no H200 latch is on record: the rule is the GB10's, low clocks at low power under load
        latch_clock_mhz=900, latch_power_w=200.0,
        source="docs/burn-h200.md (measured 2026-12-04) and lessons.md §9.1",
    ),
}


def sample_command(nvidia_smi: str = "nvidia-smi", fallback: bool = False) -> list[str]:
    return query_command(FALLBACK_SAMPLE_FIELDS if fallback else SAMPLE_FIELDS, nvidia_smi)


def sample_fields(facts: dict[str, Any]) -> list[str]:
    """The field list the sampler's samples answer (builder.hostscripts.burnload's ``fields``)."""
    return FALLBACK_SAMPLE_FIELDS if facts.get("fields") == "fallback" else SAMPLE_FIELDS


@dataclass
class BurnResult:
    """One host's burn: its figures and verdict (what the audit's report and the fleet view show)."""

    verdict: str  # pass | slow | latched | throttled | error
    message: str
    tflops: float | None = None
    clock_mhz: int | None = None
    power_w: float | None = None
    temperature_c: int | None = None
    reasons: list[str] = field(default_factory=list)
    band: str = ""
    min_tflops: float | None = None
    fix: str = ""
    samples: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """'612.4 TFLOPS, 1440 MHz, 690 W, 52 C: pass' (unknown figures as '?')."""
        def f(v: float | None, unit: str, fmt: str = ".0f") -> str:
            return "?" + unit if v is None else f"{v:{fmt}}{unit}"
        return (f"{f(self.tflops, ' TFLOPS', '.1f')}, {f(self.clock_mhz, ' MHz')}, {f(self.power_w, ' W')}, "
                f"{f(self.temperature_c, ' C')}: {self.verdict}")


def load_report(stdout: str) -> dict[str, Any]:
    """The load's JSON line (its last line holding a JSON object with tflops or error)."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and ("tflops" in doc or "error" in doc):
                return doc
    raise GpuError("burn: the load printed no JSON line with its TFLOPS")


def loaded_samples(facts: dict[str, Any], index: int = 0) -> tuple[list[GpuInfo], list[str]]:
    """GPU `index` in each sample taken while the load kept it busy, and one line per sample that could
    not be read. Busy: utilization at 50% or more where the GPU reports it, else no idle bit; the
    load's own start (importing torch takes seconds) and end are the GPU at rest, not under load."""
    gpus: list[GpuInfo] = []
    bad: list[str] = []
    fields = sample_fields(facts)
    for s in facts.get("samples") or []:
        if float(s.get("t", -1)) < 0:
            continue
        if s.get("rc") != 0:
            bad.append(f"t={s.get('t')}: exit {s.get('rc')}: {str(s.get('out', '')).strip()[:80]}")
            continue
        try:
            rows = parse_query(str(s.get("out", "")), fields)
        except GpuError as e:
            bad.append(f"t={s.get('t')}: {e}")
            continue
        gpus += [g for g in rows if g.index == index and busy(g)]
    return gpus, bad


def busy(g: GpuInfo) -> bool:
    if g.utilization_pct is not None:
        return g.utilization_pct >= 50
    return g.event_reasons is not None and not g.event_reasons & 0x1


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def band_for(gpu_name: str | None, min_tflops: float | None = None) -> Band | None:
    """The band of a GPU model (None when builder knows none and the profile sets no floor)."""
    b = BANDS.get(gpu_name or "")
    if min_tflops is not None:
        base = b or Band(model=gpu_name or "?", min_tflops=min_tflops, healthy="(set in the host profile)",
                         latch_clock_mhz=0, latch_power_w=0.0, source="the host profile")
        source = "the host profile (min_tflops)" if b is not None else base.source
        b = Band(**{**asdict(base), "min_tflops": float(min_tflops), "source": source})
    return b


def judge(facts: dict[str, Any], band: Band, index: int = 0) -> BurnResult:
    """The verdict of one burn (the facts builder.hostscripts.burnload printed) against `band`."""
    res = BurnResult(verdict="error", message="", band=band.model, min_tflops=band.min_tflops,
                     seconds=float(facts.get("seconds") or 0.0))
    gpus, bad = loaded_samples(facts, index)
    res.samples = len(gpus)
    c, p, mask = _read_samples(res, gpus)
    doc, failure = _load_report(facts, index, res.seconds)
    if doc is None:
        res.message = failure
        return res
    res.tflops = float(doc["tflops"])
    if not gpus:
        why = f" ({bad[0]})" if bad else ""
        res.message = f"burn: no sample showed GPU {index} busy while the load ran{why}"
        return res
    _give_verdict(res, band, index, c, p, mask)
    return res


def _read_samples(res: BurnResult, gpus: list[GpuInfo]) -> tuple[float | None, float | None, int]:
    """The loaded samples' median clock and power, hottest temperature and event reasons, into ``res``;
    the median clock and power unrounded, and the reasons' mask."""
    clocks = [float(g.clocks_sm_mhz) for g in gpus if g.clocks_sm_mhz is not None]
    power = [g.power_draw_w for g in gpus if g.power_draw_w is not None]
    temps = [g.temperature_c for g in gpus if g.temperature_c is not None]
    c, p = _median(clocks), _median(power)
    res.clock_mhz = None if c is None else round(c)
    res.power_w = None if p is None else round(p, 1)
    res.temperature_c = max(temps) if temps else None
    mask = 0
    for g in gpus:
        mask |= g.event_reasons or 0
    res.reasons = decode_event_reasons(mask)
    return c, p, mask


def _load_report(facts: dict[str, Any], index: int, seconds: float) -> tuple[dict[str, Any] | None, str]:
    """The load's report; or None and why the load did not run to a result (its timeout and any failed
    cleanup, what it printed, or the error it reported)."""
    if facts.get("timed_out"):
        message = f"burn of GPU {index}: the load did not finish within its timeout ({seconds:.0f} s)"
        failed = [c for c in facts.get("cleanup") or [] if c.get("when") == "after timeout" and c.get("rc") != 0]
        if failed:
            out = str(failed[0].get("out") or "").strip().splitlines()
            message += f"; its cleanup failed (exit {failed[0].get('rc')}{': ' + out[-1][:160] if out else ''})"
        return None, message
    try:
        doc = load_report(str(facts.get("stdout") or ""))
    except GpuError as e:
        err = str(facts.get("stderr") or "").strip().splitlines()
        why = str(e).replace("burn:", f"burn of GPU {index}:", 1)
        return None, f"{why} (exit {facts.get('rc')}{': ' + err[-1][:160] if err else ''})"
    if "error" in doc:
        return None, f"burn of GPU {index}: the load failed: {doc['error']}"
    return doc, ""


def _give_verdict(res: BurnResult, band: Band, index: int, c: float | None, p: float | None, mask: int) -> None:
    """Throttled, pass, latched or slow, with its message and fix, for a load that reported its TFLOPS."""
    assert res.tflops is not None
    trouble = trouble_reasons(mask)
    if trouble:
        res.verdict, res.fix = "throttled", THROTTLE_FIX
        res.message = (f"GPU {index} slowed down under load: {', '.join(trouble)} ({mask & ~0x1:#x}); "
                       f"{res.summary()}; fix: {res.fix}")
        return
    if res.tflops >= band.min_tflops:
        res.verdict = "pass"
        res.message = f"GPU {index}: {res.summary()} (floor {band.min_tflops:g} TFLOPS; healthy {band.healthy})"
        return
    latched = (c is not None and p is not None and c <= band.latch_clock_mhz and p <= band.latch_power_w)
    if latched:
        res.verdict, res.fix = "latched", LATCH_FIX
        res.message = (f"GPU {index} clock latch: {res.tflops:.1f} TFLOPS at {res.clock_mhz} MHz and "
                       f"{res.power_w:g} W under load (expected >= {band.min_tflops:g} TFLOPS; healthy "
                       f"{band.healthy}); fix: {res.fix}")
        return
    res.verdict = "slow"
    res.message = (f"GPU {index} slow: {res.summary()}, expected >= {band.min_tflops:g} TFLOPS "
                   f"(healthy {band.healthy})")


def fleet_outliers(tflops: dict[str, float], fraction: float = 0.85) -> dict[str, str]:
    """Hosts whose TFLOPS are under `fraction` of the fleet's median, each with a line that says so:
    the slowest GPU sets the pace of every rank (recipes.md §14 #4)."""
    if len(tflops) < 2:
        return {}
    med = statistics.median(tflops.values())
    return {
        h: f"{v:.1f} TFLOPS is {v / med:.0%} of the fleet's median {med:.1f}: the slowest GPU sets the fleet's pace"
        for h, v in sorted(tflops.items())
        if v < fraction * med
    }
