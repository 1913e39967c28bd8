"""The pure helpers behind the host checks (builder.hostcheck), run for real on local files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from builder import hostcheck as hc


def run_script(script: str, arg: str) -> object:
    r = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


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


# ----------------------------------------------------------------------------- the prefetch batch


def test_batch_script_runs_shell_and_python_items(tmp_path: Path) -> None:
    a = tmp_path / "a.bin"
    a.write_bytes(b"\xff\x00binary")
    fail = "echo oops >&2; exit 7"
    items = [
        f"cat {a}",
        fail,
        ["py", "files", hc.FILES_SCRIPT, json.dumps({"paths": [str(a)], "hash": True})],
        ["py", "raises", "raise ValueError('bad fact')", ""],
        ["py", "exits", "import sys; sys.stdout.write('x'); sys.exit(3)", ""],
        ["py", "says", "import sys; sys.stderr.write('why'); sys.exit(1)", ""],
    ]
    # as the checks run it on a host: python3 -I -S (standard library only)
    r = subprocess.run([sys.executable, "-I", "-S", "-c", hc.BATCH_SCRIPT, json.dumps(items)], capture_output=True,
                       text=True, check=True)
    got = hc.parse_batch(r.stdout)
    assert got[f"cat {a}"] == (0, b"\xff\x00binary", b"")
    assert got[fail] == (7, b"", b"oops\n")
    rc, out, _ = got["files"]
    assert rc == 0 and json.loads(out)[str(a)]["sha256"] == hashlib.sha256(a.read_bytes()).hexdigest()
    rc, out, err = got["raises"]
    assert rc == 1 and out == b"" and b"ValueError: bad fact" in err
    assert got["exits"] == (3, b"x", b"")
    assert got["says"] == (1, b"", b"why")  # a fact script's stderr is kept too


def test_parse_batch_refuses_what_the_batch_does_not_print() -> None:
    for text in ("[]", '{"c": [0, "", ""', '{"c": ["0", "", ""]}', '{"c": [0, ""]}'):
        with pytest.raises(ValueError):
            hc.parse_batch(text)


def test_batch_groups_stay_under_the_argument_limit() -> None:
    items: list[object] = [f"cat /srv/f{i:04d}" for i in range(400)] + [["py", "big", "x" * 200, "y"]]
    groups = hc.batch_groups(items, max_chars=2_000)
    assert len(groups) > 1
    assert [i for g in groups for i in g] == items
    assert all(len(json.dumps(g)) <= 2_000 for g in groups)
    huge = "z" * 5_000
    groups = hc.batch_groups(["a", huge, "b"], max_chars=2_000)
    assert groups == [["a", "b"]]  # left to the check that needs it


def checklib_fresh() -> object:
    """checks/checklib as the per-host pytest imports it, with its per-host caches empty."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "checks"))
    try:
        import checklib
    finally:
        sys.path.pop(0)
    for cache in (checklib.RAN, checklib.APPLIED_CACHE, checklib.EXISTS_CACHE, checklib.LIST_CACHE):
        cache.clear()
    checklib.PREFETCHED.clear()
    return checklib


def local_expect(tmp_path: Path) -> dict[str, object]:
    root = tmp_path / "models" / "tiny"
    root.mkdir(parents=True)
    (root / "w.bin").write_bytes(b"w" * 10)
    return {
        "concerns": ["release", "models", "engram", "memory", "storage", "runtime"],
        "mode": "fast",
        "phase": "preflight",
        "host": {"role": "head"},
        "paths": {"engram": str(tmp_path / "engram"), "models": str(tmp_path / "models")},
        "applied_path": str(tmp_path / "state" / "applied.json"),
        "current_path": str(tmp_path / "current"),
        "models": [{"root": str(root), "files": [{"path": "w.bin", "size": 10, "sha256": "0" * 64}]}],
        "expect": {"gpu_count": 0, "rdma": False, "nfs_mounts": [], "min_free_disk_gib": 1, "docker": False},
    }


