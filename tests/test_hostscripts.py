"""builder/hostscripts: the modules that run on a host, run here as a host runs them (their source
sent as it is: `python3 -I -S -c SOURCE ARG`), and called directly; the batch bounds every fact.

The bound here is 1 s instead of checklib's 120 s (argv[2] is the bound the checks pass).
"""

from __future__ import annotations

import ast
import hashlib
import http.server
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from builder import hostscripts as hs
from builder.hostscripts import fabric, lane, serve
from builder.hostscripts import filefacts as files
from tests.lib import fleetlib

HOST_MODULES = ("batch", "filefacts", "fabric", "serve", "gates", "lane", "burnload", "gpuprocs")


def batch_run(items: list[object], seconds: float = 1) -> tuple[dict[str, tuple[int, bytes, bytes]], float]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-I", "-S", "-c", hs.BATCH, json.dumps(items), f"{seconds:g}"],
                       capture_output=True, text=True, check=True, timeout=120)
    return hs.parse_batch(r.stdout), time.monotonic() - start


def gone(pattern: str) -> bool:
    # SIGKILL is sent at once, but a busy machine may take a moment to finish the processes off
    for _ in range(100):
        if not subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.strip():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("name", HOST_MODULES)
def test_host_modules_are_standard_library_only_and_sent_as_they_are(name: str) -> None:
    src = hs.source(name)
    assert src == (Path(hs.__file__).parent / f"{name}.py").read_text()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [node.module or ""]
        else:
            continue
        for m in mods:
            assert m.split(".")[0] in stdlib, f"{name}.py imports {m}: the host has only the standard library"


def test_files_stats_hashes_and_lists(tmp_path: Path) -> None:
    a = tmp_path / "a.bin"
    a.write_bytes(os.urandom(3 << 20))
    (tmp_path / "d").mkdir()
    ticks: list[int] = []
    got = files.stat_files([str(a), str(tmp_path / "nope"), str(tmp_path / "d")], True, 3, lambda: ticks.append(1))
    st = a.stat()
    assert got[str(a)] == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
                           "sha256": hashlib.sha256(a.read_bytes()).hexdigest()}
    assert "error" in got[str(tmp_path / "nope")]  # type: ignore[operator]
    assert got[str(tmp_path / "d")] == {"error": "not a regular file"}
    assert len(ticks) >= 4  # each file, each 8 MiB hashed
    assert "sha256" not in files.stat_file(str(a), False, lambda: None)
    (tmp_path / "m" / "sub").mkdir(parents=True)
    (tmp_path / "m" / "b").write_text("1")
    (tmp_path / "m" / "sub" / "a").write_text("2")
    (tmp_path / "m" / "link").symlink_to(tmp_path / "m" / "b")
    listed = files.list_roots([str(tmp_path / "m"), str(tmp_path / "none")], lambda: None)
    assert listed == {str(tmp_path / "m"): ["b", "sub/a"], str(tmp_path / "none"): None}


