"""End to end: `builder audit` over real ssh on the test fleet (containers with sshd and their own dockerd).

Each host is set up as an install would leave it (the installer's layout, written directly here
through `docker exec`): the image loaded in the host's own dockerd under its record tag, the model
files, the rank's Engram files, a release folder with `current` pointing at it, and the apply
record. Then one thing changes at a time and the audit must name exactly that drift on that host.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import auditlib  # noqa: E402
import fleetlib  # noqa: E402

pytestmark = [pytest.mark.fleet, pytest.mark.docker]
ROOT = Path(__file__).resolve().parent.parent

# FAKE installer (test only): writes files, links `current`, stats the models, writes the apply record.
FAKE_INSTALL = r"""
import base64, hashlib, json, os, sys
spec = json.load(sys.stdin)
for path, b64 in spec["files"].items():
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(base64.b64decode(b64))
bundles = spec["bundles"]
rel = os.path.join(bundles, "releases", spec["bundle_id"])
cur = os.path.join(bundles, "current")
if os.path.lexists(cur):
    os.unlink(cur)
os.symlink(rel, cur)
def h(p):
    return hashlib.sha256(open(p, "rb").read()).hexdigest()
rec = dict(spec["record"])
rec["files"] = [{"path": n, "size": os.path.getsize(os.path.join(rel, n)), "sha256": h(os.path.join(rel, n))}
                for n in sorted(os.listdir(rel))]
rec["manifest_sha256"] = h(os.path.join(rel, "manifest.json"))
rec["models"] = []
for p in spec["models"]:
    st = os.stat(p)
    rec["models"].append({"path": p, "size": st.st_size, "sha256": h(p), "mtime": st.st_mtime_ns,
                          "inode": st.st_ino})
os.makedirs(os.path.join(bundles, "state"), exist_ok=True)
with open(os.path.join(bundles, "state", "applied.json"), "w") as f:
    json.dump(rec, f, indent=1)
