"""GPU: count, name, compute capability, driver and CUDA versions, persistence mode, clocks and
clock-event reasons, and no other compute process. One nvidia-smi call per query, parsed here
with builder.gpu. Where no GPU is expected (gpu_count = 0) and none is found, the checks skip."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from checklib import (
    Cmd,
    Concern,
    argv_command,
    container_pids,
    exists,
    gpu_commands,
    lane_container,
    lane_docker,
    lane_owns_running_release,
    or_skip,
    run,
)

if TYPE_CHECKING:  # builder.gpu imports pydantic: only load it where a host has nvidia-smi
    from builder import gpu as G


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """This rank's containers (where docker is expected) and nvidia-smi's queries (where GPUs are)."""
    return lane_docker(expect) + (gpu_commands() if expect["expect"].get("gpu_count") else [])


CONCERN = Concern(name="gpu", order=50, phase="preflight", containers=True, prefetch=planned)


@pytest.fixture(scope="module")
def report(host: Any, expect: dict[str, Any]) -> G.GpuReport:
    want = expect["expect"]["gpu_count"]
    if not exists(host, "nvidia-smi"):
        if want == 0:
            pytest.skip("no GPU expected on this host and no nvidia-smi found")
        pytest.fail(f"nvidia-smi: expected on PATH ({want} GPU(s) expected), found none")

    def runner(argv: list[str]) -> tuple[int, str, str]:
        r = run(host, *argv_command(argv))
        return r.rc, r.stdout, r.stderr

    from builder import gpu as G

    try:
        return G.probe(runner)
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
    for g in _gpus(report):
        found = "unknown" if g.persistence_mode is None else ("on" if g.persistence_mode else "off")
        assert g.persistence_mode == want, (
            f"GPU {g.index} persistence mode: expected {'on' if want else 'off'}, found {found}"
        )


def test_clock_ceiling(report: G.GpuReport, expect: dict[str, Any]) -> None:
    want = or_skip(expect["expect"].get("gpu_clock_mhz"), "no gpu_clock_mhz target in the host's expectations")
    for g in _gpus(report):
        assert g.clocks_max_sm_mhz is not None and g.clocks_max_sm_mhz >= want, (
            f"GPU {g.index} max SM clock: expected >= {want} MHz, found {g.clocks_max_sm_mhz} MHz"
        )


def test_clock_event_reasons(report: G.GpuReport) -> None:
    for g in _gpus(report):
        if g.event_reasons is None:
            pytest.skip(f"GPU {g.index}: clock event reasons not reported by this driver")
        assert not g.throttled, (
            f"GPU {g.index} clock event reasons: expected no power/thermal limit, found "
            f"{', '.join(g.event_reason_names)} ({g.event_reasons:#x})"
        )


def test_no_other_compute_process(host: Any, report: G.GpuReport, expect: dict[str, Any]) -> None:
    """No compute process on the GPU but the lane's own: before start none at all; once the lane
    serves, only processes of this rank's container running the installed release."""
    apps = report.compute_apps
    if apps and expect["expect"]["docker"]:
        ours, _ = lane_owns_running_release(host, expect)
        if ours:
            c, _ = lane_container(host, expect)
            r = run(host, *container_pids(str((c or {}).get("Id"))))
            pids = {int(w) for w in r.stdout.split() if w.isdigit()} if r.rc == 0 else set()
            apps = [a for a in apps if a.pid not in pids]
    shown_apps = [f"pid {a.pid} {a.process_name}" for a in apps]
    assert not shown_apps, (
        f"compute processes: expected none but the lane's own, found {len(shown_apps)}: {', '.join(shown_apps[:3])}"
    )
