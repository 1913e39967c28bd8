"""The memory check's facts and judgement: who holds a host's memory (builder/hostscripts/memory.py, run
on the host: each running container's cgroup, v1 or v2, and the biggest processes outside containers),
what the lane's own running release holds (credited: stopping the rank frees it), and the message that
names the other holders. The parsing and arithmetic here on their own; the module against this
machine's real engine and kernel (marked docker); the whole check on the test fleet is in
tests/test_checks_fleet.py."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import testinfra

from builder import hostscripts as hs
from builder.hostscripts import memory
from tests.lib import fleetlib
from tests.lib.checkmods import check_module, checklib_fresh, concerns_for, count_commands, local_expect

GiB = 1 << 30
MiB = 1 << 20
ID1, ID2, ID3 = "a" * 64, "b" * 64, "c" * 64


def test_the_module_is_standard_library_only_and_sent_as_it_is() -> None:
    src = hs.source("memory")
    assert src == hs.MEMORY == (Path(hs.__file__).parent / "memory.py").read_text()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for node in ast.walk(ast.parse(src)):
        mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        assert all(m.split(".")[0] in stdlib for m in mods), mods


# ----------------------------------------------------------------------------- cgroup arithmetic


def test_held_is_the_charge_less_what_memavailable_already_counts() -> None:
    """v2: memory.current less the file LRU pages and reclaimable slab (MemAvailable counts those);
    anonymous, shm (on the anon LRU) and other kernel memory stay."""
    stat = memory.parse_stat(
        "anon 3221225472\nfile 2147483648\nkernel 104857600\nshmem 536870912\nactive_file 1073741824\n"
        "inactive_file 536870912\nslab_reclaimable 52428800\nslab_unreclaimable 10485760\nbogus x\n"
    )
    assert stat["anon"] == 3 * GiB and "bogus" not in stat
    usage = 3 * GiB + 2 * GiB + 100 * MiB
    assert memory.held_bytes("v2", usage, stat) == usage - GiB - 512 * MiB - 50 * MiB
    # v1: the hierarchy's total_* counters where present, else the cgroup's own
    v1 = memory.parse_stat("active_file 10\ninactive_file 20\ntotal_active_file 1000\ntotal_inactive_file 2000\n")
    assert memory.held_bytes("v1", 10_000, v1) == 7_000
    assert memory.held_bytes("v1", 10_000, {"active_file": 100, "inactive_file": 200}) == 9_700
    assert memory.held_bytes("v2", 100, {"active_file": 300}) == 0  # (usage is approximate: never negative)


def test_the_memory_hierarchy_and_a_process_cgroup(tmp_path: Path) -> None:
    v1 = ("cgroup /sys/fs/cgroup/cpu cgroup rw,nosuid,cpu,cpuacct 0 0\n"
          "cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0\n")
    assert memory.memory_mount(v1) == ("v1", "/sys/fs/cgroup/memory")
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert memory.memory_mount(f"cgroup2 {unified} cgroup2 rw,nosuid 0 0\n") == ("v2", str(unified))
    # hybrid: the cgroup2 mount has no controller, the v1 memory mount is the one
    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    (hybrid / "cgroup.controllers").write_text("\n")
    assert memory.memory_mount(f"cgroup2 {hybrid} cgroup2 rw 0 0\n") == ("", "")
    assert memory.memory_mount(f"cgroup2 {hybrid} cgroup2 rw 0 0\n" + v1) == ("v1", "/sys/fs/cgroup/memory")
    assert memory.memory_mount("proc /proc proc rw 0 0\n") == ("", "")

    text = f"9:name=systemd:/\n4:memory:/docker/{ID1}\n1:cpu,cpuacct:/docker/{ID1}\n0::/\n"
    assert memory.memory_path("v1", text) == f"/docker/{ID1}"
    assert memory.memory_path("v2", f"0::/system.slice/docker-{ID2}.scope\n") == f"/system.slice/docker-{ID2}.scope"
    assert memory.memory_path("v1", "0::/\n") is None


def test_a_container_is_found_in_the_cgroup_path_as_either_driver_names_it() -> None:
    ids = {ID1, ID2}
    assert memory.container_of(f"/docker/{ID1}", ids) == (ID1, f"/docker/{ID1}")
    systemd = f"/system.slice/docker-{ID2}.scope"
    assert memory.container_of(systemd, ids) == (ID2, systemd)
    # a process in a sub-cgroup of the container counts for the container's cgroup
    assert memory.container_of(f"/docker/{ID1}/init", ids) == (ID1, f"/docker/{ID1}")
    # the host is itself a container (ID3, not one of this engine's): the inner container counts
    assert memory.container_of(f"/docker/{ID3}/docker/{ID1}", ids) == (ID1, f"/docker/{ID3}/docker/{ID1}")
    assert memory.container_of(f"/docker/{ID3}", ids) is None
    assert memory.container_of("/user.slice/user-1000.slice/session-3.scope", ids) is None


def test_a_cgroup_is_read_under_the_mount_even_when_the_mount_root_is_not_the_hierarchys(tmp_path: Path) -> None:
    own = tmp_path / "docker" / ID1
    own.mkdir(parents=True)
    assert memory.cgroup_dir(str(tmp_path), f"/docker/{ID1}") == str(own)
    # /proc/PID/cgroup names the whole path; this mount's root is the host container's cgroup
    assert memory.cgroup_dir(str(tmp_path), f"/docker/{ID3}/docker/{ID1}") == str(own)
    assert memory.cgroup_dir(str(tmp_path), f"/../../docker/{ID1}") == str(own)  # (another cgroup namespace)
    assert memory.cgroup_dir(str(tmp_path), f"/docker/{ID2}") is None
    (own / "memory.current").write_text(f"{2 * GiB}\n")
    (own / "memory.stat").write_text(f"anon {GiB}\nactive_file {GiB // 2}\ninactive_file {GiB // 4}\n")
    assert memory.cgroup_held("v2", str(own)) == (GiB + GiB // 4, "")
    held, why = memory.cgroup_held("v1", str(own))  # (no memory.usage_in_bytes there)
    assert held is None and "memory.usage_in_bytes" in why


def test_facts_from_a_proc_tree_and_the_docker_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """facts() over a made-up /proc and cgroup v2 tree, with a FAKE docker CLI (test only) that
    lists two running containers: each container's pids and held memory, the host's own processes
    biggest first, kernel threads (no RssAnon) left out."""
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\nprintf '{ID1}\\tbuilder-demo-r1\\n{ID2}\\tfoo\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    cg = tmp_path / "cgroup"
    for cid, usage in ((ID1, 3 * GiB), (ID2, GiB)):
        d = cg / "system.slice" / f"docker-{cid}.scope"
        d.mkdir(parents=True)
        (d / "memory.current").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"active_file {GiB // 2}\ninactive_file 0\n")
    (cg / "cgroup.controllers").write_text("memory pids\n")
    proc = tmp_path / "proc"
    procs = {
        1: ("/init.scope", "systemd", 8 * MiB),
        2: ("/", "kthreadd", None),
        100: (f"/system.slice/docker-{ID1}.scope", "engine", 2 * GiB),
        101: (f"/system.slice/docker-{ID1}.scope", "worker", GiB),
        200: (f"/system.slice/docker-{ID2}.scope", "hog", GiB),
        300: ("/user.slice/user-1000.slice/session-1.scope", "python3", 5 * GiB),
    }
    for pid, (path, name, anon) in procs.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::{path}\n")
        rss = f"RssAnon:\t{anon // 1024} kB\n" if anon is not None else ""
        (proc / str(pid) / "status").write_text(f"Name:\t{name}\nUmask:\t0022\n{rss}")
    (proc / "self").mkdir()
    got = memory.facts({"processes": 5}, proc=str(proc), mounts=f"cgroup2 {cg} cgroup2 rw 0 0\n")
    assert got["cgroup"] == "v2" and got["docker"] == ""
    assert got["containers"][ID1] == {"name": "builder-demo-r1", "held": 3 * GiB - GiB // 2, "pids": [100, 101],
                                      "why": ""}
    assert got["containers"][ID2]["held"] == GiB // 2 and got["containers"][ID2]["pids"] == [200]
    assert got["processes"] == [{"pid": 300, "name": "python3", "held": 5 * GiB},
                                {"pid": 1, "name": "systemd", "held": 8 * MiB}]
    assert memory.facts({"processes": 1}, proc=str(proc), mounts=f"cgroup2 {cg} cgroup2 rw 0 0\n")["processes"] == [
        {"pid": 300, "name": "python3", "held": 5 * GiB}]
    # no docker CLI: no containers (their processes are the host's), and why
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    bare = memory.facts({}, proc=str(proc), mounts=f"cgroup2 {cg} cgroup2 rw 0 0\n")
    assert bare["containers"] == {} and bare["docker"] == "docker: not found"
    assert [p["pid"] for p in bare["processes"]][:3] == [300, 100, 101]


# ----------------------------------------------------------------------------- the judgement


def facts_of(**containers: tuple[str, int | None, list[int]]) -> dict[str, Any]:
    return {"cgroup": "v2", "docker": "", "processes": [{"pid": 4242, "name": "python3", "held": 12 * GiB},
                                                         {"pid": 7, "name": "sshd", "held": 5 * MiB}],
            "containers": {cid: {"name": n, "held": h, "pids": p, "why": ""} for cid, (n, h, p) in containers.items()}}


def test_holders_credit_the_lanes_own_container_and_name_the_others() -> None:
    facts = facts_of(**{ID1: ("builder-x-r0", 80 * GiB, [100, 101]), ID2: ("foo", 60 * GiB, [200]),
                        ID3: ("unread", None, [300])})
    mine, others, procs = hs.memory_holders(facts, {ID1})
    assert mine == [("builder-x-r0", 80 * GiB)]
    assert others == [("foo", 60 * GiB), ("unread", 0)]
    assert procs == [("pid 4242 python3", 12 * GiB), ("pid 7 sshd", 5 * MiB)]
    # a GPU whose memory is the host's: each compute process's memory goes to its container or process
    gpu = [(101, "VLLM::Worker", 70 * GiB), (200, "llama", GiB), (4242, "python3", GiB), (999, "other", 2 * GiB)]
    mine, others, procs = hs.memory_holders(facts, {ID1}, gpu)
    assert mine == [("builder-x-r0", 150 * GiB)]
    assert others[0] == ("foo", 61 * GiB)
    assert procs == [("pid 4242 python3", 13 * GiB), ("pid 999 other", 2 * GiB), ("pid 7 sshd", 5 * MiB)]
    # not the lane's own (nothing running the installed release): every container is another's
    mine, others, _ = hs.memory_holders(facts, set())
    assert mine == [] and [n for n, _ in others] == ["builder-x-r0", "foo", "unread"]


def test_the_shortfall_message_names_the_biggest_other_holders() -> None:
    kib = 1 << 20  # KiB per GiB
    own = [("builder-x-r0", 60 * GiB)]
    others = [("foo", int(60.1 * GiB)), ("bar", GiB), ("baz", 512 * MiB), ("qux", 100 * MiB), ("tiny", 10 * MiB)]
    procs = [("pid 4242 python3", 12 * GiB)]
    # 35.2 GiB available + 60 GiB held by the lane = 95.2 < 112
    msg = hs.memory_shortfall(int(35.2 * kib), 112, own, others, procs)
    assert msg == ("MemAvailable: expected >= 112 GiB (with 60.0 GiB held by the lane's own container "
                   "builder-x-r0), found 35.2 GiB; other containers: foo 60.1 GiB, bar 1.0 GiB, baz 0.5 GiB "
                   "(+1 more); other processes: pid 4242 python3 12.0 GiB")
    # the lane's own memory makes up the rest: it is freed when deploy stops the rank
    assert hs.memory_shortfall(int(35.2 * kib), 112, [("builder-x-r0", 80 * GiB)], others, procs) == ""
    assert hs.memory_shortfall(112 * kib, 112, [], others, procs) == ""
    # nothing of the lane's: the plain message, holders under 64 MiB not named
    msg = hs.memory_shortfall(35 * kib, 112, [], [("tiny", 10 * MiB)], [], note="why")
    assert msg == "MemAvailable: expected >= 112 GiB, found 35.0 GiB (why)"
    two = hs.memory_shortfall(0, 1, [("a", 100 * MiB), ("b", 100 * MiB)], [], [])
    assert "(with 0.2 GiB held by the lane's own containers a, b)" in two


# ----------------------------------------------------------------------------- the plan


def test_the_holders_and_the_lanes_facts_are_prefetched_with_a_minimum_only(tmp_path: Path) -> None:
    cl: Any = checklib_fresh()
    expect = local_expect(tmp_path)
    # no min_free_memory_gib: MemAvailable alone
    assert cl.memory_facts() not in cl.planned(expect, concerns_for(expect))
    expect["expect"]["min_free_memory_gib"] = 1  # type: ignore[index]
    plan = cl.planned(expect, concerns_for(expect))
    assert cl.memory_facts() in plan and len(plan) == len(set(plan))
    expect.update(concerns=["memory"], lane="demo", host={"role": "worker", "rank": 1})
    expect["expect"].update(docker=True, gpu_count=1)  # type: ignore[attr-defined]
    plan = cl.planned(expect, concerns_for(expect))
    assert plan[1:] == [cl.lane_containers("demo", 1), cl.MEMINFO, cl.memory_facts(),
                        cl.cat(expect["applied_path"]), *cl.gpu_commands()]


def test_the_prefetch_runs_the_module_for_real(tmp_path: Path) -> None:
    """hostscripts.memory inside the prefetch's batch on this machine (testinfra local://): one call."""
    cl: Any = checklib_fresh()
    host = testinfra.get_host("local://")
    expect = local_expect(tmp_path)
    expect["expect"]["min_free_memory_gib"] = 1  # type: ignore[index]
    calls = count_commands(host)
    cl.prefetch(host, expect, concerns_for(expect))
    got = json.loads(cl.run(host, *cl.memory_facts()).stdout)
    assert calls == ["python3 -I -S -c %s %s %s"]
    assert got["cgroup"] in ("v1", "v2") and got["processes"] and all(p["held"] > 0 for p in got["processes"])


