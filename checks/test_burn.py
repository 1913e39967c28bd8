"""Burn: a short, bounded load on the GPU (the host profile's `[hosts.expect.burn]` command: a fp16
4096² matmul in the lane's image on a Spark), sampled about every 0.5 s, judged against the GPU model's
health band (builder.gpu.burn): TFLOPS, sustained clock and power, and a verdict. The GB10 clock latch
shows only here and in gpu::clock_latch (recipes.md §14 #5); its fix is a power cycle.

It runs only on a free GPU: with the lane's own release on it (the lane serving) it skips, as deploy
runs it in the window between the old release's stop and the new one's start; with another process on
it, it fails (gpu::no_other_compute_process names the process too). A preflight concern: every
preflight audit, deploy's gate among them, runs it where the host's profile sets a burn (the opt-out:
no `[hosts.expect.burn]`, or `enabled = false`); `builder audit --only burn` runs it alone."""

from __future__ import annotations

import re
from typing import Any

import pytest
from checklib import Cmd, Concern, burn_facts, exists, gpu_commands, gpu_report, own_gpu_pids

from builder.hostscripts import MATMUL, dumps


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """nvidia-smi's queries, where a burn is set (the load itself runs after them, not prefetched)."""
    return gpu_commands() if (expect["expect"].get("burn") or {}).get("enabled") else []


CONCERN = Concern(name="burn", order=52, phase="preflight", containers=True, prefetch=planned)


def command(burn: dict[str, Any], expect: dict[str, Any]) -> list[str]:
    """The profile's burn command with its placeholders filled ({matmul}, {request}, {image})."""
    image = (expect.get("image") or {}).get("image_id") or ""
    if any("{image}" in a for a in burn["command"]) and not image:
        pytest.fail(f"burn: the command names {{image}} but the lane's image is unknown: {expect.get('image_reason')}")
    fill = {"{matmul}": MATMUL, "{request}": dumps({"seconds": burn["seconds"]}), "{image}": image}
    # one pass: a filled value (the matmul's source) is never searched for placeholders again
    return [PLACEHOLDER.sub(lambda m: fill[m.group(0)], a) for a in burn["command"]]


PLACEHOLDER = re.compile(r"\{(?:matmul|request|image)\}")


def test_gpu(host: Any, expect: dict[str, Any], finding: Any) -> None:
    burn = expect["expect"].get("burn")
    if not burn:
        pytest.skip("no burn in the host's profile ([hosts.expect.burn])")
    if not burn.get("enabled", True):
        pytest.skip("burn disabled in the host's profile (burn.enabled = false)")
    if not exists(host, "nvidia-smi"):
        pytest.fail("burn: expected nvidia-smi on PATH to sample the GPU, found none")
    from builder import gpu as G
    from builder.gpu.burn import band_for, judge, sample_command

    try:
        report = gpu_report(host)
    except G.GpuError as e:
        pytest.fail(f"burn: expected a readable GPU report, found: {e}")
    if not report.gpus:
        pytest.fail("burn: expected a GPU, found none")
    pids = [a.pid for a in report.compute_apps]
    own, _ = own_gpu_pids(host, expect, pids)
    others = [a for a in report.compute_apps if a.pid not in own]
    assert not others, (
        f"burn: expected a free GPU, found {len(others)} other process(es): "
        + ", ".join(f"pid {a.pid} {a.process_name}" for a in others[:3])
    )
    if own:
        finding("deferred", True)  # (deploy's burn window reads it: this host burns once its GPU is free)
        pytest.skip("the lane's own release is on the GPU: the burn runs on a free GPU (deploy: between the "
                    "old release's stop and the new one's start)")
    name = report.gpus[0].name
    band = band_for(name, burn.get("min_tflops"))
    if band is None:
        pytest.fail(f"burn: no health band for {name!r} (builder.gpu.burn.BANDS); set [hosts.expect.burn] min_tflops")
    request = {"command": command(burn, expect), "timeout": burn["timeout_s"], "interval": 0.5,
               "query": sample_command(), "fallback": sample_command(fallback=True), "cleanup": burn.get("cleanup")}
    try:
        facts = burn_facts(host, request)
    except (RuntimeError, ValueError) as e:
        pytest.fail(f"burn: the sampler did not report: {e}")
    # the load runs on GPU 0 (the default matmul's device; a Spark has one GPU)
    res = judge(facts, band, 0)
    finding("burn", res.to_json())
    if res.verdict in ("latched", "throttled", "slow"):
        finding("kind", "hardware")
    assert res.verdict == "pass", res.message