def test_require_fails_where_need_skips() -> None:
    cl: Any = checklib_fresh()
    assert cl.require([1], "x") == [1] and cl.need({"a": 1}, "x") == {"a": 1}
    for empty in (None, [], {}):
        with pytest.raises(pytest.fail.Exception, match="^expected X, found none$"):
            cl.require(empty, "expected X, found none")
        with pytest.raises(pytest.skip.Exception, match="^why$"):
            cl.need(empty, "why")


def test_a_missing_image_record_fails_with_a_lock_and_skips_without() -> None:
    cl: Any = checklib_fresh()
    img = {"image_id": "sha256:1"}
    assert cl.expected_image({"image": img, "lock_hash": "h"}) == img
    why = "image demo: expected a build record for input address 0123 in S (run `builder image demo`), found none"
    with pytest.raises(pytest.fail.Exception, match="expected a build record"):
        cl.expected_image({"image": None, "image_reason": why, "lock_hash": "h"})
    with pytest.raises(pytest.skip.Exception, match="no lock file"):
        cl.expected_image({"image": None, "image_reason": "no lock file at pins.lock", "lock_hash": None})


def test_collection_error_in_one_line() -> None:
    import importlib.util
    from types import SimpleNamespace

    checks = Path(__file__).resolve().parent.parent / "checks"
    sys.path.insert(0, str(checks))
    try:
        spec = importlib.util.spec_from_file_location("builder_checks_conftest", checks / "conftest.py")
        assert spec is not None and spec.loader is not None
        conf: Any = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(conf)
    finally:
        sys.path.pop(0)
    imp = "test_x.py:1: in <module>\n    import nope\nE   ModuleNotFoundError: No module named 'nope'"
    syn = 'ast.py:50: in parse\nE     File "test_x.py", line 1\nE       def f(:\nE   SyntaxError: invalid syntax'
    native = 'Traceback:\n  File "test_x.py", line 1, in <module>\n    x = y\nNameError: name \'y\' is not defined\n'
    assert conf._collect_message(SimpleNamespace(longrepr=imp)) == "ModuleNotFoundError: No module named 'nope'"
    assert conf._collect_message(SimpleNamespace(longrepr=syn)) == "SyntaxError: invalid syntax"
    assert conf._collect_message(SimpleNamespace(longrepr=native)) == "NameError: name 'y' is not defined"
    conf._STATE["root"] = "checks"
    conf.pytest_collectreport(SimpleNamespace(failed=True, nodeid="test_x.py", longrepr=imp))
    conf.pytest_collectreport(SimpleNamespace(failed=False, nodeid="test_y.py", longrepr=None))
    assert conf._STATE["collect_errors"] == ["checks/test_x.py: ModuleNotFoundError: No module named 'nope'"]


def test_prefetch_answers_the_checks_commands_from_one_call(tmp_path: Path) -> None:
    import testinfra

    cl: Any = checklib_fresh()
    host = testinfra.get_host("local://")
    expect = local_expect(tmp_path)
    planned = cl.planned(expect)
    calls: list[str] = []
    real_run = host.run

    def counting_run(command: str, *args: str) -> Any:
        calls.append(command)
        return real_run(command, *args)

    host.run = counting_run
    cl.prefetch(host, expect)
    assert calls == ["python3 -I -S -c %s %s %s"]  # every planned command, one remote call
    assert len(cl.RAN) == len(planned) >= 6
    meminfo = cl.run(host, *cl.MEMINFO)
    assert meminfo.rc == 0 and "MemAvailable:" in meminfo.stdout
    assert cl.listing(host, expect, str(tmp_path / "models" / "tiny")) == ["w.bin"]
    rec, why = cl.read_applied(host, expect)
    assert rec is None and "no apply record" in why
    df = cl.run(host, *cl.free_disk(str(tmp_path / "models")))
    assert df.rc == 0 and len(df.stdout.split()) >= 4
    assert calls == ["python3 -I -S -c %s %s %s"]  # all of that answered from the prefetch
    cl.run(host, "true")  # a command nobody planned still runs, on its own
    assert calls[-1] == "true"
    cl.prefetch(host, expect)  # once per host
    assert len(calls) == 2