@pytest.mark.docker
def test_a_containers_memory_from_its_cgroup_on_this_machine() -> None:
    """Against this machine's real engine and kernel: a container holding 200 MiB of shm (written
    into its /dev/shm, charged to its cgroup) is found, with its pid, holding at least that much."""
    if not fleetlib.docker_available():
        pytest.skip("Docker engine not reachable")
    image = fleetlib.tiny_image("builder-test-tiny:1")
    cid = subprocess.run(
        ["docker", "run", "-d", "--network", "none", "--shm-size", "256m", image, "sh", "-c",
         "busybox head -c 209715200 /dev/zero > /dev/shm/hold && busybox touch /dev/shm/held && "
         "exec busybox sleep 600"],
        capture_output=True, text=True, check=True).stdout.strip()
    try:
        for _ in range(300):
            if subprocess.run(["docker", "exec", cid, "busybox", "test", "-e", "/dev/shm/held"]).returncode == 0:
                break
            time.sleep(0.1)
        got = memory.facts({})
        c = got["containers"][cid]
        assert c["held"] is not None and c["held"] >= 200 * MiB, (got["cgroup"], c)
        pid = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", cid], capture_output=True, text=True,
                             check=True).stdout.strip()
        assert int(pid) in c["pids"]
        assert all(p["pid"] != int(pid) for p in got["processes"])  # a container's process is not the host's
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)


