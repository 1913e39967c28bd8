"""Launch files per rank: env, config, start/stop scripts (pure rendering), and the start order."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from builder.errors import ConfigError
from builder.inputs.hosts import Fleet
from builder.inputs.loader import validate
from builder.inputs.pins import Pins
from builder.launch import host_address, lane_filters, rank_command, render_launch, stop_lane_command
from builder.launch.order import start_groups, stop_groups
from tests.lib import factory

IMAGE = {"name": "tiny", "input_address": "1" * 64, "image_id": "sha256:" + "2" * 64, "diff_ids": []}


def fleet(n: int = 2, gpu: bool = False, **head_fabric: object) -> Fleet:
    fabric = {"rdma_devices": ["rocep1s0f0", "roceP2p1s0f0"], "interfaces": ["enp1s0f0np0"]}
    hosts = [factory.host(f"s{r}", r, ssh=f"spark@192.0.2.{10 + r}", address=f"192.0.2.{10 + r}",
                          fabric=head_fabric if r == 0 and head_fabric else {**fabric, "gid_index": 3 if r else "auto"},
                          expect={"gpu_count": 1 if gpu else 0})
             for r in range(n)]
    return validate(Fleet, factory.fleet("f", "l", hosts), "test")


def pins(tp: int = 2, **lane: Any) -> Pins:
    """Pins with one model `m` and lane `l` (its keys overridden by `lane`)."""
    spec = factory.lane(
        "tiny", ["m"],
        serve={"tensor_parallel": tp, "context": 8192, "streams": 4, "port": 8000, "served_name": "m",
               "rendezvous_port": 29760},
        env={"NCCL_IB_HCA": "{rdma_devices}", "NCCL_IB_GID_INDEX": "{gid_index}", "X_FLAG": "1"},
        mounts=[{"source": "model:m", "target": "/model"}, {"source": "state:logs", "target": "/logs",
                                                            "writable": True}],
        roles={
            "head": {"args": ["serve", "--port", "{port}", "--rank", "{rank}"], "ready": {"health": "/health"},
                     "env": {"TF_TP_MASTER": "{master_addr}"}},
            "worker": {"entrypoint": ["/engine/follow", "--x"], "args": ["{rank}", "{world_size}", "{master_addr}"],
                       "ready": {"port": "{rendezvous_port}"}},
        },
    ) | lane
    return validate(Pins, factory.pins(images={"tiny": factory.image("images/tiny")},
                                       models={"m": factory.model("o/m")}, lanes={"l": spec}), "test")


def test_each_role_runs_its_own_command() -> None:
    f, p = fleet(), pins()
    h = rank_command(p, f, f.host("s0"), "l", "IMG")
    w = rank_command(p, f, f.host("s1"), "l", "IMG")
    assert h.entrypoint is None and h.args == ["serve", "--port", "8000", "--rank", "0"]
    assert h.argv[-6:] == ["IMG", "serve", "--port", "8000", "--rank", "0"]
    assert w.entrypoint == ["/engine/follow"] and w.args == ["--x", "1", "2", "192.0.2.10"]
    i = w.argv.index("--entrypoint")
    assert w.argv[i:] == ["--entrypoint", "/engine/follow", "IMG", "--x", "1", "2", "192.0.2.10"]
    assert h.ready == {"kind": "health", "port": 8000, "path": "/health"}
    assert w.ready == {"kind": "port", "port": 29760, "peer": True}  # (started before its head: waits for it)
    hf = pins(start="head-first")
    assert rank_command(hf, f, f.host("s1"), "l", "IMG").ready == {"kind": "port", "port": 29760}


def test_env_layers_placeholders_and_empty_values() -> None:
    f, p = fleet(), pins()
    w = rank_command(p, f, f.host("s1"), "l", "IMG").env
    assert w["NCCL_IB_HCA"] == "rocep1s0f0,roceP2p1s0f0" and w["NCCL_IB_GID_INDEX"] == "3"
    assert w["X_FLAG"] == "1" and "TF_TP_MASTER" not in w  # the head's env is the head's
    assert w["BUILDER_RANK"] == "1" and w["BUILDER_ROLE"] == "worker"
    h = rank_command(p, f, f.host("s0"), "l", "IMG").env
    assert h["TF_TP_MASTER"] == "192.0.2.10"
    assert "NCCL_IB_GID_INDEX" not in h  # gid_index = "auto" renders empty: left to discovery


def test_rank_entry_wins_over_its_role() -> None:
    f = fleet(3)
    p = pins(tp=3, ranks={"2": {"args": ["special"], "env": {"ONLY_TWO": "1"}}})
    two = rank_command(p, f, f.host("s2"), "l", "IMG")
    one = rank_command(p, f, f.host("s1"), "l", "IMG")
    assert two.args == ["--x", "special"] and two.env["ONLY_TWO"] == "1" and two.ready["kind"] == "port"
    assert "ONLY_TWO" not in one.env


def test_lane_env_may_not_override_builders() -> None:
    f = fleet()
    with pytest.raises(ConfigError, match="env.BUILDER_RANK"):
        rank_command(pins(env={"BUILDER_RANK": "5"}), f, f.host("s1"), "l", "IMG")


def test_bad_placeholder_is_named() -> None:
    f = fleet()
    bad = pins(roles={"head": {"args": ["{nope}"], "ready": {"health": "/health"}}})
    with pytest.raises(ConfigError, match=r"lanes.l.args\[0\]: bad placeholder"):
        rank_command(bad, f, f.host("s0"), "l", "IMG")


def test_mounts_by_placement_and_options_by_host() -> None:
    p = pins(options={"gpus": "all", "ipc": "host", "ulimits": {"memlock": "-1"}, "cap_add": ["IPC_LOCK"],
                      "devices": [{"path": "/dev/infiniband", "when": "rdma"}]})
    g = fleet(gpu=True)
    argv = rank_command(p, g, g.host("s0"), "l", "IMG").argv
    assert "-v" in argv and "/srv/models/m:/model:ro" in argv and "/var/lib/builder/lanes/l/logs:/logs" in argv
    for flag in (["--gpus", "all"], ["--ipc", "host"], ["--ulimit", "memlock=-1"], ["--cap-add", "IPC_LOCK"],
                 ["--device", "/dev/infiniband"]):
        i = argv.index(flag[0])
        assert argv[i:i + 2] == flag
    t = fleet(gpu=False)  # a host that expects no GPU (the test fleet): no GPU options, RDMA devices still
    argv = rank_command(p, t, t.host("s0"), "l", "IMG").argv
    assert "--gpus" not in argv and "--cap-add" not in argv and "/dev/infiniband" in argv


@pytest.mark.parametrize(("lane", "where"), [
    ({"options": {"privileged": True}}, "options.privileged: unknown key"),
    ({"options": {"ulimits": {"bogus": "1"}}}, "unknown ulimit 'bogus'"),
    ({"mounts": [{"source": "model:other", "target": "/x"}]}, "model 'other' is not in this lane's models"),
    ({"mounts": [{"source": "nfs:x", "target": "/x"}]}, "want model:NAME"),
    ({"mounts": [{"source": "model:m", "target": "relative"}]}, "want an absolute path in the container"),
    ({"roles": {"head": {"ready": {"health": "/h", "running": True}}}}, "exactly one of"),
    ({"start": "random"}, "start"),
])
def test_bad_lane_keys_are_named(lane: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(where)):
        pins(**lane)


def test_start_order_is_the_lanes() -> None:
    f = fleet(4)
    # one rank at a time, each once the one before it is ready
    assert [[h.name for h in g] for g in start_groups(f, pins(tp=4).lanes["l"])] == [["s3"], ["s2"], ["s1"], ["s0"]]
    first = pins(tp=4, start="head-first").lanes["l"]
    assert [[h.name for h in g] for g in start_groups(f, first)] == [["s0"], ["s3"], ["s2"], ["s1"]]
    in_rank_order = pins(tp=4, start="workers-in-rank-order").lanes["l"]  # vLLM's headless workers
    assert [[h.name for h in g] for g in start_groups(f, in_rank_order)] == [["s1"], ["s2"], ["s3"], ["s0"]]
    assert [[h.name for h in g] for g in stop_groups(f)] == [["s0"], ["s1", "s2", "s3"]]


def test_head_address_falls_back_to_rail_then_ssh_ip() -> None:
    f = validate(Fleet, factory.fleet("f", "l", [factory.host("a", 0, ssh="spark@192.0.2.5:2222"),
                                                 factory.host("b", 1, ssh="b-alias",
                                                              fabric={"rails": ["198.51.100.9"]})]), "t")
    assert host_address(f, f.host("a")) == "192.0.2.5"
    assert host_address(f, f.host("b")) == "198.51.100.9"
    g = validate(Fleet, factory.fleet("f", "l", [factory.host("a", 0, ssh="a-alias"),
                                                 factory.host("b", 1, ssh="b-alias", address="192.0.2.9")]), "t")
    with pytest.raises(ConfigError, match="fleet f: host a: no address for the other ranks"):
        host_address(g, g.host("a"))


def test_a_one_host_fleet_needs_no_address() -> None:
    """tensor_parallel = 1 on one host: no other rank needs its address, so none is asked for; the rank
    (--network host) reaches itself on the loopback. An address given is still used."""
    one = factory.fleet("f", "l", [factory.host("a", 0, ssh="a-alias", expect={"gpu_count": 0})])
    f = validate(Fleet, one, "t")
    assert host_address(f, f.host("a")) == "127.0.0.1"
    p = pins(tp=1)
    files = render_launch(p, f, f.host("a"), "l", IMAGE, [])
    cfg = json.loads(files["config.json"][0])
    assert cfg["master_addr"] == "127.0.0.1" and cfg["world_size"] == 1
    assert "MASTER_ADDR=127.0.0.1" in files["start.sh"][0].decode()
    cmd = rank_command(p, f, f.host("a"), "l", IMAGE["image_id"])
    assert cmd.env["TF_TP_MASTER"] == "127.0.0.1"
    one["hosts"][0]["address"] = "192.0.2.5"
    g = validate(Fleet, one, "t")
    assert host_address(g, g.host("a")) == "192.0.2.5"


def test_scripts_render_deterministically_and_parse(tmp_path: Path) -> None:
    f, p = fleet(3), pins(tp=3)
    a = render_launch(p, f, f.host("s0"), "l", IMAGE, [])
    assert a == render_launch(p, f, f.host("s0"), "l", IMAGE, [])
    assert a["start.sh"][1] == "0755" and a["rank.env"][1] == "0644" and a["lane.py"][1] == "0644"
    start = a["start.sh"][0].decode()
    assert "--network host" in start and IMAGE["image_id"] in start and "ORDER=workers-first" in start
    assert "io.builder.bundle-id={bundle_id}" in start and "--env-file /var/lib/builder/current/rank.env" in start
    assert "NEED=(/srv/models/m)" in start and "MAKE=(/var/lib/builder/lanes/l/logs)" in start
    cfg = json.loads(a["config.json"][0])
    assert cfg["rank"] == 0 and cfg["world_size"] == 3 and cfg["serve"]["port"] == 8000
    assert cfg["args"] == ["serve", "--port", "8000", "--rank", "0"] and cfg["ready"]["kind"] == "health"
    for name in ("start.sh", "stop.sh"):
        path = tmp_path / name
        path.write_bytes(a[name][0])
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
        if shutil.which("shellcheck"):
            assert subprocess.run(["shellcheck", "-S", "error", str(path)]).returncode == 0
    w = render_launch(p, f, f.host("s2"), "l", IMAGE, [])["start.sh"][0].decode()
    assert "ROLE=worker" in w and "an old head is still" in w


def _release(tmp_path: Path, files: dict[str, tuple[bytes, str]]) -> tuple[Path, Path, dict[str, str]]:
    """The launch files in a folder, and a `docker` on PATH that records its calls: ps finds nothing,
    the image is loaded, no old container, the started one runs."""
    rel = tmp_path / "release"
    rel.mkdir()
    for name, (data, _) in files.items():
        (rel / name).write_bytes(data)
    (rel / "manifest.json").write_text(json.dumps({"bundle_id": "b" * 64}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "docker.log"
    docker = bin_dir / "docker"
    docker.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$*" >> "{log}"\n'
        'case "$1 $2" in "ps "*) exit 0;; "image inspect") exit 0;; "container inspect") exit 1;;\n'
        '  "inspect --type") echo "running 0";; esac\n'
    )
    docker.chmod(0o755)
    return rel, log, {"PATH": f"{bin_dir}:/usr/bin:/bin", "BUILDER_START_TIMEOUT": "20"}


def local_fleet(tmp_path: Path) -> tuple[Fleet, Path, Path]:
    """A 2-host fleet whose model and bundle folders are under tmp_path (model m present)."""
    models, state = tmp_path / "models", tmp_path / "state"
    (models / "m").mkdir(parents=True)
    f = fleet(2)
    f = validate(Fleet, {**f.model_dump(mode="json"), "hosts": [
        {**h.model_dump(mode="json"), "paths": {"models": str(models), "bundles": str(state)}} for h in f.hosts]}, "t")
    return f, models, state


def test_start_and_stop_run_docker_as_rendered(tmp_path: Path) -> None:
    """start.sh runs exactly the rendered argv (the bundle id filled in), makes the lane's state folders,
    refuses a missing mounted input, and waits for the rank's readiness; stop.sh stops this rank's."""
    f, models, state = local_fleet(tmp_path)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    p = pins(serve={"tensor_parallel": 2, "context": 1, "streams": 1, "port": 8000, "served_name": "m",
                    "rendezvous_port": port})
    files = render_launch(p, f, f.host("s1"), "l", IMAGE, [])
    rel, log, env = _release(tmp_path, files)
    cmd = rank_command(p, f, f.host("s1"), "l", IMAGE["image_id"])
    try:
        pr = subprocess.run(["bash", str(rel / "start.sh")], capture_output=True, text=True, env=env, timeout=60)
    finally:
        listener.close()
    assert pr.returncode == 0, pr.stderr
    run = [ln for ln in log.read_text().splitlines() if ln.startswith("run ")]
    want = " ".join(cmd.argv[1:]).replace("{bundle_id}", "b" * 64)
    assert run == [want]
    assert (state / "lanes" / "l" / "logs").is_dir()
    assert "is ready" in pr.stderr
    (models / "m").rmdir()
    pr = subprocess.run(["bash", str(rel / "start.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert pr.returncode == 1 and f"{models}/m is missing" in pr.stderr
    pr = subprocess.run(["bash", str(rel / "stop.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert pr.returncode == 0 and "nothing of lane l rank 1 is running" in pr.stderr


def test_start_fails_when_the_rank_never_gets_ready(tmp_path: Path) -> None:
    f, _, _ = local_fleet(tmp_path)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nothing listens on (bound, never listening)
    port = closed.getsockname()[1]
    p = pins(serve={"tensor_parallel": 2, "context": 1, "streams": 1, "port": 8000, "served_name": "m",
                    "rendezvous_port": port})
    rel, _, env = _release(tmp_path, render_launch(p, f, f.host("s1"), "l", IMAGE, []))
    env["BUILDER_START_TIMEOUT"] = "2"
    try:
        pr = subprocess.run(["bash", str(rel / "start.sh")], capture_output=True, text=True, env=env, timeout=60)
    finally:
        closed.close()
    assert pr.returncode == 1 and f"port {port} did not answer within 2 s" in pr.stderr


def test_the_memory_floor_refuses_a_rank_that_cannot_fit(tmp_path: Path) -> None:
    """A lane's min_available_gib on a host that expects GPUs: start.sh syncs, drops the page cache and
    exits 4 before any docker run when MemAvailable is below it; a host without GPUs has no floor."""
    f, _, _ = local_fleet(tmp_path)
    gpu = validate(Fleet, {**f.model_dump(mode="json"), "hosts": [
        {**h.model_dump(mode="json"), "expect": {"gpu_count": 1}} for h in f.hosts]}, "t")
    avail_gib = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                     if ln.startswith("MemAvailable:")) // 1048576
    p = pins(min_available_gib=avail_gib + 1000)
    for fl, floor in ((gpu, str(avail_gib + 1000)), (f, "")):
        script = render_launch(p, fl, fl.host("s1"), "l", IMAGE, [])["start.sh"][0].decode()
        assert f"\nMIN_AVAIL_GIB={floor or chr(39) * 2}\n" in script
    rel, log, env = _release(tmp_path, render_launch(p, gpu, gpu.host("s1"), "l", IMAGE, []))
    pr = subprocess.run(["bash", str(rel / "start.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert pr.returncode == 4, pr.stderr
    assert f"below the lane's {avail_gib + 1000} GiB" in pr.stderr
    assert not any(ln.startswith("run ") for ln in log.read_text().splitlines())


def test_one_label_filter_selects_a_lanes_containers() -> None:
    """The filter start.sh's labels are selected by (a lane; a lane and rank), and the stop command for a
    host with no release uses it, shell-quoted."""
    assert lane_filters("demo") == ["--filter", "label=io.builder.lane=demo"]
    assert lane_filters("demo", 1) == [
        "--filter", "label=io.builder.lane=demo", "--filter", "label=io.builder.rank=1"]
    assert stop_lane_command("my lane", 0).startswith(
        "ids=$(docker ps -aq --filter 'label=io.builder.lane=my lane' --filter label=io.builder.rank=0) && ")


_TWO_HOSTS = """
[fleet]
name = "two"
lane = "demo"

