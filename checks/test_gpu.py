"""GPU: count, name, compute capability, driver and CUDA versions, persistence mode, clocks and
clock-event reasons, the clock latch, and no other compute process. One nvidia-smi call per query,
parsed here with builder.gpu. Where no GPU is expected (gpu_count = 0) and none is found, the checks
skip. A busy, healthy GPU passes: the software power cap (0x4) is what a GPU at full load shows, and
the lane's own processes are the lane's. What is wrong with the GPU itself (a slowdown bit, the latch)
is reported as a hardware finding (the host is `unhealthy`, not drifted)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from checklib import (
    Cmd,
    Concern,
    argv_command,
    exists,
    gpu_commands,
    gpu_report,
    lane_docker,
    or_skip,
    own_gpu_pids,
    run,
)

if TYPE_CHECKING:  # builder.gpu imports pydantic: only load it where a host has nvidia-smi
    from builder import gpu as G


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """This rank's containers (where docker is expected) and nvidia-smi's queries (where GPUs are)."""
    if not expect["expect"].get("gpu_count"):
        return lane_docker(expect)
    from builder.gpu.burn import sample_command

    return lane_docker(expect) + gpu_commands() + [argv_command(sample_command())]


CONCERN = Concern(name="gpu", order=50, phase="preflight", containers=True, prefetch=planned)


@pytest.fixture(scope="module")
def report(host: Any, expect: dict[str, Any]) -> G.GpuReport:
    want = expect["expect"]["gpu_count"]
    if not exists(host, "nvidia-smi"):
        if want == 0:
            pytest.skip("no GPU expected on this host and no nvidia-smi found")
        pytest.fail(f"nvidia-smi: expected on PATH ({want} GPU(s) expected), found none")

    from builder import gpu as G

    try:
        return gpu_report(host)  # type: ignore[no-any-return]
    except G.GpuError as e:
        pytest.fail(f"nvidia-smi: expected a readable report, found: {e}")


def _gpus(report: G.GpuReport) -> list[G.GpuInfo]:
    if not report.gpus:
        pytest.fail("GPUs: expected at least one, found none")
    return report.gpus


def test_count(report: G.GpuReport, expect: dict[str, Any]) -> None:
    want = expect["expect"]["gpu_count"]
    assert len(report.gpus) == want, f"GPU count: expected {want}, found {len(report.gpus)}"


def test_name(report: G.GpuReport, expect: dict[str, Any]) -> None:
    want = or_skip(expect["expect"].get("gpu_name"), "no gpu_name in the host's expectations")
    for g in _gpus(report):
        assert g.name == want, f"GPU {g.index} name: expected {want!r}, found {g.name!r}"


def test_compute_capability(report: G.GpuReport, expect: dict[str, Any]) -> None:
    want = or_skip(expect["expect"].get("compute_cap"), "no compute_cap in the host's expectations")
    for g in _gpus(report):
        assert g.compute_cap == want, (
            f"GPU {g.index} compute capability: expected {want}, found {g.compute_cap}"
        )


def test_driver_version(report: G.GpuReport, expect: dict[str, Any]) -> None:
    want = or_skip(expect["expect"].get("driver_version"), "no driver_version in the host's expectations")
    assert report.driver_version == want, f"driver version: expected {want}, found {report.driver_version}"


def test_cuda_version(report: G.GpuReport, expect: dict[str, Any]) -> None:
    want = or_skip(expect["expect"].get("cuda_version"), "no cuda_version in the host's expectations")
    assert report.cuda_version == want, f"CUDA version: expected {want}, found {report.cuda_version}"


def test_persistence_mode(report: G.GpuReport, expect: dict[str, Any]) -> None:
    want = expect["expect"].get("persistence_mode")
    if want is None:
        pytest.skip("persistence_mode not set in the host's expectations")
    gpus = _gpus(report)
    unknown = [g.index for g in gpus if g.persistence_mode is None]
    for g in gpus:
        assert g.persistence_mode in (want, None), (
            f"GPU {g.index} persistence mode: expected {'on' if want else 'off'}, found "
            f"{'on' if g.persistence_mode else 'off'}"
        )
    if unknown:  # ([N/A] or [Not Supported]: unknown, never a pass or a failure)
        pytest.skip(f"GPU {', '.join(map(str, unknown))}: persistence mode not reported ([N/A]); "
                    "nothing stands in for it")


def test_clock_ceiling(report: G.GpuReport, expect: dict[str, Any]) -> None:
    want = or_skip(expect["expect"].get("gpu_clock_mhz"), "no gpu_clock_mhz target in the host's expectations")
    gpus = _gpus(report)
    for g in gpus:
        assert g.clocks_max_sm_mhz is None or g.clocks_max_sm_mhz >= want, (
            f"GPU {g.index} max SM clock: expected >= {want} MHz, found {g.clocks_max_sm_mhz} MHz"
        )
    unknown = [g.index for g in gpus if g.clocks_max_sm_mhz is None]
    if unknown:  # ([N/A]: unknown, never a pass or a failure)
        pytest.skip(f"GPU {', '.join(map(str, unknown))}: max SM clock not reported ([N/A]); the clock is judged "
                    "under load instead (gpu::clock_latch, burn::gpu)")


def test_clock_event_reasons(report: G.GpuReport, finding: Any) -> None:
    """No hardware slowdown, thermal slowdown or power brake (0x8, 0x20, 0x40, 0x80) on any GPU; the
    software power cap (0x4) of a GPU at full load is healthy (lessons.md §9.1)."""
    from builder import gpu as G

    gpus = _gpus(report)
    if all(g.event_reasons is None for g in gpus):
        pytest.skip("clock event reasons not reported by this driver")
    bad = [f"GPU {g.index}: {', '.join(G.trouble_reasons(g.event_reasons))} ({g.event_reasons:#x})"
           for g in gpus if g.event_reasons is not None and g.throttled]
    if bad:
        finding("kind", "hardware")
    assert not bad, (
        f"clock event reasons: expected no hardware, thermal or power-brake slowdown, found {'; '.join(bad)} "
        "(check the cooling and the power supply)"
    )


@pytest.fixture(scope="module")
def samples(host: Any) -> list[G.GpuInfo]:
    """Each GPU's clock, power and load now (builder.gpu.burn.SAMPLE_FIELDS; where the driver refuses a
    field of it, FALLBACK_SAMPLE_FIELDS: one unknown field fails the whole query, lessons.md §9.1)."""
    from builder import gpu as G
    from builder.gpu.burn import FALLBACK_SAMPLE_FIELDS, SAMPLE_FIELDS, sample_command

    fields = SAMPLE_FIELDS
    r = run(host, *argv_command(sample_command()))
    if r.rc != 0 and "is not a valid field to query" in r.stdout + r.stderr:
        fields = FALLBACK_SAMPLE_FIELDS
        r = run(host, *argv_command(sample_command(fallback=True)))
    try:
        if r.rc != 0:
            G.parse_query(r.stdout + r.stderr, fields)  # (the failure's own words)
            raise G.GpuError(f"exit status {r.rc}")
        return G.parse_query(r.stdout, fields)
    except G.GpuError as e:
        pytest.skip(f"clock, power and load not readable on this driver: {e}")


def test_clock_latch(report: G.GpuReport, samples: list[G.GpuInfo], finding: Any) -> None:
    """A busy GPU at low clocks and low power is the latch (recipes.md §14 #5: a GB10 at 630-950 MHz
    and about 18 W under load; no reason bit names it). Low clocks on an idle GPU are its rest."""
    from builder.gpu.burn import LATCH_FIX, band_for, busy

    bad, busy_seen = [], False
    for s in samples:
        band = band_for(s.name)
        if band is None or not band.latch_clock_mhz or not busy(s):
            continue
        busy_seen = True
        if s.clocks_sm_mhz is None or s.power_draw_w is None:
            continue
        if s.clocks_sm_mhz <= band.latch_clock_mhz and s.power_draw_w <= band.latch_power_w:
            bad.append(f"GPU {s.index} busy ({s.utilization_pct}%) at {s.clocks_sm_mhz} MHz and {s.power_draw_w:g} W "
                       f"(healthy {band.healthy})")
    if bad:
        finding("kind", "hardware")
    assert not bad, f"clock latch: expected a busy GPU at its clocks, found {'; '.join(bad)}; fix: {LATCH_FIX}"
    if not busy_seen:
        names = sorted({str(s.name) for s in samples})
        if not any(band_for(n) for n in names):
            pytest.skip(f"no health band for {', '.join(names)} (builder.gpu.burn.BANDS)")
        pytest.skip("GPU idle: the latch shows only under load (burn::gpu judges it)")


def test_no_other_compute_process(host: Any, report: G.GpuReport, expect: dict[str, Any]) -> None:
    """No compute process on the GPU but the lane's own (its environment names this lane, fleet and
    rank, or it runs in this rank's container of the installed release): before start none at all."""
    own, note = own_gpu_pids(host, expect, [a.pid for a in report.compute_apps])
    apps = [a for a in report.compute_apps if a.pid not in own]
    shown_apps = [f"pid {a.pid} {a.process_name} ({a.used_memory_mib} MiB)" for a in apps]
    assert not shown_apps, (
        f"compute processes: expected none but the lane's own, found {len(shown_apps)}: {', '.join(shown_apps[:3])}"
        + (f" ({note})" if note else "")
    )