def test_files_hashes_in_threads_only_what_is_worth_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A few KiB (a release's launch files) are hashed in one thread; from THREADS_FROM bytes on,
    in `jobs` threads, with the same answers."""
    paths = []
    for i in range(3):
        (tmp_path / str(i)).write_bytes(bytes([i]) * (1000 + i))
        paths.append(str(tmp_path / str(i)))
    threads: list[int] = []
    real = files.stat_file
    monkeypatch.setattr(files, "stat_file", lambda *a: threads.append(threading.get_ident()) or real(*a))
    one = files.stat_files(paths, True, 4, lambda: None)
    monkeypatch.setattr(files, "THREADS_FROM", 3000)
    pooled = files.stat_files(paths, True, 4, lambda: None)
    assert one == pooled and one[paths[2]]["sha256"] == hashlib.sha256(b"\2" * 1002).hexdigest()  # type: ignore[index]
    assert threads[:3] == [threading.get_ident()] * 3 and threading.get_ident() not in threads[3:]


def test_files_hashes_what_an_apply_record_names(tmp_path: Path) -> None:
    """The release files' fact reads the record itself (one call with it in the batch) and hashes
    each file it names under the release; a missing or malformed record is exit status 1."""
    rel = tmp_path / "current"
    (rel / "sub").mkdir(parents=True)
    (rel / "start.sh").write_text("#!/bin/sh\n")
    (rel / "sub" / "x").write_text("x")
    rec = tmp_path / "applied.json"
    rec.write_text(json.dumps({"files": [{"path": "start.sh"}, {"path": "sub/x"}, {"path": "gone"}]}))
    req = {"record": str(rec), "under": str(rel), "hash": True, "jobs": 2}
    r = subprocess.run([sys.executable, "-I", "-S", "-c", hs.FILES, json.dumps(req)], capture_output=True, text=True)
    got = json.loads(r.stdout)
    assert list(got) == [f"{rel}/start.sh", f"{rel}/sub/x", f"{rel}/gone"]
    assert got[f"{rel}/sub/x"]["sha256"] == hashlib.sha256(b"x").hexdigest() and "error" in got[f"{rel}/gone"]
    for bad in ("not json", json.dumps({"files": "start.sh"}), json.dumps([1])):
        rec.write_text(bad)
        r = subprocess.run([sys.executable, "-I", "-S", "-c", hs.FILES, json.dumps(req)], capture_output=True,
                           text=True)
        assert r.returncode == 1 and r.stdout == "" and "no apply record" in r.stderr, bad
    assert files.recorded_paths(str(tmp_path / "none.json"), str(rel)) is None


def test_files_runs_as_the_host_runs_it_and_reports_progress(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / "d" / str(i)).mkdir(parents=True)
        (tmp_path / "d" / str(i) / "f").write_bytes(b"x" * (9 << 20 if i == 0 else 1))
    paths = [str(tmp_path / "d" / str(i) / "f") for i in range(3)]
    for arg, least in [
        (hs.dumps({"paths": paths, "hash": True}), 3 + 2),  # each file, each 8 MiB
        (hs.dumps({"roots": [str(tmp_path / "d")]}), 1 + 4),  # the root, each folder
    ]:
        r, w = os.pipe()
        try:
            env = {"PATH": os.environ["PATH"], "BUILDER_PROGRESS_FD": str(w)}
            p = subprocess.run([sys.executable, "-I", "-S", "-c", hs.FILES, arg], env=env, pass_fds=(w,),
                               capture_output=True, timeout=60, check=True)
            os.close(w)
            w = -1
            ticks = b""
            while chunk := os.read(r, 65536):
                ticks += chunk
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        assert json.loads(p.stdout) and len(ticks) >= least, (arg[:40], len(ticks))
    # run on its own (no $BUILDER_PROGRESS_FD), as a check runs it without the batch: no reports
    p = subprocess.run([sys.executable, "-I", "-S", "-c", hs.FILES, hs.dumps({"paths": paths})],
                       env={"PATH": os.environ["PATH"]}, capture_output=True, timeout=60, check=True)
    assert set(json.loads(p.stdout)) == set(paths) and p.stderr == b""


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
        w(f"{base}/gids/2", hs.roce_v2_gid(ip))
        w(f"{base}/gid_attrs/types/2", "IB/RoCE v1")
        w(f"{base}/gids/3", hs.roce_v2_gid(ip))
        w(f"{base}/gid_attrs/types/3", "RoCE v2")
        w(f"{base}/gid_attrs/ndevs/3", "enp1s0f0np0")
        w(f"{base}/gids/4", "0000:0000:0000:0000:0000:0000:0000:0000")
    w("class/net/enp1s0f0np0/mtu", "9000")
    w("class/net/lo/mtu", "65536")


def test_fabric_facts_and_gid_evaluation(tmp_path: Path) -> None:
    fake_sysfs(tmp_path)
    direct = {"rdma": fabric.rdma_devices(str(tmp_path)), "net": fabric.interfaces(str(tmp_path))}
    r = subprocess.run([sys.executable, "-I", "-S", "-c", hs.FABRIC, str(tmp_path)], capture_output=True,
                       text=True, check=True)
    facts = json.loads(r.stdout)
    assert facts["rdma"] == direct["rdma"] and set(facts["net"]) >= set(direct["net"])
    assert sorted(facts["rdma"]) == ["roceP2p1s0f0", "rocep1s0f0"]
    port = facts["rdma"]["rocep1s0f0"]["1"]
    assert port["state"] == "4: ACTIVE" and "4" not in port["gids"]  # all-zero GIDs are dropped
    assert facts["net"]["enp1s0f0np0"]["mtu"] == 9000
    assert hs.rail_gid(facts, "192.0.2.10") == ("rocep1s0f0", "1", "3")
    assert hs.rail_gid(facts, "192.0.2.10", 3) == ("rocep1s0f0", "1", "3")
    assert hs.rail_gid(facts, "192.0.2.10", 2) is None  # index 2 is the v1 entry
    assert hs.rail_gid(facts, "192.0.2.10", "auto", ["roceP2p1s0f0"]) is None
    assert hs.rail_gid(facts, "203.0.113.9") is None
    facts["net"]["enp1s0f0np0"]["ipv4"] = ["192.0.2.10"]
    assert hs.iface_of(facts, "192.0.2.10") == "enp1s0f0np0"
    assert hs.iface_of(facts, "192.0.2.11") is None


#: a host whose proxy settings name a proxy that does not answer: requests to its own 127.0.0.1 must
#: not go through it
NO_PROXY_REACHABLE = {**{k: v for k, v in os.environ.items() if k.lower() != "no_proxy"},
                      "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}


def test_serve_answers_each_call_or_says_why(tmp_path: Path) -> None:
    class API(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            code = 200 if self.path == "/health" else 404
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b"ok")

        def do_POST(self) -> None:  # noqa: N802
            n = int(self.headers["Content-Length"])
            body = json.loads(self.rfile.read(n))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"choices": [{"text": body["model"]}]}).encode())

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), API)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{srv.server_port}"
        arg = hs.dumps({"base": base, "model": "demo", "timeout": 5})
        r = subprocess.run([sys.executable, "-I", "-S", "-c", hs.SERVE, arg], capture_output=True, text=True,
                           check=True, timeout=60, env=NO_PROXY_REACHABLE)
        # lane.py's state (deploy, status) asks the same /health
        req = {"do": "state", "root": str(tmp_path), "lane": "demo", "rank": 0, "health_port": srv.server_port,
               "filters": ["--filter", "label=io.builder.lane=demo"], "label_rank": "io.builder.rank",
               "label_bundle": "io.builder.bundle-id"}
        lane_health = lane_run(req, {**NO_PROXY_REACHABLE, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})["health"]
    finally:
        srv.shutdown()
    assert lane_health == {"status": 200}
    got = json.loads(r.stdout)
    assert got["health"] == {"status": 200, "body": "ok"}
    assert got["models"]["status"] == 404 and "error" in got["models"]
    assert json.loads(got["completion"]["body"]) == {"choices": [{"text": "demo"}]}
    assert serve.call("http://127.0.0.1:9", "/health", 2)["status"] is None  # nothing listening


# ----------------------------------------------------------------------------- the batch


def test_batch_runs_shell_and_python_items(tmp_path: Path) -> None:
    a = tmp_path / "a.bin"
    a.write_bytes(b"\xff\x00binary")
    fail = "echo oops >&2; exit 7"
    items = [
        f"cat {a}",
        fail,
        ["py", "files", hs.FILES, json.dumps({"paths": [str(a)], "hash": True})],
        ["py", "raises", "raise ValueError('bad fact')", ""],
        ["py", "exits", "import sys; sys.stdout.write('x'); sys.exit(3)", ""],
        ["py", "says", "import sys; sys.stderr.write('why'); sys.exit(1)", ""],
        ["py", "broken", "def f(:", ""],
        ["py", "files again", hs.FILES, json.dumps({"paths": [str(a)], "hash": False})],
    ]
    got, _ = batch_run(items, 60)
    rc, _, err = got["broken"]
    assert rc == 1 and b"SyntaxError" in err
    assert "sha256" not in json.loads(got["files again"][1])[str(a)]
    assert got[f"cat {a}"] == (0, b"\xff\x00binary", b"")
    assert got[fail] == (7, b"", b"oops\n")
    rc, out, _ = got["files"]
    assert rc == 0 and json.loads(out)[str(a)]["sha256"] == hashlib.sha256(a.read_bytes()).hexdigest()
    rc, out, err = got["raises"]
    assert rc == 1 and out == b"" and b"ValueError: bad fact" in err
    assert got["exits"] == (3, b"x", b"")
    assert got["says"] == (1, b"", b"why")  # a fact's stderr is kept too


def test_a_fact_runs_as_python3_minus_c_in_a_session_of_its_own(tmp_path: Path) -> None:
    """A fact module runs as ``python3 -I -S -c SOURCE ARG``: argv, __name__, stdin at end of file,
    its own session, only its progress descriptor beside 0-2, and sys.exit's status."""
    probe = ("import json, os, sys\n"
             "fds = sorted(int(f) for f in os.listdir('/proc/self/fd'))\n"
             "sys.stdout.write(json.dumps({'argv': sys.argv, 'name': __name__, 'stdin': sys.stdin.read(),\n"
             "    'leader': os.getsid(0) == os.getpid(), 'progress': os.environ['BUILDER_PROGRESS_FD'],\n"
             "    'fds': fds}))\n"
             "if __name__ == '__main__':\n    sys.exit(5)\n")
    got, _ = batch_run(["echo before", ["py", "probe", probe, "the-arg"], ["py", "other", "print(1)", ""]], 10)
    rc, out, err = got["probe"]
    facts = json.loads(out)
    assert rc == 5 and err == b"", err
    assert facts["argv"] == ["-c", "the-arg"] and facts["name"] == "__main__" and facts["stdin"] == ""
    progress = int(facts["progress"])
    assert facts["leader"] and progress in facts["fds"]
    assert len([f for f in facts["fds"] if f > 2 and f != progress]) <= 1, facts["fds"]  # (the listing's own)
    assert got["other"] == (0, b"1\n", b"") and got["echo before"] == (0, b"before\n", b"")


def test_a_fact_that_blocks_times_out_and_the_others_come_back(tmp_path: Path) -> None:
    """A read that never returns (a FIFO nobody writes, as a file on a stale NFS mount): its fact
    answers 124 "timed out after 1 s" within the bound, killed with its process group, while a
    files fact and a shell command of the same batch succeed."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights" * 1000)
    # the marker names its processes for pgrep (a duration no other test uses); the fact starts a
    # child of its own, which must go too
    stuck = ("import subprocess, sys  # builder-test-stuck-fact-4711\n"
             "subprocess.Popen(['sleep', '4711'])\n"
             f"open({str(fifo)!r}, 'rb').read()\n")
    items: list[object] = [
        ["py", "stuck", stuck, ""],
        ["py", "files", hs.FILES, json.dumps({"paths": [str(model)], "hash": True})],
        "echo fine",
    ]
    got, took = batch_run(items, 1)
    rc, out, err = got["stuck"]
    assert rc == 124 and out == b"" and err.endswith(b"builder: timed out after 1 s\n"), got["stuck"]
    rc, out, _ = got["files"]
    assert rc == 0 and json.loads(out)[str(model)]["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert got["echo fine"] == (0, b"fine\n", b"")
    assert took < 6, f"the batch took {took:.1f} s with a 1 s bound"
    assert gone("builder-test-stuck-fact-4711") and gone("^sleep 4711$"), "the stuck fact's processes live on"


def test_progress_restarts_a_facts_bound() -> None:
    """A fact that reports progress (a byte to $BUILDER_PROGRESS_FD, as files.py does per file and
    per 8 MiB hashed) runs past the bound for as long as it keeps reporting; the same work without
    reports is killed at the bound."""
    work = ("import os, time\nfd = int(os.environ['BUILDER_PROGRESS_FD'])\n"
            "for _ in range(12):\n    time.sleep(0.25)\n    {}\nprint('done')\n")
    got, _ = batch_run([["py", "ticks", work.format("os.write(fd, b'.')"), ""],
                        ["py", "silent", work.format("pass"), ""]], 1)
    assert got["ticks"] == (0, b"done\n", b""), got["ticks"]
    assert got["silent"][0] == 124 and got["silent"][2].endswith(b"builder: timed out after 1 s\n")


def test_batch_bounds_each_shell_command_and_kills_its_group() -> None:
    # a child of the command's shell must go too; 317 s: a duration no other test's process has
    hung = "sleep 317 & sleep 317; wait"
    got, _ = batch_run([hung, "echo fine", ["py", "fact", "import sys; sys.stdout.write('ok')", ""]], 1)
    rc, _, err = got[hung]
    assert rc == 124 and err.endswith(b"builder: timed out after 1 s\n")
    assert got["echo fine"] == (0, b"fine\n", b"") and got["fact"] == (0, b"ok", b"")
    assert gone("^sleep 317$"), "the hung command's processes live on"


def test_parse_batch_refuses_what_the_batch_does_not_print() -> None:
    for text in ("[]", '{"c": [0, "", ""', '{"c": ["0", "", ""]}', '{"c": [0, ""]}'):
        with pytest.raises(ValueError):
            hs.parse_batch(text)


def test_split_args_stays_under_the_argument_limit() -> None:
    items: list[object] = [f"cat /srv/f{i:04d}" for i in range(400)] + [["py", "big", "x" * 200, "y"]]
    groups = hs.split_args(items, max_chars=2_000)
    assert len(groups) > 1
    assert [i for g in groups for i in g] == items
    assert all(len(json.dumps(g)) <= 2_000 for g in groups)


def test_split_args_refuses_an_item_too_long_for_any_call() -> None:
    huge = "/srv/models/m/" + "z" * 5_000
    with pytest.raises(ValueError) as e:
        hs.split_args(["a", huge, "b"], max_chars=2_000)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith('"/srv/models/m/zz') and "too long for one remote command line" in msg
    assert not hs.fits(huge, max_chars=2_000) and hs.fits("a", max_chars=2_000)


# ----------------------------------------------------------------------------- the readers


def test_roce_v2_gid() -> None:
    assert hs.roce_v2_gid("192.0.2.1") == "0000:0000:0000:0000:0000:ffff:c000:0201"
    assert hs.roce_v2_gid("10.0.0.255") == "0000:0000:0000:0000:0000:ffff:0a00:00ff"


def test_meminfo() -> None:
    m = hs.parse_meminfo("MemTotal:       131072000 kB\nMemAvailable:   120000000 kB\nHugePages_Total: 0\n")
    assert m == {"MemTotal": 131072000, "MemAvailable": 120000000, "HugePages_Total": 0}
    assert round(hs.gib(m["MemAvailable"]), 2) == 114.44


def test_split_args_keeps_every_path_once() -> None:
    paths = [f"/srv/models/m/{i:05d}-" + "x" * 50 for i in range(3000)]
    chunks = hs.split_args(paths, max_chars=10_000)
    assert len(chunks) > 1 and [p for c in chunks for p in c] == paths
    assert all(len(json.dumps(c)) <= 10_000 for c in chunks)


# ----------------------------------------------------------------------------- the lane (deploy, status)


def lane_run(req: dict[str, object], env: dict[str, str]) -> dict[str, object]:
    """lane.py as `builder deploy` runs it: its source on stdin (`python3 - REQUEST`)."""
    r = subprocess.run([sys.executable, "-", json.dumps(req)], input=hs.source("lane"), capture_output=True,
                       text=True, check=True, timeout=60, env=env)
    got = json.loads(r.stdout)
    assert isinstance(got, dict)
    return got


def test_lane_state_reads_links_releases_and_the_apply_record(tmp_path: Path) -> None:
    new, old = "a" * 64, "b" * 64
    for bid in (new, old):
        (tmp_path / "releases" / bid).mkdir(parents=True)
    (tmp_path / "releases" / "not-a-release").mkdir()
    os.symlink(f"releases/{new}", tmp_path / "current")
    os.symlink(f"releases/{old}", tmp_path / "previous")
    os.symlink("releases/not-a-release", tmp_path / "staged")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "applied.json").write_text(json.dumps(
        {"bundle_id": new, "lock_hash": "c" * 64, "image": {"image_id": "sha256:" + "d" * 64, "name": "i"}}))
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    req = {"do": "state", "root": str(tmp_path), "lane": "demo", "rank": 0, "health_port": None,
           "filters": ["--filter", "label=io.builder.lane=demo"], "label_rank": "io.builder.rank",
           "label_bundle": "io.builder.bundle-id"}
    got = lane_run(req, env)
    assert (got["current"], got["previous"], got["staged"]) == (new, old, None)
    assert got["releases"] == [new, old]
    applied = got["applied"]
    assert isinstance(applied, dict) and applied["bundle_id"] == new and applied["image"] == "i"
    assert got["containers"] == [] and str(got["docker"]).startswith("docker: ") and got["health"] is None


@pytest.mark.docker
def test_lane_wait_says_a_container_the_engine_does_not_have_is_gone() -> None:
    """This machine's real docker CLI and engine: a name that is no container is "missing" (the rank's
    container is gone), not "unknown" (no answer from the engine)."""
    if not fleetlib.docker_available():
        pytest.skip("no Docker engine here")
    name = f"builder-test-no-such-{os.getpid()}"
    req: dict[str, object] = {"do": "wait", "container": name, "ready": {"kind": "port", "port": 1},
                              "timeout": 30}
    got = lane_run(req, dict(os.environ))
    assert got["ok"] is False and got["why"] == f"container {name} is gone", got


def test_lane_wait_is_bounded_when_the_engine_does_not_answer(tmp_path: Path) -> None:
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    req = {"do": "wait", "container": "c", "ready": {"kind": "port", "port": 1}, "timeout": 0.5}
    got = lane_run(req, env)
    assert got["ok"] is False and "port 1 did not answer within 0.5 s (container unknown)" in str(got["why"])


def test_secret_values_in_log_lines_are_masked() -> None:
    assert lane.redact("vllm serve m --api-key sk-1 --port 8000 | HF_TOKEN=hf_2 | --hf-token=t3") == (
        "vllm serve m --api-key *** --port 8000 | HF_TOKEN=*** | --hf-token=***")
    assert lane.redact("""non-default args: {'api_key': 'sk-4', "password": "p5", 'model': 'm'} | secret: s6""") == (
        """non-default args: {'api_key': '***', "password": "***", 'model': 'm'} | secret: ***""")
    kept = "--tokenizer /model --max-num-batched-tokens 8192 | KeyError: 'x' | the key is wrong"
    assert lane.redact(kept) == kept  # (only a secret's name as a word of its own, and its value)


@pytest.mark.parametrize(("ready", "said"), [
    ({"kind": "port", "port": 1}, "runs but is not ready (port 1 did not answer within 0.5 s)"),
    ({"kind": "port", "port": 1, "peer": True},
     "runs but is not ready (port 1 did not answer within 0.5 s): waiting for a peer"),
])
def test_a_rank_that_runs_but_is_not_ready_is_waiting_for_a_peer_only_where_its_rule_needs_one(
        monkeypatch: pytest.MonkeyPatch, ready: dict[str, object], said: str) -> None:
    monkeypatch.setattr(lane, "container_state", lambda name: ("running", None))
    monkeypatch.setattr(lane, "answers", lambda ports, addrs: False)
    monkeypatch.setattr(lane, "logs", lambda name: "")
    out = lane.wait({"container": "c", "ready": ready, "timeout": 0.5})
    assert out["ok"] is False and out["state"] == "running" and out["why"] == f"container c {said}"


class _Clock:
    """lane's time: monotonic reads it, sleep moves it (a wait of minutes runs at once)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def test_a_rank_that_loads_for_minutes_is_asked_ever_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that loads for 5 minutes: its state is asked about every 2 s once it has run a while
    (not three times a second), a quick rank is seen within 0.3 s, and the bound still holds."""
    clock, asked = _Clock(), []
    monkeypatch.setattr(lane, "time", clock)
    monkeypatch.setattr(lane, "logs", lambda name: "")

    def state(name: str) -> tuple[str, None]:
        asked.append(clock.now)
        return "running", None

    monkeypatch.setattr(lane, "container_state", state)
    monkeypatch.setattr(lane, "answers", lambda ports, addrs: clock.now >= 1300.0)
    out = lane.wait({"container": "c", "ready": {"kind": "port", "port": 1}, "timeout": 900})
    assert out["ok"] is True and 1300.0 <= clock.now <= 1300.0 + lane.LAST_POLL
    gaps = [b - a for a, b in itertools.pairwise(asked)]
    assert gaps[0] == pytest.approx(lane.FIRST_POLL) and max(gaps) == pytest.approx(lane.LAST_POLL)
    assert len(asked) < 300 / lane.LAST_POLL + 10  # (every 0.3 s: 1000 asks)

    clock.now, asked[:] = 1000.0, []
    monkeypatch.setattr(lane, "answers", lambda ports, addrs: False)
    out = lane.wait({"container": "c", "ready": {"kind": "port", "port": 1}, "timeout": 60})
    assert out["ok"] is False and "did not answer within 60 s" in out["why"] and clock.now == pytest.approx(1060.0)


def test_a_rank_ready_when_running_is_ready_the_moment_it_has_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(lane, "time", clock)
    monkeypatch.setattr(lane, "container_state", lambda name: ("running", None))
    out = lane.wait({"container": "c", "ready": {"kind": "running"}, "timeout": 60})
    assert out["ok"] is True and out["seconds"] == pytest.approx(lane.SETTLE_SECONDS)


# ----------------------------------------------------------------------------- watchdog (every remote step)


def _tied(step: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", hs.tied(step)], capture_output=True, text=True, timeout=60)


def test_a_tied_step_passes_its_output_and_status_through_and_a_signal_as_128_plus_n() -> None:
    r = _tied("echo out; echo err >&2; exit 3")
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert _tied("kill -TERM $$").returncode == 128 + 15
    assert _tied("kill -KILL $$").returncode == 128 + 9


def test_a_tied_step_runs_in_a_session_of_its_own_with_the_signals_python_ignores_restored() -> None:
    # (Python ignores SIGPIPE and SIGXFSZ; a step that inherited that would not die of a closed pipe)
    r = _tied("grep '^SigIgn' /proc/self/status")
    ignored = int(next(ln for ln in r.stdout.splitlines() if ln.startswith("SigIgn")).split()[1], 16)
    assert r.returncode == 0, r.stderr
    assert not ignored & (1 << (13 - 1)), f"SIGPIPE ignored in the step: {ignored:#x}"
    assert not ignored & (1 << (25 - 1)), f"SIGXFSZ ignored in the step: {ignored:#x}"
    sid = _tied("cut -d' ' -f6 /proc/$$/stat; echo $$").stdout.split()
    assert sid[0] == sid[1], f"the step's shell leads a session of its own: sid {sid[0]}, pid {sid[1]}"


def test_the_watchdog_starts_without_subprocess_or_site() -> None:
    tree = ast.parse(hs.WATCHDOG)
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [ast.alias(n.module or "")])}
    assert imported <= {"__future__", "os", "select", "signal", "sys", "time", "typing", "ctypes"}, imported
    assert hs.tied("true").startswith("exec python3 -I -S -c ")