class _FreeingHost:
    """A host (testinfra's run/backend interface) whose MemAvailable rises by `step` GiB on each read
    after a page-cache drop, as on a Spark whose last rank is still giving its memory back; `drop_rc`
    is the drop's exit status (1: not root)."""

    def __init__(self, start_gib: float, step_gib: float, drop_rc: int = 0) -> None:
        self.gib, self.step, self.drop_rc, self.ran = start_gib, step_gib, drop_rc, []
        self.backend = testinfra.get_host("local://").backend  # (quoting and decoding only)

    def run(self, command: str, *args: str) -> Any:
        self.ran.append(command)
        if "drop_caches" in command:
            return self.backend.result(self.drop_rc, command.encode(), b"", b"sh: permission denied\n")
        self.gib += self.step
        text = f"MemTotal: {128 << 20} kB\nMemAvailable: {int(self.gib * (1 << 20))} kB\n"
        return self.backend.result(0, command.encode(), text.encode(), b"")


def test_memory_gate_drops_the_cache_then_waits_for_the_floor() -> None:
    mem = check_module("memory")
    host = _FreeingHost(80.0, 5.0)
    t = time.monotonic()
    available, said = mem._drop_and_wait(host, 100.0, 30.0)
    assert available >= 100 * (1 << 20) and "page-cache drop" in said and time.monotonic() - t < 20
    assert any("drop_caches" in c for c in host.ran)
    # bounded: a floor never reached gives up after the wait, and a refused drop says so
    host = _FreeingHost(10.0, 0.0, drop_rc=1)
    t = time.monotonic()
    available, said = mem._drop_and_wait(host, 100.0, 1.0)
    assert 0.9 <= time.monotonic() - t < 5 and available == 10 * (1 << 20)
    assert "could not be dropped: sh: permission denied" in said and "1 s of waiting" in said