def test_prefetch_that_fails_leaves_each_check_to_run_its_own_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import testinfra

    cl: Any = checklib_fresh()
    host = testinfra.get_host("local://")
    expect = local_expect(tmp_path)
    monkeypatch.setattr(hc, "BATCH_SCRIPT", "print('not the batch output')")
    cl.prefetch(host, expect)
    assert cl.RAN == {}
    r = cl.run(host, *cl.MEMINFO)  # runs for real
    assert r.rc == 0 and "MemAvailable:" in r.stdout


def test_batch_bounds_each_shell_command_and_kills_its_group() -> None:
    # a child of the command's shell must go too; 317 s: a duration no other test's process has
    hung = "sleep 317 & sleep 317; wait"
    items = [hung, "echo fine", ["py", "fact", "import sys; sys.stdout.write('ok')", ""]]
    r = subprocess.run([sys.executable, "-I", "-S", "-c", hc.BATCH_SCRIPT, json.dumps(items), "1"],
                       capture_output=True, text=True, check=True, timeout=120)
    got = hc.parse_batch(r.stdout)
    rc, _, err = got[hung]
    assert rc == 124 and err.endswith(b"builder: timed out after 1 s\n")
    assert got["echo fine"] == (0, b"fine\n", b"") and got["fact"] == (0, b"ok", b"")
    # SIGKILL is sent at once, but a busy machine may take a moment to finish the processes off
    for _ in range(100):
        left = subprocess.run(["pgrep", "-f", "^sleep 317$"], capture_output=True, text=True)
        if not left.stdout.strip():
            break
        time.sleep(0.1)
    assert left.stdout.strip() == "", f"left running: {left.stdout}"


def test_a_hung_tool_costs_its_own_fact_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FAKE nvidia-smi (test only: no GPU here) that hangs, as a wedged driver's does."""
    import testinfra

    cl: Any = checklib_fresh()
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexec sleep 300\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(cl, "COMMAND_SECONDS", 1)
    expect = local_expect(tmp_path)
    expect["concerns"] = ["gpu", "memory"]
    expect["expect"]["gpu_count"] = 1  # type: ignore[index]
    host = testinfra.get_host("local://")
    cl.prefetch(host, expect)
    assert cl.exists(host, "nvidia-smi")
    for c in cl.gpu_commands():
        r = cl.run(host, *c)
        assert r.rc == 124 and "timed out after 1 s" in r.stderr
    assert "MemAvailable:" in cl.run(host, *cl.MEMINFO).stdout


# ----------------------------------------------------------------------------- DOCKER_SCRIPT


def docker_script(req: dict[str, Any], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-I", "-S", "-c", hc.DOCKER_SCRIPT, json.dumps(req)],
                          capture_output=True, text=True, timeout=120, env=env)


def docker_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.docker
def test_docker_script_answers_as_the_docker_cli_does() -> None:
    """Against this machine's real Docker Engine: the same images, runtimes and misses as the CLI."""
    import fleetlib

    if not fleetlib.docker_available():
        pytest.skip("Docker engine not reachable")
    image_id = fleetlib.tiny_image("builder-test-dockerscript:1", labels={"org.builder.test": "yes"})
    refs = [image_id, "builder-test-dockerscript:1", "builder-test-missing:0"]
    cli, ours = docker_cli("image", "inspect", *refs), docker_script({"cmd": "inspect", "refs": refs})
    assert cli.returncode == ours.returncode == 1
    assert json.loads(ours.stdout) == json.loads(cli.stdout) and len(json.loads(ours.stdout)) == 2
    miss = "No such image: builder-test-missing:0"
    assert miss in cli.stderr and miss in ours.stderr
    found = docker_script({"cmd": "inspect", "refs": refs[:2]})
    assert found.returncode == 0 and found.stderr == ""
    info_cli = json.loads(docker_cli("info", "--format", "{{json .}}").stdout)
    info = docker_script({"cmd": "info"})
    assert info.returncode == 0
    got = json.loads(info.stdout)
    for key in ("ServerVersion", "Runtimes", "DefaultRuntime", "ID"):
        assert got[key] == info_cli[key], key


