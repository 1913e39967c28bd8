"""Fabric (RoCE): /dev/infiniband, the RDMA device names, a RoCE v2 GID whose address is each rail's
IPv4 (from sysfs), ports ACTIVE, interface MTU, exactly one IPv4 per rail interface.

All facts come from one remote python3 read of sysfs plus `ip -j -4 addr`. A host whose
inventory says `expect.rdma = false` skips; one that expects RDMA (the default: a Spark has its
ConnectX-7) and has no RDMA device in /sys/class/infiniband fails.
"""

from __future__ import annotations

from typing import Any

import pytest
from checklib import Cmd, Concern, or_skip, python, remote_json

from builder.hostscripts import FABRIC, iface_of, rail_gid


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """The RDMA devices and links (hostscripts.fabric), where RDMA is expected."""
    return [python(FABRIC, "/sys")] if expect["expect"].get("rdma") else []


CONCERN = Concern(name="fabric", order=70, phase="preflight", containers=False, prefetch=planned)


@pytest.fixture(scope="module")
def fab(expect: dict[str, Any]) -> dict[str, Any]:
    if not expect["expect"]["rdma"]:
        pytest.skip("RDMA not expected on this host (expect.rdma = false)")
    return expect["fabric"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def facts(host: Any, fab: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = remote_json(host, FABRIC, "/sys")
    if not found["rdma"]:
        dev = "/dev/infiniband present" if found["dev_infiniband"] else "no /dev/infiniband"
        pytest.fail(
            f"expected RDMA devices (expect.rdma = true; devices {', '.join(fab['rdma_devices']) or '-'}, "
            f"rails {', '.join(fab['rails']) or '-'}), found none in /sys/class/infiniband ({dev})"
        )
    return found


def test_dev_infiniband(facts: dict[str, Any]) -> None:
    assert facts["dev_infiniband"], (
        "/dev/infiniband: expected present, found absent (RDMA devices in "
        f"sysfs: {', '.join(sorted(facts['rdma'])) or 'none'})"
    )


def test_rdma_devices(facts: dict[str, Any], fab: dict[str, Any]) -> None:
    want = or_skip(fab["rdma_devices"], "the inventory names no RDMA device (fabric.rdma_devices)")
    found = sorted(facts["rdma"])
    missing = [d for d in want if d not in found]
    assert not missing, f"RDMA devices: expected {', '.join(want)}, found {', '.join(found) or 'none'}"


def test_ports_active(facts: dict[str, Any], fab: dict[str, Any]) -> None:
    devs = fab["rdma_devices"] or sorted(facts["rdma"])
    bad = []
    for d in devs:
        if not facts["rdma"].get(d):
            bad.append(f"{d}: no port")
        for port, info in sorted(facts["rdma"].get(d, {}).items()):
            if "ACTIVE" not in (info.get("state") or ""):
                bad.append(f"{d}/{port}: {info.get('state')}")
    assert not bad, f"RDMA ports: expected ACTIVE, found {', '.join(bad)}"


def test_roce_v2_gid(facts: dict[str, Any], fab: dict[str, Any]) -> None:
    rails = or_skip(fab["rails"], "the inventory names no rail IPv4 (fabric.rails)")
    idx = fab["gid_index"]
    for ip in rails:
        hit = rail_gid(facts, ip, idx, fab["rdma_devices"] or None)
        where = "any index" if idx == "auto" else f"index {idx}"
        assert hit is not None, f"rail {ip}: expected a RoCE v2 GID ::ffff:{ip} at {where}, found none"


def test_mtu(facts: dict[str, Any], fab: dict[str, Any]) -> None:
    rails = fab["rails"]
    ifaces = list(fab["interfaces"]) or [i for i in (iface_of(facts, ip) for ip in rails) if i]
    or_skip(ifaces, "the inventory names no fabric interface or rail")
    for i in ifaces:
        got = facts["net"].get(i, {}).get("mtu")
        assert got == fab["mtu"], f"{i} MTU: expected {fab['mtu']}, found {got}"


def test_one_ipv4_per_rail(facts: dict[str, Any], fab: dict[str, Any]) -> None:
    rails = or_skip(fab["rails"], "the inventory names no rail IPv4 (fabric.rails)")
    for n, ip in enumerate(rails):
        iface = fab["interfaces"][n] if n < len(fab["interfaces"]) else iface_of(facts, ip)
        assert iface is not None, f"rail {ip}: expected on an interface, found on none"
        addrs = facts["net"].get(iface, {}).get("ipv4") or []
        assert addrs == [ip], f"{iface}: expected exactly one IPv4 {ip}, found {', '.join(addrs) or 'none'}"