os.system("chmod -R a+rX /srv /var/lib/builder")
"""


@pytest.fixture(scope="module")
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    fleet = fleetlib.fleet_fixture(request, 2, skip_if_unavailable=True)
    proj = tmp_path_factory.mktemp("proj")
    paths = auditlib.make_project(proj, tp=2)
    addr = auditlib.plan_address(paths)
    from builder.imagerecord import ImageRecord, tag_for, write_record

    tag = tag_for("demo", addr)
    labels = {"org.builder.lane": "demo", "org.builder.input-address": addr}
    image_id = fleetlib.tiny_image("builder-test-audit:good", files={"/etc/demo": b"good\n"}, labels=labels)
    fleetlib.docker("tag", image_id, tag)
    fleetlib.tiny_image("builder-test-audit:other", files={"/etc/demo": b"other\n"}, labels=labels)
    layers = json.loads(fleetlib.docker("image", "inspect", "-f", "{{json .RootFS.Layers}}", image_id).stdout)
    write_record(
        paths["store"],
        ImageRecord(
            name="demo",
            input_address=addr,
            image_id=image_id,
            diff_ids=layers,
            tag=tag,
            lock_hash="0" * 64,
            platform="linux/arm64",
            source_date_epoch=0,
            labels=labels,
        ),
    )
    work = tmp_path_factory.mktemp("imgs")
    good_tar = fleetlib.save_image(tag, work / "good.tar")
    other_tar = fleetlib.save_image("builder-test-audit:other", work / "other.tar")
    from builder.lock import load_lock

    lock_hash = load_lock(paths["lock"]).lock_hash()
    fake = auditlib.fake_nvidia_smi()
    hosts = []
    for rank, h in enumerate(fleet.hosts):
        fleet.docker_load(h, good_tar)
        fleet.exec(
            h,
            [
                "sh",
                "-c",
                "mkdir -p /etc/fake-nvidia-smi && cat > /usr/local/bin/nvidia-smi && "
                "chmod 755 /usr/local/bin/nvidia-smi",
            ],
            input=fake,
        )
        install(fleet, h, rank, paths, addr, image_id, layers, lock_hash)
        hosts.append({"name": h.name, "ssh": h.name, "rank": rank, "role": "head" if rank == 0 else "worker"})
    expect = (
        'gpu_name = "NVIDIA H200"\ngpu_count = 1\ncompute_cap = "9.0"\ndriver_version = "580.159.04"\n'
        'cuda_version = "13.0"\ngpu_clock_mhz = 1980\nmin_free_memory_gib = 0.05\nmax_swap_used_gib = 1024\n'
        "min_free_disk_gib = 0.01\nnvidia_runtime = false\n"
    )
    (paths["hosts"] / "test.toml").write_text(
        auditlib.fleet_toml("test", hosts, ssh_config=str(fleet.plain_ssh_config), expect=expect)
    )
    return {
        "fleet": fleet,
        "paths": paths,
        "tag": tag,
        "image_id": image_id,
        "other_tar": other_tar,
        "good_tar": good_tar,
        "addr": addr,
        "layers": layers,
        "lock_hash": lock_hash,
    }


def install(
    fleet: Any,
    h: Any,
    rank: int,
    paths: dict[str, Path],
    addr: str,
    image_id: str,
    layers: list[str],
    lock_hash: str,
) -> None:
    files: dict[str, bytes] = {}
    for rel, data in auditlib.MODEL_FILES.items():
        files[f"/srv/models/tiny/{rel}"] = data
    engram = [f"/srv/engram/engram-r{rank}of2-a.bin", f"/srv/engram/engram-r{rank}of2-b.bin"]
    for i, p in enumerate(engram):
        files[p] = bytes([rank + i]) * (1000 + i)
    bid = f"b{rank}"
    relroot = f"/var/lib/builder/releases/{bid}"
    files[f"{relroot}/manifest.json"] = json.dumps({"bundle_id": bid, "host": h.name}).encode()
    files[f"{relroot}/start.sh"] = b"#!/bin/sh\necho start\n"
    files[f"{relroot}/stop.sh"] = b"#!/bin/sh\necho stop\n"
    files[f"{relroot}/rank.env"] = f"RANK={rank}\nWORLD_SIZE=2\n".encode()
    files[f"{relroot}/config.json"] = b"{}\n"
    record = {
        "format": 1,
        "bundle_id": bid,
        "host": h.name,
        "fleet": "test",
        "lane": "demo",
        "rank": rank,
        "lock_hash": lock_hash,
        "image": {"input_address": addr, "image_id": image_id, "diff_ids": layers},
        "applied_at": "2026-01-01T00:00:00Z",
        "previous_bundle_id": None,
    }
    spec = {
        "files": {p: base64.b64encode(b).decode() for p, b in files.items()},
        "bundles": "/var/lib/builder",
        "bundle_id": bid,
        "record": record,
        "models": sorted([p for p in files if p.startswith("/srv/models/")] + engram),
    }
    fleet.exec(h, ["python3", "-c", FAKE_INSTALL], input=json.dumps(spec))


def audit(env: dict[str, Any], *args: str, path_prefix: str | None = None) -> tuple[int, dict[str, Any], str]:
    p = env["paths"]
    argv = [
        sys.executable,
        "-m",
        "builder",
        "--pins",
        str(p["pins"]),
        "--store",
        str(p["store"]),
        "audit",
        "--json",
        "--connect-timeout",
        "3",
        "--checks",
        str(ROOT / "checks"),
        *args,
    ]
    e = dict(os.environ, PYTHONPATH=str(ROOT))
    if path_prefix:
        e["PATH"] = path_prefix + os.pathsep + e["PATH"]
    r = subprocess.run(argv, capture_output=True, text=True, env=e, timeout=600)
    data = json.loads(r.stdout) if r.stdout.strip() else {}
    return r.returncode, data, r.stderr


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
        rc, data, err = audit(env, "--fleet", "test", "--mode", mode)
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
        assert "infiniband" in checks["fabric::dev_infiniband"]["message"]
    assert "spark-test-2" in err and "pass" in err  # the matrix on stderr


# A logging `ssh` put first on PATH for one audit: it records each call's arguments, then runs the
# real ssh. Both the audit (probe, close) and testinfra (every remote command) find ssh on PATH.
SSH_LOGGER = """#!{python}
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
os.execv({ssh!r}, ["ssh"] + sys.argv[1:])
"""


def test_one_connection_and_three_remote_commands_per_host(env: dict[str, Any], tmp_path: Path) -> None:
    import shutil

    fleet = env["fleet"]

    def accepted(h: Any) -> int:  # connections the host's sshd accepted so far
        r = fleet.exec(h, ["grep", "-c", "Accepted publickey", "/var/log/sshd.log"], check=False)
        return int(r.stdout.strip() or 0)

    bindir, log = tmp_path / "bin", tmp_path / "ssh.log"
    bindir.mkdir()
    real = shutil.which("ssh")
    assert real is not None
    (bindir / "ssh").write_text(SSH_LOGGER.format(python=sys.executable, log=str(log), ssh=real))
    (bindir / "ssh").chmod(0o755)
    before = {h.name: accepted(h) for h in fleet.hosts}
    rc, data, err = audit(env, "--fleet", "test", "--ssh-persist", "0", path_prefix=str(bindir))
    assert rc == 0, err
    assert {h.name: accepted(h) - before[h.name] for h in fleet.hosts} == {"spark-test-1": 1, "spark-test-2": 1}
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    for h in fleet.hosts:
        mine = [c for c in calls if h.name in c]
        assert sum("-N" in c for c in mine) == 1 and sum("-O" in c for c in mine) == 1  # open, close
        remote = [c[-1] for c in mine if "-N" not in c and "-O" not in c]
        # the prefetch batch, then what only the apply record names: the launch files' hashes and
        # the recorded Engram files' stat
        assert len(remote) == 3, remote
        assert remote[0].startswith("python3 -I -S -c ") and "b2a_base64" in remote[0]
        assert all(r.startswith("python3 -c ") for r in remote[1:])
        # every call names the audit's connection for this host (the fleet's ssh_config names none)
        paths = {a for c in mine for a in c if a.startswith("ControlPath=")}
        assert len(paths) == 1 and paths.pop().startswith(f"ControlPath={os.environ['BUILDER_SSH_DIR']}/")
    # --ssh-persist 0: every connection closed (what is left are the hosts' lock files)
    assert not [s for s in Path(os.environ["BUILDER_SSH_DIR"]).iterdir() if s.is_socket()]


def test_the_next_audit_reuses_each_hosts_connection(env: dict[str, Any], tmp_path: Path) -> None:
    fleet = env["fleet"]
    folder = Path(os.environ["BUILDER_SSH_DIR"])

    def accepted(h: Any) -> int:
        r = fleet.exec(h, ["grep", "-c", "Accepted publickey", "/var/log/sshd.log"], check=False)
        return int(r.stdout.strip() or 0)

    rc, first, err = audit(env, "--fleet", "test")
    assert rc == 0, err
    socks = sorted(s for s in folder.iterdir() if s.is_socket())
    assert len(socks) == 2  # kept open for the next audit
    assert all(s.stat().st_mode & 0o077 == 0 for s in [folder, *socks])
    before = {h.name: accepted(h) for h in fleet.hosts}
    rc, second, err = audit(env, "--fleet", "test")
    assert rc == 0, err
    assert {h.name: accepted(h) - before[h.name] for h in fleet.hosts} == {"spark-test-1": 0, "spark-test-2": 0}
    assert sorted(s for s in folder.iterdir() if s.is_socket()) == socks
    strip = {n: {c: (v["status"], v["message"]) for c, v in h["checks"].items()} for n, h in first["hosts"].items()}
    assert strip == {n: {c: (v["status"], v["message"]) for c, v in h["checks"].items()}
                     for n, h in second["hosts"].items()}


def test_two_audits_at_once_open_one_connection_per_host(env: dict[str, Any]) -> None:
    """Both find no connection and open one at the same moment: the per-host lock lets one open it
    and the other reuse it, instead of leaving a second connection behind in the background."""
    import threading

    folder = Path(os.environ["BUILDER_SSH_DIR"])
    codes: list[int] = []

    def one() -> None:
        codes.append(audit(env, "--fleet", "test")[0])

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
    rc, _, err = audit(env, "--fleet", "test")
    assert rc == 0, err
    fleet.pause(h2)
    try:
        rc, data, err = audit(env, "--fleet", "test", "--connect-timeout", "2")
    finally:
        fleet.unpause(h2)
    assert rc == 3, err
    assert statuses(data) == {"spark-test-1": "pass", "spark-test-2": "unreachable"}
    rc, data, err = audit(env, "--fleet", "test")
    assert rc == 0, err


def test_corrupt_model_byte_full_mode_names_file(env: dict[str, Any]) -> None:
    fleet = env["fleet"]
    h = fleet.hosts[1]
    path = "/srv/models/tiny/model-00001-of-00002.safetensors"
    # flip one byte, keep size and mtime (what a fast audit cannot see)
    flip = (
        "import os,sys; p=sys.argv[1]; st=os.stat(p); f=open(p,'r+b'); f.seek(100); b=f.read(1); "
        "f.seek(100); "
        "f.write(bytes([b[0]^255])); f.close(); os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))"
    )
    fleet.exec(h, ["python3", "-c", flip, path])
    try:
        rc, data, err = audit(env, "--fleet", "test", "--mode", "full")
        assert failing(data) == {("spark-test-2", "models::content")}, err
        assert rc == 1
        msg = data["hosts"]["spark-test-2"]["checks"]["models::content"]["message"]
        assert path in msg and "expected sha256" in msg and "found" in msg
        assert statuses(data)["spark-test-1"] == "pass"
    finally:
        fleet.exec(h, ["python3", "-c", flip, path])
    rc, data, err = audit(env, "--fleet", "test", "--mode", "full", "--only", "models")
    assert rc == 0, err


def test_removed_engram_file(env: dict[str, Any]) -> None:
    fleet = env["fleet"]
    h = fleet.hosts[0]
    path = "/srv/engram/engram-r0of2-b.bin"
    saved = fleet.exec(h, ["base64", path]).stdout
    fleet.exec(h, ["rm", path])
    try:
        rc, data, err = audit(env, "--fleet", "test")
        assert failing(data) == {("spark-test-1", "engram::recorded_files_present")}, err
        assert rc == 1
        assert path in data["hosts"]["spark-test-1"]["checks"]["engram::recorded_files_present"]["message"]
        # another rank's file appearing on a host is drift too
        fleet.exec(h, "cp /srv/engram/engram-r0of2-a.bin /srv/engram/engram-r1of2-a.bin")
        rc, data, err = audit(env, "--fleet", "test", "--only", "engram")
        assert failing(data) == {
            ("spark-test-1", "engram::recorded_files_present"),
            ("spark-test-1", "engram::no_other_rank_files"),
        }, err
    finally:
        fleet.exec(h, f"rm -f /srv/engram/engram-r1of2-a.bin; base64 -d > {path}", input=saved)
    rc, data, err = audit(env, "--fleet", "test", "--only", "engram")
    assert rc == 0, err


def test_other_image_then_removed_image(env: dict[str, Any]) -> None:
    fleet = env["fleet"]
    h2, h1 = fleet.hosts[1], fleet.hosts[0]
    tag, image_id = env["tag"], env["image_id"]
    fleet.docker_load(h2, env["other_tar"])
    other = fleetlib.docker("image", "inspect", "-f", "{{.Id}}", "builder-test-audit:other").stdout.strip()
    fleet.exec(h2, ["docker", "tag", other, tag])  # the lane's tag now names another image
    fleet.exec(h1, ["docker", "rmi", "-f", tag])  # and host 1 loses the image altogether
    try:
        rc, data, err = audit(env, "--fleet", "test", "--only", "image,release")
        assert failing(data) == {
            ("spark-test-2", "image::tag_points_at_image"),
            ("spark-test-1", "image::present_by_id"),
            ("spark-test-1", "image::tag_points_at_image"),
        }, err
        assert rc == 1
        msg = data["hosts"]["spark-test-2"]["checks"]["image::tag_points_at_image"]["message"]
        assert image_id in msg and other in msg
    finally:
        fleet.docker_load(h1, env["good_tar"])
        fleet.exec(h2, ["docker", "tag", image_id, tag])
    rc, data, err = audit(env, "--fleet", "test", "--only", "image")
    assert rc == 0, err


def test_gpu_drift_from_fake_nvidia_smi(env: dict[str, Any]) -> None:
    fleet = env["fleet"]
    h = fleet.hosts[0]
    fleet.exec(h, "echo '4242, python3, 1024' > /etc/fake-nvidia-smi/apps")
    try:
        rc, data, err = audit(env, "--fleet", "test", "--only", "gpu")
        assert failing(data) == {("spark-test-1", "gpu::no_other_compute_process")}, err
        assert "4242" in data["hosts"]["spark-test-1"]["checks"]["gpu::no_other_compute_process"]["message"]
    finally:
        fleet.exec(h, "rm -f /etc/fake-nvidia-smi/apps")


def test_stopped_sshd_is_one_unreachable_result(env: dict[str, Any]) -> None:
    fleet = env["fleet"]
    h = fleet.hosts[1]
    fleet.stop_sshd(h)
    try:
        rc, data, err = audit(env, "--fleet", "test")
        assert rc == 3, err
        assert statuses(data) == {"spark-test-1": "pass", "spark-test-2": "unreachable"}
        assert data["hosts"]["spark-test-2"]["checks"] == {}
        assert failing(data) == set()
    finally:
        fleet.start_sshd(h)


def test_cut_host_is_unreachable_rest_audited(env: dict[str, Any], tmp_path: Path) -> None:
    fleet = env["fleet"]
    h = fleet.hosts[0]
    fleet.cut(h)
    try:
        junit = tmp_path / "audit.xml"
        rc, data, err = audit(env, "--fleet", "test", "--junit", str(junit))
        assert rc == 3, err
        assert statuses(data) == {"spark-test-1": "unreachable", "spark-test-2": "pass"}
        assert data["hosts"]["spark-test-1"]["message"]
        xml = junit.read_text()
        assert 'name="spark-test-1"' in xml and "unreachable" in xml
    finally:
        fleet.restore(h)


def test_serving_phase(env: dict[str, Any]) -> None:
    fleet = env["fleet"]
    h = fleet.hosts[0]
    rc, data, err = audit(env, "--fleet", "test", "--phase", "serving")
    assert rc == 1, err
    assert failing(data) == {
        ("spark-test-1", "serving::health"),
        ("spark-test-1", "serving::models_lists_served_name"),
        ("spark-test-1", "serving::one_token_completion"),
    }
    assert data["hosts"]["spark-test-2"]["checks"]["serving::health"]["status"] == "skip"
    fleet.exec(h, ["sh", "-c", "cat > /tmp/fakeapi.py"], input=FAKE_API)
    fleetlib.docker("exec", "-d", h.container, "python3", "/tmp/fakeapi.py", "18091")
    try:
        fleet.exec(
            h,
            'for i in $(seq 50); do python3 -c "import urllib.request as u; '
            "u.urlopen('http://127.0.0.1:18091/health')\" 2>/dev/null && exit 0; sleep 0.1; done; exit 1",
        )
        rc, data, err = audit(env, "--fleet", "test", "--phase", "serving")
        assert rc == 0, err
        rc, data, err = audit(env, "--fleet", "test", "--only", "runtime")
        assert failing(data) == {("spark-test-1", "runtime::api_port_free")}, err
    finally:
        fleet.exec(h, "kill $(cat /tmp/fakeapi.pid)", check=False)


# FAKE OpenAI-style API (test only): /health, /v1/models, /v1/completions with one token.
FAKE_API = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def _send(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
    def do_GET(self):
        if self.path == "/health": self._send({"status": "ok"})
        elif self.path == "/v1/models": self._send({"data": [{"id": "demo-model"}]})
        else: self.send_error(404)
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send({"choices": [{"text": "OK", "index": 0}]})
    def log_message(self, *a): pass
open("/tmp/fakeapi.pid", "w").write(str(os.getpid()))
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_ansible_backend(env: dict[str, Any], tmp_path: Path) -> None:
    import shutil

    if shutil.which("ansible-inventory") is None:
        pytest.skip("ansible-core is not installed (pip install ansible-core)")
    p = env["paths"]
    inv = tmp_path / "inventory.yml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "builder",
            "--pins",
            str(p["pins"]),
            "hosts",
            "--fleet",
            "test",
            "--ansible",
            str(inv),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == 0, r.stderr
    listed = json.loads(
        subprocess.run(
            ["ansible-inventory", "-i", str(inv), "--list"], capture_output=True, text=True, check=True
        ).stdout
    )
    hv = listed["_meta"]["hostvars"]
    assert hv["spark-test-2"]["rank"] == 1 and hv["spark-test-2"]["role"] == "worker"
    rc, data, err = audit(env, "--fleet", "test", "--backend", "ansible", "--inventory", str(inv))
    assert rc == 0, err
    assert data["hosts"]["spark-test-2"]["checks"]["engram::own_rank_files"]["status"] == "pass"
    # drift is seen through the Ansible backend too
    fleet = env["fleet"]
    fleet.exec(fleet.hosts[1], "echo '77, engine, 1' > /etc/fake-nvidia-smi/apps")
    try:
        rc, data, err = audit(
            env, "--fleet", "test", "--backend", "ansible", "--inventory", str(inv), "--only", "gpu"
        )
        assert failing(data) == {("spark-test-2", "gpu::no_other_compute_process")}, err
    finally:
        fleet.exec(fleet.hosts[1], "rm -f /etc/fake-nvidia-smi/apps")