def test_docker_script_without_an_engine(tmp_path: Path) -> None:
    env = dict(os.environ, DOCKER_HOST=f"unix://{tmp_path}/none.sock")
    info = docker_script({"cmd": "info"}, env)
    assert info.returncode == 1
    assert json.loads(info.stdout) == {"ServerErrors": [
        f"Cannot connect to the Docker daemon at unix://{tmp_path}/none.sock. Is the docker daemon running?"]}
    insp = docker_script({"cmd": "inspect", "refs": ["a:1", "b:2"]}, env)
    # no answer about either image: not "No such image" (the check then says the engine did not answer)
    assert insp.returncode == 1 and "No such image" not in insp.stderr and "Cannot connect" in insp.stderr


def test_docker_script_bounds_an_engine_that_does_not_answer(tmp_path: Path) -> None:
    """A unix socket that accepts and then says nothing, as a wedged dockerd does."""
    import socket

    path = tmp_path / "hung.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)
    try:
        r = docker_script({"cmd": "info", "seconds": 1}, dict(os.environ, DOCKER_HOST=f"unix://{path}"))
    finally:
        srv.close()
    assert r.returncode == 1 and json.loads(r.stdout) == {"ServerErrors": ["builder: timed out after 1 s"]}


def test_docker_script_leaves_other_engines_to_the_cli(tmp_path: Path) -> None:
    """DOCKER_HOST over tcp (or a docker context): only the CLI knows how to reach it, so the script
    runs the real CLI; its answer names the tcp address, which the socket path never would. The port
    is a closed one on loopback."""
    import shutil

    if shutil.which("docker") is None:
        pytest.skip("no docker CLI")
    env = dict(os.environ, DOCKER_HOST="tcp://127.0.0.1:9")
    r = docker_script({"cmd": "inspect", "refs": ["a:1"]}, env)
    cli = docker_cli("image", "inspect", "a:1", env=env)
    assert r.returncode == cli.returncode != 0 and "127.0.0.1:9" in r.stderr
    ctx = tmp_path / "dockercfg"
    ctx.mkdir()
    (ctx / "config.json").write_text(json.dumps({"currentContext": "remote-spark"}))
    r = docker_script({"cmd": "info"}, dict(os.environ, DOCKER_CONFIG=str(ctx)))
    # the CLI itself fails on the unknown context: proof that the CLI, not the socket, answered
    assert r.returncode != 0 and "remote-spark" in (r.stdout + r.stderr)


def test_docker_script_speaks_http_1_0_and_names_a_socket_that_is_not_an_engine(tmp_path: Path) -> None:
    """The request line the script sends (the reference quoted as urllib.parse.quote would), and a
    socket that answers something other than HTTP: a fake engine on a real unix socket."""
    import socket
    import threading
    from urllib.parse import quote

    path = tmp_path / "odd.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)
    seen: list[bytes] = []

    def answer() -> None:
        for _ in range(2):
            c, _a = srv.accept()
            data = b""
            while b"\r\n\r\n" not in data:
                data += c.recv(4096)
            seen.append(data)
            c.sendall(b"SSH-2.0-not-docker\r\n" if len(seen) == 1 else
                      b'HTTP/1.0 404 Not Found\r\nContent-Type: application/json\r\n\r\n{"message":"nope"}\n')
            c.close()

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    env = dict(os.environ, DOCKER_HOST=f"unix://{path}")
    ref = "reg.example:5000/a b+c@sha256:00"
    try:
        bad = docker_script({"cmd": "info", "seconds": 5}, env)
        miss = docker_script({"cmd": "inspect", "refs": [ref], "seconds": 5}, env)
    finally:
        t.join(5)
        srv.close()
    assert bad.returncode == 1
    assert json.loads(bad.stdout) == {"ServerErrors": [f"unix://{path}: not an HTTP response from the Docker daemon"]}
    assert seen[0].startswith(b"GET /info HTTP/1.0\r\n")
    assert seen[1].startswith(f"GET /images/{quote(ref, safe='/:@')}/json HTTP/1.0\r\n".encode())
    assert miss.returncode == 1 and miss.stderr == "Error response from daemon: nope\n"
    assert json.loads(miss.stdout) == []
