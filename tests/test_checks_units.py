"""The pure helpers behind the host checks (builder.hostcheck), run for real on local files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder import hostcheck as hc


def run_script(script: str, arg: str) -> object:
    r = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


@pytest.mark.parametrize(
    "name,want",
    [
        ("engram-r1of2.bin", (1, 2)),
        ("rank3of4-cache.bin", (3, 4)),
        ("x/r0of8_table.npy", (0, 8)),
        ("tbl.r12of16", (12, 16)),
        ("model-00001-of-00002.safetensors", None),
        ("error0of2", None),
        ("engram.bin", None),
        ("r1of2x3", (1, 2)),
    ],
)
def test_rank_tag(name: str, want: tuple[int, int] | None) -> None:
    assert hc.rank_tag(name) == want


def test_roce_v2_gid() -> None:
    assert hc.roce_v2_gid("192.0.2.1") == "0000:0000:0000:0000:0000:ffff:c000:0201"
    assert hc.roce_v2_gid("10.0.0.255") == "0000:0000:0000:0000:0000:ffff:0a00:00ff"


def test_meminfo_and_mtime() -> None:
    m = hc.parse_meminfo("MemTotal:       131072000 kB\nMemAvailable:   120000000 kB\nHugePages_Total: 0\n")
    assert m == {"MemTotal": 131072000, "MemAvailable": 120000000, "HugePages_Total": 0}
    assert round(hc.gib(m["MemAvailable"]), 2) == 114.44
    assert hc.same_mtime(1700000000.123456, 1700000000123456000)
    assert hc.same_mtime(1700000000123456789, 1700000000123456789)
    assert not hc.same_mtime(1700000000.5, 1700000001500000000)
    assert not hc.same_mtime("x", 1)


def test_batches_keep_every_path_once() -> None:
    paths = [f"/srv/models/m/{i:05d}-" + "x" * 50 for i in range(3000)]
    chunks = list(hc.batches(paths, max_chars=10_000))
    assert len(chunks) > 1 and [p for c in chunks for p in c] == paths
    assert all(sum(len(p) + 4 for p in c) <= 10_000 for c in chunks)


def test_files_script_hashes_and_stats(tmp_path: Path) -> None:
    a = tmp_path / "a.bin"
    a.write_bytes(os.urandom(3 << 20))
    (tmp_path / "d").mkdir()
    out = run_script(
        hc.FILES_SCRIPT,
        json.dumps({"paths": [str(a), str(tmp_path / "nope"), str(tmp_path / "d")], "hash": True, "jobs": 3}),
    )
    assert isinstance(out, dict)
    st = a.stat()
    assert out[str(a)] == {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "inode": st.st_ino,
        "sha256": hashlib.sha256(a.read_bytes()).hexdigest(),
    }
    assert (
        "error" in out[str(tmp_path / "nope")] and out[str(tmp_path / "d")]["error"] == "not a regular file"
    )
    fast = run_script(hc.FILES_SCRIPT, json.dumps({"paths": [str(a)], "hash": False}))
    assert isinstance(fast, dict) and "sha256" not in fast[str(a)]


def test_list_script(tmp_path: Path) -> None:
    (tmp_path / "m" / "sub").mkdir(parents=True)
    (tmp_path / "m" / "b").write_text("1")
    (tmp_path / "m" / "sub" / "a").write_text("2")
    (tmp_path / "m" / "link").symlink_to(tmp_path / "m" / "b")
    out = run_script(hc.LIST_SCRIPT, json.dumps([str(tmp_path / "m"), str(tmp_path / "none")]))
    assert out == {str(tmp_path / "m"): ["b", "sub/a"], str(tmp_path / "none"): None}


def fake_sysfs(root: Path) -> None:
    """A sysfs tree shaped like a GB10's: two RoCE twins, GIDs with v1/v2 pairs, one port down."""

    def w(p: str, text: str) -> None:
        f = root / p
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")

    for dev, ip, state in (
        ("rocep1s0f0", "192.0.2.10", "4: ACTIVE"),
        ("roceP2p1s0f0", "198.51.100.10", "1: DOWN"),
    ):
        base = f"class/infiniband/{dev}/ports/1"
        w(f"{base}/state", state)
        w(f"{base}/gids/0", "fe80:0000:0000:0000:0000:0000:0000:0001")
        w(f"{base}/gid_attrs/types/0", "IB/RoCE v1")
        w(f"{base}/gids/2", hc.roce_v2_gid(ip))
        w(f"{base}/gid_attrs/types/2", "IB/RoCE v1")
        w(f"{base}/gids/3", hc.roce_v2_gid(ip))
        w(f"{base}/gid_attrs/types/3", "RoCE v2")
        w(f"{base}/gid_attrs/ndevs/3", "enp1s0f0np0")
        w(f"{base}/gids/4", "0000:0000:0000:0000:0000:0000:0000:0000")
    w("class/net/enp1s0f0np0/mtu", "9000")
    w("class/net/lo/mtu", "65536")


def test_fabric_script_and_gid_evaluation(tmp_path: Path) -> None:
    fake_sysfs(tmp_path)
    facts = run_script(hc.FABRIC_SCRIPT, str(tmp_path))
    assert isinstance(facts, dict)
    assert sorted(facts["rdma"]) == ["roceP2p1s0f0", "rocep1s0f0"]
    port = facts["rdma"]["rocep1s0f0"]["1"]
    assert port["state"] == "4: ACTIVE" and "4" not in port["gids"]  # all-zero GIDs are dropped
    assert facts["net"]["enp1s0f0np0"]["mtu"] == 9000
    assert hc.rail_gid(facts, "192.0.2.10") == ("rocep1s0f0", "1", "3")
    assert hc.rail_gid(facts, "192.0.2.10", 3) == ("rocep1s0f0", "1", "3")
    assert hc.rail_gid(facts, "192.0.2.10", 2) is None  # index 2 is the v1 entry
    assert hc.rail_gid(facts, "192.0.2.10", "auto", ["roceP2p1s0f0"]) is None
    assert hc.rail_gid(facts, "203.0.113.9") is None
    facts["net"]["enp1s0f0np0"]["ipv4"] = ["192.0.2.10"]
    assert hc.iface_of(facts, "192.0.2.10") == "enp1s0f0np0"
    assert hc.iface_of(facts, "192.0.2.11") is None
