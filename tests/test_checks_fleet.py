"""`builder audit` over real ssh on the test fleet, on a real install: the fleet is set up by the
operator's journey (tests/lib/journeylib.py: the shipped pins, `builder image`, `builder bundle`, `builder
ship` with the real installer), with a fake `nvidia-smi` on each host (no GPU here; FAKE, named as such,
speaking nvidia-smi's real output format). These tests cover what the journey test does not: how the
audit reaches hosts (one connection, kept connections, two audits at once, a frozen or cut host), GPU
drift, image tags, and the Ansible backend. The drifts of an installed lane are tests/test_journey.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from builder.launch import LABEL_BUNDLE, LABEL_LANE, LABEL_RANK
from tests.lib import auditlib, factory, fleetlib
from tests.lib.journeylib import PATHS, Journey, journey

pytestmark = [pytest.mark.fleet, pytest.mark.docker, pytest.mark.build]

GPU_EXPECT = auditlib.H200_EXPECT


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not fleetlib.docker_available():
        pytest.fail("Docker Engine not reachable: the fleet tests need it")
    with journey(
        tmp_path_factory.mktemp("checks-fleet"), 2, name="test", expect=GPU_EXPECT, prepare=auditlib.install_fake_on
    ) as j:
        rec = json.loads(j.fleet.exec(j.fleet.hosts[0], f"cat {PATHS['bundles']}/state/applied.json").stdout)
        yield {"j": j, "fleet": j.fleet, "image_id": rec["image"]["image_id"]}


def audit(env: dict[str, Any], *args: str, path_prefix: str | None = None) -> tuple[int, dict[str, Any], str]:
    """`builder audit --fleet test --json` (Journey.audit names the fleet)."""
    j: Journey = env["j"]
    extra = {"PATH": path_prefix + os.pathsep + j.env["PATH"]} if path_prefix else None
    rc, data = j.audit("--connect-timeout", "3", *args, env=extra)
    return rc, data, j.last_stderr


def failing(data: dict[str, Any]) -> set[tuple[str, str]]:
    out = set()
    for host, h in data["hosts"].items():
        for cid, c in h["checks"].items():
            if c["status"] in ("fail", "error"):
                out.add((host, cid))
    return out


def statuses(data: dict[str, Any]) -> dict[str, str]:
    return {n: h["status"] for n, h in data["hosts"].items()}


def test_clean_fleet_passes_fast_and_full(env: dict[str, Any]) -> None:
    for mode in ("fast", "full"):
        rc, data, err = audit(env, "--mode", mode)
        assert failing(data) == set(), err
        assert rc == 0, err
        assert statuses(data) == {"spark-test-1": "pass", "spark-test-2": "pass"}
        checks = data["hosts"]["spark-test-1"]["checks"]
        for must in (
            "image::present_by_id",
            "image::diff_ids",
            "release::launch_files_unchanged",
            "models::content",
            "engram::own_rank_files",
            "gpu::name",
            "gpu::cuda_version",
            "memory::available",
            "runtime::docker",
            "runtime::api_port_free",
        ):
            assert checks[must]["status"] == "pass", (must, checks[must])
        assert checks["fabric::dev_infiniband"]["status"] == "skip"
        assert "expect.rdma = false" in checks["fabric::dev_infiniband"]["message"]
    assert "spark-test-2" in err and "pass" in err  # the matrix on stderr


def test_one_connection_and_one_remote_command_per_host(env: dict[str, Any], tmp_path: Path) -> None:
    fleet = env["fleet"]

    def accepted(h: Any) -> int:  # connections the host's sshd accepted so far
        r = fleet.exec(h, ["grep", "-c", "Accepted publickey", "/var/log/sshd.log"], check=False)
        return int(r.stdout.strip() or 0)

    bindir, log = tmp_path / "bin", tmp_path / "ssh.log"
    auditlib.install_ssh_logger(bindir, log)
    before = {h.name: accepted(h) for h in fleet.hosts}
    rc, data, err = audit(env, "--ssh-persist", "0", path_prefix=str(bindir))
    assert rc == 0, err
    assert {h.name: accepted(h) - before[h.name] for h in fleet.hosts} == {"spark-test-1": 1, "spark-test-2": 1}
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    for h in fleet.hosts:
        mine = [c for c in calls if h.name in c]
        assert sum("-N" in c for c in mine) == 1 and sum("-O" in c for c in mine) == 1  # open, close
        remote = [c[-1] for c in mine if "-N" not in c and "-O" not in c]
        # the prefetch batch alone: the release files' hashes too (the host reads the record's list)
        assert len(remote) == 1, remote
        assert remote[0].startswith("python3 -I -S -c ") and "b2a_base64" in remote[0]
        # every call names the audit's connection for this host (the fleet's ssh_config names none)
        paths = {a for c in mine for a in c if a.startswith("ControlPath=")}
        assert len(paths) == 1 and paths.pop().startswith(f"ControlPath={os.environ['BUILDER_SSH_DIR']}/")
    # --ssh-persist 0: every connection closed, nothing left in the folder
    assert not [s for s in Path(os.environ["BUILDER_SSH_DIR"]).iterdir() if s.is_socket()]


def test_the_next_audit_reuses_each_hosts_connection(env: dict[str, Any], tmp_path: Path) -> None:
    fleet = env["fleet"]
    folder = Path(os.environ["BUILDER_SSH_DIR"])

    def accepted(h: Any) -> int:
        r = fleet.exec(h, ["grep", "-c", "Accepted publickey", "/var/log/sshd.log"], check=False)
        return int(r.stdout.strip() or 0)

    rc, first, err = audit(env, "--ssh-persist", "60")
    assert rc == 0, err
    socks = sorted(s for s in folder.iterdir() if s.is_socket())
    assert len(socks) == 2  # kept open for the next audit
    assert all(s.stat().st_mode & 0o077 == 0 for s in [folder, *socks])
    before = {h.name: accepted(h) for h in fleet.hosts}
    rc, second, err = audit(env, "--ssh-persist", "60")
    assert rc == 0, err
    assert {h.name: accepted(h) - before[h.name] for h in fleet.hosts} == {"spark-test-1": 0, "spark-test-2": 0}
    assert sorted(s for s in folder.iterdir() if s.is_socket()) == socks
    strip = {n: {c: (v["status"], v["message"]) for c, v in h["checks"].items()} for n, h in first["hosts"].items()}
    assert strip == {n: {c: (v["status"], v["message"]) for c, v in h["checks"].items()}
                     for n, h in second["hosts"].items()}


def test_two_audits_at_once_open_one_connection_per_host(env: dict[str, Any]) -> None:
    """Both find no connection and open one at the same moment: the per-host lock lets one open it
    and the other reuse it, instead of leaving a second connection behind in the background."""
    folder = Path(os.environ["BUILDER_SSH_DIR"])
    codes: list[int] = []

    def one() -> None:
        codes.append(audit(env, "--ssh-persist", "60")[0])

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [0, 0]
    ours = []
    for pid in os.listdir("/proc"):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"ssh") and any(a.startswith(f"ControlPath={folder}".encode()) for a in argv):
            ours.append(argv)
    assert len(ours) == 2, ours  # one master per host, nothing else left running


def test_a_kept_connection_to_a_host_that_stopped_answering_is_dropped(env: dict[str, Any]) -> None:
    """The kept connection is still open on this side, but the host answers nothing on it (frozen):
    that host is reported unreachable in bounded time, the other reuses its connection, and once the
    host answers again the next audit passes on a connection of its own."""
    fleet = env["fleet"]
    h2 = fleet.hosts[1]
    rc, _, err = audit(env, "--ssh-persist", "60")
    assert rc == 0, err
    fleet.pause(h2)
    try:
        rc, data, err = audit(env, "--connect-timeout", "2", "--ssh-persist", "60")
    finally:
        fleet.unpause(h2)
    assert rc == 3, err
    assert statuses(data) == {"spark-test-1": "pass", "spark-test-2": "unreachable"}
    rc, data, err = audit(env)
    assert rc == 0, err


def test_other_image_then_removed_image(env: dict[str, Any]) -> None:
    j: Journey = env["j"]
    fleet = env["fleet"]
    h2, h1 = fleet.hosts[1], fleet.hosts[0]
    image_id = env["image_id"]
    tag = json.loads(fleet.exec(h1, ["docker", "image", "inspect", image_id]).stdout)[0]["RepoTags"][0]
    # another image: a container of the lane's image committed (same files, another ImageID)
    fleet.exec(h2, f"docker create --name other-src {image_id} >/dev/null")
    other = fleet.exec(h2, "docker commit other-src other/demo:1").stdout.strip()
    fleet.exec(h2, ["docker", "tag", other, tag])  # the lane's tag now names another image
    fleet.exec(h1, ["docker", "rmi", "-f", tag])  # and host 1 loses the image altogether
    try:
        rc, data, err = audit(env, "--only", "image,release")
        assert failing(data) == {
            ("spark-test-2", "image::tag_points_at_image"),
            ("spark-test-1", "image::present_by_id"),
            ("spark-test-1", "image::tag_points_at_image"),
        }, err
        assert rc == 1
        msg = data["hosts"]["spark-test-2"]["checks"]["image::tag_points_at_image"]["message"]
        assert image_id in msg and other in msg
    finally:
        # host 1 gets the image back from its own bundle's archive, host 2 its tag
        fleet.docker_load(h1, j.root / "out/bundles/test/spark-test-1/image.tar")
        fleet.exec(h2, ["docker", "tag", image_id, tag])
        fleet.exec(h2, "docker rm other-src >/dev/null; docker rmi other/demo:1 >/dev/null", check=False)
    rc, data, err = audit(env, "--only", "image")
    assert rc == 0, err

def test_gpu_drift_from_fake_nvidia_smi(env: dict[str, Any]) -> None:
    fleet = env["fleet"]
    h = fleet.hosts[0]
    fleet.exec(h, "echo '4242, python3, 1024' > /etc/fake-nvidia-smi/apps")
    try:
        rc, data, err = audit(env, "--only", "gpu")
        assert failing(data) == {("spark-test-1", "gpu::no_other_compute_process")}, err
        assert "4242" in data["hosts"]["spark-test-1"]["checks"]["gpu::no_other_compute_process"]["message"]
    finally:
        fleet.exec(h, "rm -f /etc/fake-nvidia-smi/apps")


def test_cut_host_is_unreachable_rest_audited(env: dict[str, Any], tmp_path: Path) -> None:
    fleet = env["fleet"]
    h = fleet.hosts[0]
    fleet.cut(h)
    try:
        junit = tmp_path / "audit.xml"
        rc, data, err = audit(env, "--junit", str(junit))
        assert rc == 3, err
        assert statuses(data) == {"spark-test-1": "unreachable", "spark-test-2": "pass"}
        assert data["hosts"]["spark-test-1"]["message"]
        xml = junit.read_text()
        assert 'name="spark-test-1"' in xml and "unreachable" in xml
    finally:
        fleet.restore(h)


def test_ansible_backend(env: dict[str, Any], tmp_path: Path) -> None:
    if shutil.which("ansible-inventory") is None:
        pytest.fail("ansible-core is not installed (pip install -e '.[dev]' installs it)")
    j: Journey = env["j"]
    inv = tmp_path / "inventory.yml"
    j.builder("hosts", "--fleet", "test", "--ansible", str(inv))
    listed = json.loads(
        subprocess.run(
            ["ansible-inventory", "-i", str(inv), "--list"], capture_output=True, text=True, check=True
        ).stdout
    )
    hv = listed["_meta"]["hostvars"]
    assert hv["spark-test-2"]["rank"] == 1 and hv["spark-test-2"]["role"] == "worker"
    rc, data, err = audit(env, "--backend", "ansible", "--inventory", str(inv))
    assert rc == 0, err
    assert data["hosts"]["spark-test-2"]["checks"]["engram::own_rank_files"]["status"] == "pass"
    # drift is seen through the Ansible backend too
    fleet = env["fleet"]
    fleet.exec(fleet.hosts[1], "echo '77, engine, 1' > /etc/fake-nvidia-smi/apps")
    try:
        rc, data, err = audit(env, "--backend", "ansible", "--inventory", str(inv), "--only", "gpu")
        assert failing(data) == {("spark-test-2", "gpu::no_other_compute_process")}, err
    finally:
        fleet.exec(fleet.hosts[1], "rm -f /etc/fake-nvidia-smi/apps")


def test_the_lanes_own_engine_on_the_gpu_is_not_another_compute_process(env: dict[str, Any]) -> None:
    """Once the lane serves, the GPU holds its engine: the check accepts the processes of this rank's
    container (started from the installed bundle) and still names any other."""
    j: Journey = env["j"]
    fleet = env["fleet"]
    h = fleet.hosts[1]
    j.start()
    try:
        pid = fleet.exec(h, "docker inspect -f '{{.State.Pid}}' builder-demo-r1").stdout.strip()
        fleet.exec(h, f"echo '{pid}, demo-engine, 1024' > /etc/fake-nvidia-smi/apps")
        rc, data, err = audit(env, "--only", "gpu", "--phase", "all")
        assert rc == 0 and failing(data) == set(), err
        fleet.exec(h, f"printf '{pid}, demo-engine, 1024\\n4242, python3, 10\\n' > /etc/fake-nvidia-smi/apps")
        rc, data, err = audit(env, "--only", "gpu")
        assert failing(data) == {("spark-test-2", "gpu::no_other_compute_process")}, err
        msg = data["hosts"]["spark-test-2"]["checks"]["gpu::no_other_compute_process"]["message"]
        assert "4242" in msg and f"pid {pid} " not in msg
    finally:
        fleet.exec(h, "rm -f /etc/fake-nvidia-smi/apps")
        j.stop()



# ----------------------------------------------------------------------------- memory held by the lane

#: what each memory holder below holds (shm written into its own /dev/shm, charged to its cgroup)
HOLD_MIB = 1536


def _hold_memory(fleet: fleetlib.Fleet, h: fleetlib.Host, image: str, name: str, labels: list[str],
                 mib: int = HOLD_MIB) -> str:
    """A container on `h` that writes `mib` MiB into its /dev/shm and sleeps: its ID, once it holds them."""
    cid = fleet.exec(h, [
        "docker", "run", "-d", "--name", name, "--network", "none", "--shm-size", f"{mib + 64}m", *labels, image,
        "sh", "-c", f"busybox head -c {mib << 20} /dev/zero > /dev/shm/hold && busybox touch /dev/shm/held && "
        "exec busybox sleep 3600",
    ]).stdout.strip()
    for _ in range(600):
        held = fleet.exec(h, ["docker", "exec", name, "busybox", "test", "-e", "/dev/shm/held"], check=False)
        if held.returncode == 0:
            return cid
        time.sleep(0.1)
    raise AssertionError(f"{name} did not write its {mib} MiB")


def _mem_available_gib(fleet: fleetlib.Fleet, h: fleetlib.Host) -> float:
    line = fleet.exec(h, "grep MemAvailable: /proc/meminfo").stdout.split()
    return int(line[1]) / (1 << 20)


def _set_min_free_memory(j: Journey, last_host_gib: float | None) -> None:
    """min_free_memory_gib of the fleet's last host (GPU_EXPECT's when None)."""
    path = j.root / "hosts" / "test.toml"
    doc = tomllib.loads(path.read_text())
    want = GPU_EXPECT["min_free_memory_gib"] if last_host_gib is None else round(last_host_gib, 3)
    doc["hosts"][-1]["expect"]["min_free_memory_gib"] = want
    factory.write_fleet(j.root, doc, "test")


def _memory_result(env: dict[str, Any]) -> tuple[str, str]:
    rc, data, err = audit(env, "--only", "memory")
    c = data["hosts"]["spark-test-2"]["checks"]["memory::available"]
    assert data["hosts"]["spark-test-1"]["checks"]["memory::available"]["status"] == "pass", err
    return c["status"], c["message"]


#: GiB MemAvailable may move by during one check for its result to count (half the margin the test sets)
STEADY_GIB = HOLD_MIB / 6 / 1024


def _memory_result_at(env: dict[str, Any], h: fleetlib.Host, over_gib: float) -> tuple[str, str]:
    """The memory check's result with the last host's min_free_memory_gib at its MemAvailable + over_gib.
    MemAvailable is the whole machine's, which the other tests running beside this one take and give
    back by gigabytes (a vLLM rank, a build): a check through which it moved by STEADY_GIB or more
    is taken again."""
    for _ in range(10):
        before = _mem_available_gib(env["fleet"], h)
        _set_min_free_memory(env["j"], before + over_gib)
        result = _memory_result(env)
        if abs(_mem_available_gib(env["fleet"], h) - before) < STEADY_GIB:
            return result
    raise AssertionError("the machine's MemAvailable moved through each of 10 checks: no result to judge")


def test_the_memory_the_lanes_own_container_holds_counts_as_available(
    env: dict[str, Any], tmp_path: Path
) -> None:
    """A serving rank's container holds memory that stopping the rank frees: with min_free_memory_gib
    above MemAvailable but below MemAvailable and what the lane's own container (labelled with the
    installed bundle) holds, the check passes; the same memory held by another container fails, named
    with what it holds. On a GPU whose memory is the host's (FAKE nvidia-smi reporting no memory of its
    own, as a DGX Spark's GB10 does), the lane's GPU processes' memory counts too."""
    j: Journey = env["j"]
    fleet = env["fleet"]
    h = fleet.hosts[1]  # rank 1, a worker
    bundle = json.loads(fleet.exec(h, f"cat {PATHS['bundles']}/state/applied.json").stdout)["bundle_id"]
    image = "builder-test-tiny:1"
    fleetlib.tiny_image(image)
    fleet.docker_load(h, fleetlib.save_image(image, tmp_path / "tiny.tar"))
    lane = ["--label", f"{LABEL_LANE}=demo", "--label", f"{LABEL_RANK}=1", "--label", f"{LABEL_BUNDLE}={bundle}"]
    query = auditlib.capture_sections()["query csv header"].splitlines()
    names = query[0].split(", ")
    try:
        _hold_memory(fleet, h, image, "builder-demo-r1", lane)
        # MemAvailable falls short by a third of what the lane's own container holds: passes with it
        status, msg = _memory_result_at(env, h, HOLD_MIB / 3 / 1024)
        assert status == "pass", msg
        # the same memory held by a container that is not the lane's: fails, naming it
        fleet.exec(h, "docker rm -f builder-demo-r1 >/dev/null")
        _hold_memory(fleet, h, image, "hog", [])
        status, msg = _memory_result_at(env, h, HOLD_MIB / 3 / 1024)
        assert status == "fail", msg
        assert msg.startswith("MemAvailable: expected >= ") and "held by the lane" not in msg, msg
        others = msg.split("; other containers: ", 1)[1]
        assert others.startswith("hog 1.5 GiB"), msg
        # a GPU whose memory is the host's: the lane's engine holds it on the GPU, its cgroup little
        fleet.exec(h, "docker rm -f hog >/dev/null")
        _hold_memory(fleet, h, image, "builder-demo-r1", lane, mib=16)
        pid = fleet.exec(h, "docker inspect -f '{{.State.Pid}}' builder-demo-r1").stdout.strip()
        fleet.exec(h, f"echo '{pid}, demo-engine, {HOLD_MIB}' > /etc/fake-nvidia-smi/apps")
        # an H200: its memory is its own, the engine's is not the host's
        status, msg = _memory_result_at(env, h, HOLD_MIB / 3 / 1024)
        assert status == "fail" and "held by the lane's own container builder-demo-r1" in msg, msg
        row = [("[N/A]" if n.startswith("memory.") else v) for n, v in zip(names, query[1].split(", "), strict=True)]
        fleet.exec(h, ["sh", "-c", "cat > /etc/fake-nvidia-smi/query"],
                   input=(query[0] + "\n" + ", ".join(row) + "\n").encode())
        status, msg = _memory_result_at(env, h, HOLD_MIB / 3 / 1024)
        assert status == "pass", msg
    finally:
        _set_min_free_memory(j, None)
        fleet.exec(h, "rm -f /etc/fake-nvidia-smi/apps /etc/fake-nvidia-smi/query; "
                      "docker rm -f builder-demo-r1 hog >/dev/null 2>&1; docker rmi builder-test-tiny:1 >/dev/null",
                   check=False)