[[hosts]]
name = "spark-test-1"
ssh = "spark-test-1"
address = "10.0.0.1"
rank = 0
role = "head"

[[hosts]]
name = "spark-test-2"
ssh = "spark-test-2"
address = "10.0.0.2"
rank = 1
role = "worker"
"""


def _launch_cli(hosts_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`builder launch ARGS` on the shipped project's demo lane, for the fleet of ``hosts_dir``, colour
    off, wide."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUILDER_")} | {"NO_COLOR": "1", "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-m", "builder", "--pins", str(root / "pins.toml"), "launch",
                           "--hosts-dir", str(hosts_dir), *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_launch_prints_the_shell_form_a_table_or_json_in_start_order(tmp_path: Path) -> None:
    (tmp_path / "two.toml").write_text(_TWO_HOSTS)
    js = _launch_cli(tmp_path, "--fleet", "two", "--json")
    assert js.returncode == 0, js.stderr
    out = json.loads(js.stdout)
    order = out["start_order"]
    assert order == ["spark-test-2", "spark-test-1"]  # workers first
    argv = {h["host"]: h["argv"] for h in out["hosts"]}

    shell = _launch_cli(tmp_path, "--fleet", "two")
    assert shell.returncode == 0, shell.stderr
    runs = [ln for ln in shell.stdout.splitlines() if not ln.startswith("#") and ln.strip()]
    assert runs == [shlex.join(argv[h]) for h in order]  # what each rank runs, in the order they start
    heads = [ln for ln in shell.stdout.splitlines() if re.match(r"# \d+\. ", ln)]
    assert [ln.split()[2] for ln in heads] == [f"{h}:" for h in order], heads
    assert "ready: HTTP 200 from /health on port 8080" in heads[1], heads
    assert "ready: a TCP listener on 127.0.0.1:8080; until then it waits for a peer" in heads[0], heads

    table = _launch_cli(tmp_path, "--fleet", "two", "--table")
    assert table.returncode == 0, table.stderr
    rows = [[c.strip() for c in ln.strip("│").split("│")] for ln in table.stdout.splitlines() if ln.startswith("│")]
    assert [(r[0], r[1]) for r in rows] == [("1", "spark-test-2"), ("2", "spark-test-1")], table.stdout
    for text in (shell.stdout, table.stdout):
        assert "{'" not in text and "': " not in text  # no Python repr of a dict, anywhere
    assert shell.stderr == table.stderr == ""
