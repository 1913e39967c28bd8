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
    assert "--env-file" in start and "MODEL_DIRS=(/srv/models/m)" in start and '"$dir:$dir:ro"' in start
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


def test_start_and_stop_run_docker_as_rendered(tmp_path: Path) -> None:
    """The scripts run (a `docker` on PATH that records its calls): start.sh of a head with no workers
    runs the container with the rank's labels, mounts, options and args; stop.sh stops this rank's."""
    f = fleet(1)
    models = tmp_path / "models m"
    models.mkdir()
    files = render_launch(f, f.host("s0"), "l", lane(tensor_parallel=1), IMAGE, [],
                          [ModelMount("m", str(models))])
    rel = tmp_path / "release"
    rel.mkdir()
    for name, (data, _) in files.items():
        (rel / name).write_bytes(data)
    (rel / "manifest.json").write_text(json.dumps({"bundle_id": "b" * 64}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "docker.log"
    docker = bin_dir / "docker"
    # ps: nothing runs; image inspect: loaded; container inspect: no old container; the rest: recorded
    docker.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$*" >> "{log}"\n'
        'case "$1 $2" in "ps "*) exit 0;; "image inspect") exit 0;; "container inspect") exit 1;; esac\n'
    )
    docker.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "BUILDER_START_TIMEOUT": "5"}
    p = subprocess.run(["bash", str(rel / "start.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    run = [ln for ln in log.read_text().splitlines() if ln.startswith("run ")]
    assert len(run) == 1
    assert run[0].startswith("run -d --init --name builder-l-r0 --network host --restart no --label io.builder.lane=l "
                             "--label io.builder.rank=0 --label io.builder.bundle-id=" + "b" * 64)
    assert f"-v {models}:{models}:ro" in run[0] and f"-v {rel}/config.json:/etc/builder/config.json:ro" in run[0]
    assert run[0].endswith(f"{IMAGE['image_id']} serve --port 8000 --rank 0")
    assert "started builder-l-r0" in p.stderr
    models.rmdir()
    p = subprocess.run(["bash", str(rel / "start.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 1 and f"model folder {models} is missing" in p.stderr
    p = subprocess.run(["bash", str(rel / "stop.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and "nothing of lane l rank 0 is running" in p.stderr
