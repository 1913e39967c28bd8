"""Launch files per rank: env, config, start/stop scripts (pure rendering)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.hosts import Fleet
from builder.launch import ModelMount, host_address, rank_env, render_args, render_launch
from builder.loader import validate
from builder.pins import Lane

IMAGE = {"name": "tiny", "input_address": "1" * 64, "image_id": "sha256:" + "2" * 64, "diff_ids": []}


def fleet(n: int = 2, **head_fabric: object) -> Fleet:
    hosts = []
    for r in range(n):
        h: dict[str, object] = {
            "name": f"s{r}",
            "ssh": f"spark@192.0.2.{10 + r}",
            "rank": r,
            "role": "head" if r == 0 else "worker",
            "address": f"192.0.2.{10 + r}",
            "fabric": {
                "rdma_devices": ["rocep1s0f0", "roceP2p1s0f0"],
                "interfaces": ["enp1s0f0np0"],
                "gid_index": 3 if r else "auto",
            },
        }
        if r == 0 and head_fabric:
            h["fabric"] = head_fabric
        hosts.append(h)
    return validate(Fleet, {"fleet": {"name": "f", "lane": "l"}, "hosts": hosts}, "test")


def lane(**serve: object) -> Lane:
    s = {
        "tensor_parallel": 2,
        "context": 8192,
        "streams": 4,
        "port": 8000,
        "served_name": "m",
        "rendezvous_port": 29760,
        "args": ["serve", "--port", "{port}", "--rank", "{rank}"],
        **serve,
    }
    return validate(Lane, {"image": "tiny", "serve": s}, "test")


def test_rank_env_worker_and_head() -> None:
    f = fleet()
    w = rank_env(f, f.host("s1"), "l", lane(env={"X_FLAG": "1"}))
    assert w["WORLD_SIZE"] == "2" and w["RANK"] == "1"
    assert w["MASTER_ADDR"] == w["TF_TP_MASTER"] == "192.0.2.10"
    assert w["MASTER_PORT"] == w["TF_TP_PORT"] == "29760" and w["TF_TP_WORLD"] == "2"
    assert w["NCCL_IB_HCA"] == w["TF_RDMA_DEVICES"] == "rocep1s0f0,roceP2p1s0f0"
    assert w["NCCL_SOCKET_IFNAME"] == "enp1s0f0np0"
    assert w["NCCL_IB_GID_INDEX"] == "3"
    assert w["X_FLAG"] == "1"
    h = rank_env(f, f.host("s0"), "l", lane())
    assert h["RANK"] == "0" and "NCCL_IB_GID_INDEX" not in h  # auto: left to discovery


def test_lane_env_may_not_override_rank_settings() -> None:
    f = fleet()
    with pytest.raises(ConfigError, match="serve.env.RANK"):
        rank_env(f, f.host("s1"), "l", lane(env={"RANK": "5"}))


def test_args_placeholders() -> None:
    f = fleet()
    assert render_args(f, f.host("s1"), "l", lane()) == ["serve", "--port", "8000", "--rank", "1"]
    with pytest.raises(ConfigError, match="serve.args"):
        render_args(f, f.host("s1"), "l", lane(args=["{nope}"]))


def test_head_address_falls_back_to_rail_then_ssh_ip() -> None:
    f = validate(
        Fleet,
        {
            "fleet": {"name": "f", "lane": "l"},
            "hosts": [
                {"name": "a", "ssh": "spark@192.0.2.5:2222", "rank": 0, "role": "head"},
                {
                    "name": "b",
                    "ssh": "b-alias",
                    "rank": 1,
                    "role": "worker",
                    "fabric": {"rails": ["198.51.100.9"]},
                },
            ],
        },
        "t",
    )
    assert host_address(f, f.host("a")) == "192.0.2.5"
    assert host_address(f, f.host("b")) == "198.51.100.9"
    g = validate(
        Fleet,
        {
            "fleet": {"name": "f", "lane": "l"},
            "hosts": [{"name": "a", "ssh": "a-alias", "rank": 0, "role": "head"}],
        },
        "t",
    )
    with pytest.raises(ConfigError, match="no address"):
        host_address(g, g.host("a"))


def test_scripts_render_deterministically_and_parse(tmp_path: Path) -> None:
    f = fleet(3)
    mounts = [ModelMount("m", "/srv/models/m")]
    a = render_launch(f, f.host("s0"), "l", lane(tensor_parallel=3), IMAGE, [], mounts)
    b = render_launch(f, f.host("s0"), "l", lane(tensor_parallel=3), IMAGE, [], mounts)
    assert a == b
    assert a["start.sh"][1] == "0755" and a["rank.env"][1] == "0644"
    start = a["start.sh"][0].decode()
    assert "--network host" in start and IMAGE["image_id"] in start
    assert "io.builder.lane" in start and "io.builder.rank" in start and "io.builder.bundle-id" in start
    assert "--env-file" in start and "/srv/models/m:/srv/models/m:ro" in start
    assert "s1=192.0.2.11 s2=192.0.2.12" in start  # the head waits for every worker
    cfg = json.loads(a["config.json"][0])
    assert cfg["rank"] == 0 and cfg["world_size"] == 3 and cfg["serve"]["port"] == 8000
    for name in ("start.sh", "stop.sh"):
        p = tmp_path / name
        p.write_bytes(a[name][0])
        assert subprocess.run(["bash", "-n", str(p)]).returncode == 0
        if shutil.which("shellcheck"):
            assert subprocess.run(["shellcheck", "-S", "error", str(p)]).returncode == 0
    w = render_launch(f, f.host("s2"), "l", lane(tensor_parallel=3), IMAGE, [], [])["start.sh"][0].decode()
    assert "ROLE=worker" in w and "an old head is still" in w


def test_gpu_flags_follow_expectations() -> None:
    f = validate(
        Fleet,
        {
            "fleet": {"name": "f", "lane": "l"},
            "hosts": [
                {"name": "a", "ssh": "spark@192.0.2.5", "rank": 0, "role": "head", "expect": {"gpu_count": 1}}
            ],
        },
        "t",
    )
    s = render_launch(f, f.host("a"), "l", lane(tensor_parallel=1), IMAGE, [], [])["start.sh"][0].decode()
    assert "--gpus all" in s
