"""Memory: MemAvailable at or above the host's minimum (what the lane's own running release holds counts
as available: stopping the rank frees it); swap in use at or below its maximum. Short of the minimum,
where the host's profile sets `memory_wait_s`, the gate does as the launchers do (recipes.md §14 #1):
it drops the page cache, then waits up to that long for the floor, before it refuses."""

from __future__ import annotations

import time
from typing import Any

import pytest
from checklib import (
    MEMINFO,
    Cmd,
    Concern,
    argv_command,
    cat,
    exists,
    gpu_commands,
    json_output,
    lane_container,
    lane_docker,
    lane_owns_running_release,
    run,
)
from checklib import memory_facts as holders

from builder.hostscripts import gib, memory_holders, memory_shortfall, parse_meminfo


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """This rank's containers, /proc/meminfo and, with a minimum, who holds the memory."""
    cmds, want = [*lane_docker(expect), MEMINFO], expect["expect"]
    if want.get("min_free_memory_gib"):
        # who holds the memory, the lane's own container and (a GPU whose memory is the host's)
        # the GPU's processes: what the check credits and names when MemAvailable falls short
        cmds.append(holders())
        if want.get("docker"):
            cmds.append(cat(expect["applied_path"]))
        if want.get("gpu_count"):
            cmds += gpu_commands()
    return cmds


CONCERN = Concern(name="memory", order=60, phase="preflight", containers=True, prefetch=planned)


@pytest.fixture(scope="module")
def meminfo(host: Any) -> dict[str, int]:
    r = run(host, *MEMINFO)
    assert r.rc == 0, f"/proc/meminfo: expected readable, found exit {r.rc}"
    info = parse_meminfo(r.stdout)
    assert "MemAvailable" in info, "/proc/meminfo: expected a MemAvailable line, found none"
    return info


def test_available(host: Any, meminfo: dict[str, int], expect: dict[str, Any]) -> None:
    """MemAvailable >= min_free_memory_gib. Before start the lane holds nothing; once it serves, the
    memory this rank's container holds (its cgroup's anonymous, shm and kernel memory and, on a GPU
    whose memory is the host's, its processes' GPU memory) counts as available, as it is freed when
    deploy stops the rank. Any other container or process holding it fails, named in the message."""
    want = expect["expect"]["min_free_memory_gib"]
    if not want:
        pytest.skip("no min_free_memory_gib in the host's expectations")
    available = meminfo["MemAvailable"]
    if gib(available) >= want:
        return
    wait_s, waited = float(expect["expect"].get("memory_wait_s") or 0), ""
    if wait_s:  # (the launchers' way, where the profile asks for it: a page-cache drop is felt host-wide)
        available, waited = _drop_and_wait(host, want, wait_s)
        if gib(available) >= want:
            return
    r = run(host, *holders())
    try:
        facts = json_output(r)
    except (RuntimeError, ValueError) as e:
        pytest.fail(f"MemAvailable: expected >= {want:g} GiB, found {gib(available):.1f} GiB "
                    f"(who holds the memory is unknown: {e})")
    own, note = _own_containers(host, expect, facts)
    mine, containers, processes = memory_holders(facts, own)
    message = memory_shortfall(available, want, mine, containers, processes, note)
    if message:  # short even so: add what the GPU's processes hold where its memory is the host's
        apps = _host_memory_gpu_apps(host, expect)
        if apps:
            used = ("the GPU reports no memory of its own (memory.total [N/A], unified memory): its processes' "
                    "memory is read from --query-compute-apps as the host's")
            mine, containers, processes = memory_holders(facts, own, apps)
            said = "; ".join(filter(None, [note, used]))
            message = memory_shortfall(available, want, mine, containers, processes, said)
    assert not message, message + waited


DROP_CACHES = ("sync; echo 3 > /proc/sys/vm/drop_caches",)


def _drop_and_wait(host: Any, want: float, wait_s: float) -> tuple[int, str]:
    """Drop the page cache (root only: a host that refuses says why), then read MemAvailable every 2 s
    until it reaches `want` GiB or `wait_s` passes. The last MemAvailable (kB) and what was done, as a
    clause for the message."""
    r = run(host, *DROP_CACHES)
    why = (r.stderr or r.stdout or f"exit {r.rc}").strip().splitlines()
    done = " (after a page-cache drop" if r.rc == 0 else f" (the page cache could not be dropped: {why[-1][:80]}"
    deadline = time.monotonic() + wait_s
    while True:
        now = host.run(*MEMINFO)  # (not the prefetched answer: it changes)
        available = parse_meminfo(now.stdout).get("MemAvailable", 0) if now.rc == 0 else 0
        if gib(available) >= want or time.monotonic() >= deadline:
            break
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
    return available, done + f" and {wait_s:g} s of waiting)"


def _own_containers(host: Any, expect: dict[str, Any], facts: dict[str, Any]) -> tuple[set[str], str]:
    """The IDs of the lane's own running containers (this rank's container, running the installed
    release), and a word when its memory could not be read."""
    if not expect["expect"]["docker"]:
        return set(), ""
    ours, _ = lane_owns_running_release(host, expect)
    if not ours:
        return set(), ""
    c, _ = lane_container(host, expect)
    cid = str((c or {}).get("Id"))
    seen = (facts.get("containers") or {}).get(cid)
    name = str((c or {}).get("Name", cid[:12])).lstrip("/")
    if seen is None:
        return set(), f"the memory of the lane's own container {name} is unknown: {facts.get('docker') or 'not seen'}"
    if seen.get("held") is None:
        return {cid}, f"the memory of the lane's own container {name} is unknown: {seen.get('why')}"
    return {cid}, ""


def _host_memory_gpu_apps(host: Any, expect: dict[str, Any]) -> list[tuple[int, str, int]]:
    """(pid, name, bytes) of each compute process on the GPU when its memory is the host's own (every
    GPU reports no memory of its own, memory.total [N/A], as a DGX Spark's GB10 does); else none."""
    if not expect["expect"].get("gpu_count") or not exists(host, "nvidia-smi"):
        return []
    from builder import gpu as G

    def runner(argv: list[str]) -> tuple[int, str, str]:
        r = run(host, *argv_command(argv))
        return r.rc, r.stdout, r.stderr

    try:
        report = G.probe(runner)
    except G.GpuError:
        return []  # (the GPU checks say why)
    if not report.gpus or any(g.memory_total_mib is not None for g in report.gpus):
        return []
    return [(a.pid, a.process_name, (a.used_memory_mib or 0) << 20) for a in report.compute_apps]


def test_swap_used(meminfo: dict[str, int], expect: dict[str, Any]) -> None:
    want = expect["expect"].get("max_swap_used_gib")
    if want is None:
        pytest.skip("no max_swap_used_gib in the host's expectations")
    used = gib(meminfo.get("SwapTotal", 0) - meminfo.get("SwapFree", 0))
    assert used <= want, f"swap in use: expected <= {want:g} GiB, found {used:.2f} GiB"
