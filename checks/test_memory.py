"""Memory: MemAvailable at or above the host's minimum; swap in use at or below its maximum."""

from __future__ import annotations

from typing import Any

import pytest
from checklib import MEMINFO, run

from builder.hostfacts import gib, parse_meminfo


@pytest.fixture(scope="module")
def meminfo(host: Any) -> dict[str, int]:
    r = run(host, *MEMINFO)
    assert r.rc == 0, f"/proc/meminfo: expected readable, found exit {r.rc}"
    info = parse_meminfo(r.stdout)
    assert "MemAvailable" in info, "/proc/meminfo: expected a MemAvailable line, found none"
    return info


def test_available(meminfo: dict[str, int], expect: dict[str, Any]) -> None:
    want = expect["expect"]["min_free_memory_gib"]
    if not want:
        pytest.skip("no min_free_memory_gib in the host's expectations")
    found = gib(meminfo["MemAvailable"])
    assert found >= want, f"MemAvailable: expected >= {want:g} GiB, found {found:.1f} GiB"


def test_swap_used(meminfo: dict[str, int], expect: dict[str, Any]) -> None:
    want = expect["expect"].get("max_swap_used_gib")
    if want is None:
        pytest.skip("no max_swap_used_gib in the host's expectations")
    used = gib(meminfo.get("SwapTotal", 0) - meminfo.get("SwapFree", 0))
    assert used <= want, f"swap in use: expected <= {want:g} GiB, found {used:.2f} GiB"
