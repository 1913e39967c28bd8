"""The simulator engine (engine-src/sim-engine): its bundle, and each personality run as processes on
loopback: the refusals, the rendezvous direction, the Python engine's start order, vLLM's headless
nodes, the rank cache's determinism and pack_engram.py --check.

The ``build`` tests compile the simulator once per session with the pinned Zig (the ziglang wheel)
into a temporary folder. Every wait is bounded, every port is ephemeral, every process started is
killed at the end of its test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import ziglang

from builder import hostscripts as hs
from builder.foundation import dockerbuild, dockerio
from builder.inputs.pins import load_pins
from tests.lib import clirun, dockerlib

ROOT = Path(__file__).resolve().parent.parent
PLAIN = ROOT / "engine-src" / "sim-engine"
BUNDLE = ROOT / "engine-src" / "sim-engine.bundle"
MAKE_BUNDLE = ROOT / "engine-src" / "make-sim-bundle.sh"

GIT_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
}
COMMIT0 = "0" * 40
#: a clean environment for the engines: nothing of the test runner's leaks in
BASE_ENV = {"PATH": "/usr/bin:/bin"}


def git(*args: str, cwd: Path | None = None) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, env=GIT_ENV, check=True, capture_output=True, text=True
    ).stdout.strip()


def zig_dir() -> Path:
    return Path(ziglang.__file__).resolve().parent


# --------------------------------------------------------------------------- the bundle


def test_bundle_is_a_tagged_git_repository(tmp_path: Path) -> None:
    git("bundle", "verify", str(BUNDLE))
    heads = dict(reversed(line.split()) for line in git("bundle", "list-heads", str(BUNDLE)).splitlines())
    assert set(heads) == {"HEAD", "refs/heads/main", "refs/tags/v0.1.0"}
    assert heads["HEAD"] == heads["refs/heads/main"]
    tree = tmp_path / "src"
    git("clone", "-q", "--branch", "main", str(BUNDLE), str(tree))
    assert git("log", "-1", "--format=%cI", cwd=tree) == "2025-02-01T00:00:00Z"
    shutil.rmtree(tree / ".git")
    # The clone is exactly the plain source folder that make-sim-bundle.sh commits.
    plain = sorted(
        p.relative_to(PLAIN).as_posix()
        for p in PLAIN.rglob("*")
        if p.is_file() and not p.relative_to(PLAIN).as_posix().startswith(("zig-out/", ".zig-cache/"))
    )
    cloned = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    assert cloned == plain
    for rel in cloned:
        assert (tree / rel).read_bytes() == (PLAIN / rel).read_bytes(), rel
    assert "SIMULATOR" in (tree / "README.md").read_text()


def test_make_sim_bundle_is_reproducible_and_up_to_date() -> None:
    out = subprocess.run(["bash", str(MAKE_BUNDLE), "--check"], capture_output=True, text=True, env=GIT_ENV)
    assert out.returncode == 0, out.stderr
    assert "up to date" in out.stdout


# --------------------------------------------------------------------------- the binary


@pytest.fixture(scope="session")
def sim_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sim-engine compiled from the plain source folder (what the image's build-sim.zig runs)."""
    base = tmp_path_factory.mktemp("sim-engine")
    src = base / "src"
    shutil.copytree(PLAIN, src, ignore=shutil.ignore_patterns("zig-out", ".zig-cache"))
    (src / "build_options.zig").write_text(
        f'pub const commit: []const u8 = "{COMMIT0}";\npub const version: []const u8 = "0.1.0";\n'
    )
    exe = base / "sim-engine"
    env = {**os.environ, "ZIG_GLOBAL_CACHE_DIR": str(base / "global")}
    out = subprocess.run(
        [
            str(zig_dir() / "zig"), "build-exe", "-OReleaseSmall", "-target", "x86_64-linux-musl", "-fstrip",
            "-static", "--cache-dir", str(base / "local"), f"-femit-bin={exe}",
            "--dep", "build_options", "-Mroot=src/main.zig", "-Mbuild_options=build_options.zig",
        ],
        cwd=src, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return exe


class Procs:
    """Processes of one test: stderr to a file each, all killed at the end."""

    def __init__(self, exe: Path, logs: Path) -> None:
        self.exe, self.logs = exe, logs
        self.started: list[tuple[subprocess.Popen[bytes], Path]] = []
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None, tag: str = "") -> Proc:
        log = self.logs / f"{len(self.started):02d}-{name}{'-' + tag if tag else ''}.log"
        with open(log, "wb") as err:
            p = subprocess.Popen(
                [str(self.exe), name, *args],
                env={**BASE_ENV, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        self.started.append((p, log))
        return Proc(p, log)

    def kill_all(self) -> None:
        for p, _ in self.started:
            if p.poll() is None:
                p.kill()
        for p, _ in self.started:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


class Proc:
    def __init__(self, p: subprocess.Popen[bytes], log: Path) -> None:
        self.p, self.log = p, log

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_log(self, needle: str, timeout: float = 15) -> str:
        wait_for(lambda: needle in self.text(), timeout, f"{needle!r} in {self.log.name}: {self.text()!r}")
        return self.text()

    def wait_exit(self, timeout: float = 15) -> int:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.log.name} still running after {timeout}s: {self.text()!r}") from None

    def running(self) -> bool:
        return self.p.poll() is None


@pytest.fixture
def procs(sim_bin: Path, tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(sim_bin, tmp_path / "logs")
    try:
        yield ps
    finally:
        ps.kill_all()


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def run(
    exe: Path, name: str, *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(exe), name, *args], env={**BASE_ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def http(port: int, path: str, body: dict[str, Any] | bytes | None = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(port: int) -> tuple[int, Any] | None:
    try:
        return http(port, "/health")
    except (OSError, urllib.error.URLError):
        return None


def wait_health(port: int, status: int, timeout: float = 15) -> dict[str, Any]:
    got: list[tuple[int, Any] | None] = [None]

    def ok() -> bool:
        got[0] = health(port)
        return got[0] is not None and got[0][0] == status

    wait_for(ok, timeout, f"/health {status} on {port} (last: {got[0]})")
    assert got[0] is not None
    return dict(got[0][1])


def check_api(port: int, served: str, *also: str) -> None:
    status, models = http(port, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [served, *also]
    s1, c1 = http(port, "/v1/completions", {"model": served, "prompt": "Say OK.", "max_tokens": 1})
    assert s1 == 200 and c1["choices"][0]["text"] == "OK" and c1["model"] == served
    assert c1["usage"]["completion_tokens"] == 1
    messages = [{"role": "user", "content": "17*19="}]
    s2, chat = http(port, "/v1/chat/completions", {"model": served, "messages": messages})
    assert s2 == 200 and chat["choices"][0]["message"] == {"role": "assistant", "content": "323"}
    assert http(port, "/v1/completions", b"not json")[0] == 400
    assert http(port, "/nope")[0] == 404


# --------------------------------------------------------------------------- inputs


@pytest.fixture
def model(tmp_path: Path) -> Path:
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text('{"architectures": ["DeepseekV41ForCausalLM"]}\n')
    (m / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0, "b": 1}}}\n')
    (m / "model-00001-of-00001.safetensors").write_bytes(bytes(range(256)) * 16)
    return m


@pytest.fixture
def kit(tmp_path: Path) -> Path:
    k = tmp_path / "kit"
    k.mkdir()
    (k / "MANIFEST").write_text("aot/kernels.cubin\n")
    return k


def rank_cache(exe: Path, model: Path, out: Path, rank: int, world: int, *extra: str) -> Path:
    r = run(exe, "tf-dsv41-rank-cache", str(model), str(out), str(rank), str(world), "--parity", *extra)
    assert r.returncode == 0, r.stderr
    files = sorted(out.glob(f"rank{rank}of{world}-*.bin"))
    assert len(files) == 1
    return files[0]


def head_env(kit: Path, cache: Path, world: int, tp_port: int, **extra: str) -> dict[str, str]:
    return {
        "TF_DS_KIT": str(kit),
        "TF_DS_RANK_CACHE": str(cache),
        "TF_TP_WORLD": str(world),
        "TF_TP_MASTER": "127.0.0.1",
        "TF_TP_PORT": str(tp_port),
        **extra,
    }


def head_args(model: Path, port: int, name: str = "deepseek-v4.1-flash") -> list[str]:
    return [
        "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--name", name, "--context", "1048576",
        "--parallel", "16", "--no-thinking", "--max-tokens", "32768", "--backend", "cuda",
    ]  # fmt: skip


def follower_args(model: Path, cache: Path, rank: int, world: int, port: int, kit: Path, *extra: str) -> list[str]:
    return [str(model), str(cache), str(rank), str(world), "127.0.0.1", str(port), str(kit), *extra]


# --------------------------------------------------------------------------- version and dispatch


@pytest.mark.build
def test_version_and_dispatch(sim_bin: Path, tmp_path: Path) -> None:
    v = subprocess.run([str(sim_bin), "--version"], capture_output=True, text=True, check=True)
    assert v.stdout == f"sim-engine 0.1.0 (simulator, commit {COMMIT0})\n"
    for name in ("tensorfold-native", "tf-dsv41-lanes", "tf-dsv41-rank-cache", "tensorfold", "vllm"):
        r = run(sim_bin, name, "--version")
        assert r.returncode == 0 and r.stdout == f"{name} 0.1.0 (simulator)\n", (name, r.stdout, r.stderr)
    # dispatch on the name it runs as, as the image installs it
    for name in ("tensorfold-native", "vllm"):
        link = tmp_path / name
        link.symlink_to(sim_bin)
        r = subprocess.run([str(link), "--version"], capture_output=True, text=True)
        assert r.stdout == f"{name} 0.1.0 (simulator)\n"
    bad = run(sim_bin, "llama-server")
    assert bad.returncode == 2 and "unknown personality 'llama-server'" in bad.stderr


# --------------------------------------------------------------------------- tensorfold-native / tf-dsv41-lanes


@pytest.mark.build
def test_head_refusals(sim_bin: Path, model: Path, kit: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    rank_cache(sim_bin, model, cache, 0, 2)
    port, tp = free_port(), free_port()
    args = head_args(model, port)

    bad = run(sim_bin, "tensorfold-native", *args, "--bogus")
    assert bad.returncode == 2 and "error: unknown argument '--bogus'" in bad.stderr
    assert run(sim_bin, "tensorfold-native", *args, "extra").returncode == 2
    assert run(sim_bin, "tensorfold-native", *args[:-1], "rocm").returncode == 2  # --backend
    assert run(sim_bin, "tensorfold-native", "serve", str(model), "--port", "x").returncode == 2

    # each required variable, in order, refused in the real engine's form
    full = head_env(kit, cache, 2, tp)
    order = ["TF_DS_KIT", "TF_DS_RANK_CACHE", "TF_TP_WORLD", "TF_TP_MASTER", "TF_TP_PORT"]
    for i, var in enumerate(order):
        env = {k: full[k] for k in order[:i]}
        r = run(sim_bin, "tensorfold-native", *args, env=env)
        assert r.returncode == 1 and f"set {var}" in r.stderr, (var, r.stderr)
        assert "(simulator)" in r.stderr

    def refused(env: dict[str, str], needle: str, model_dir: Path = model) -> None:
        r = run(sim_bin, "tensorfold-native", *head_args(model_dir, port), env=env)
        assert r.returncode == 1 and needle in r.stderr, (needle, r.stderr)
        assert not listening(port) and not listening(tp)

    refused(head_env(kit, cache, 3, tp), "TF_TP_WORLD must be 2 or 4, got 3")
    empty_model = tmp_path / "empty-model"
    empty_model.mkdir()
    refused(full, "config.json not found", empty_model)
    no_manifest = tmp_path / "kit-without-manifest"
    no_manifest.mkdir()
    refused(head_env(no_manifest, cache, 2, tp), "MANIFEST not found")
    refused(head_env(kit, tmp_path / "nowhere", 2, tp), "rank cache:")
    refused(head_env(kit, cache, 4, tp), "rank cache: rank0of2-")  # a world of 2's file in a world of 4
    refused({**full, "TF_DS_TOKEN_MAP": str(tmp_path / "no-map.json")}, "TF_DS_TOKEN_MAP:")
    refused({**full, "TF_DS_ENGRAM": str(model / "config.json")}, "TF_DS_ENGRAM:")

    # another rank's file in the head's rank cache is named
    other = rank_cache(sim_bin, model, cache, 1, 2)
    refused(full, f"rank cache: {other.name} is rank 1's, this is rank 0")

    # no rank cache at all
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    refused(head_env(kit, empty, 2, tp), "no rank0of2-*.bin")


@pytest.mark.build
def test_follower_refusals(sim_bin: Path, model: Path, kit: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache1"
    rank_cache(sim_bin, model, cache, 1, 4)
    port = free_port()
    args = follower_args(model, cache, 1, 4, port, kit)

    bad = run(sim_bin, "tf-dsv41-lanes", *args, "--pool", "1", "--bogus", "2")
    assert bad.returncode == 2 and "error: unknown argument '--bogus'" in bad.stderr
    assert run(sim_bin, "tf-dsv41-lanes", *args[:6]).returncode == 2  # KIT missing
    assert run(sim_bin, "tf-dsv41-lanes", *args, "--pool", "many").returncode == 2

    def refused(argv: list[str], needle: str) -> None:
        r = run(sim_bin, "tf-dsv41-lanes", *argv)
        assert r.returncode == 1 and needle in r.stderr, (needle, r.stderr)

    refused(follower_args(model, cache, 0, 4, port, kit), "rank 0 is the head")
    refused(follower_args(model, cache, 4, 4, port, kit), "rank 4 is not in a world of 4")
    refused(follower_args(model, cache, 1, 3, port, kit), "WORLD must be 2 or 4")
    refused([*args, "--token-map", str(tmp_path / "no-map.json")], "--token-map:")
    refused([*args, "--rdma-kernels", str(tmp_path / "no.fatbin")], "--rdma-kernels:")
    other = rank_cache(sim_bin, model, cache, 2, 4)
    refused(args, f"rank cache: {other.name} is rank 2's, this is rank 1")


@pytest.mark.build
def test_followers_dial_the_head_tp4(procs: Procs, sim_bin: Path, model: Path, kit: Path, tmp_path: Path) -> None:
    """Seed 000's order: ranks 3, 2, 1 first, dialing; then the head listens, and /health turns ok."""
    port, tp = free_port(), free_port()
    caches = {r: tmp_path / f"cache{r}" for r in range(4)}
    for r, c in caches.items():
        rank_cache(sim_bin, model, c, r, 4)
    token_map = tmp_path / "dsv41_token_map.json"
    rank_cache(sim_bin, model, tmp_path / "cache-tm", 0, 4, "--token-map", str(token_map))
    fatbin = tmp_path / "rdma_gather.fatbin"
    fatbin.write_text("placeholder\n")
    flags = [
        "--pool", "1048576", "--engram", str(kit), "--token-map", str(token_map), "--rdma", "rocep1s0f0",
        "--rdma-kernels", str(fatbin), "--graphs", "1", "--side", "1", "--prefetch", "1", "--aio", "1",
        "--round-rows", "48", "--streams", "16", "--pool", "2097152", "--context", "1048576",
    ]  # fmt: skip
    f3 = procs.start("tf-dsv41-lanes", *follower_args(model, caches[3], 3, 4, tp, kit, *flags), tag="r3")
    f2 = procs.start("tf-dsv41-lanes", *follower_args(model, caches[2], 2, 4, tp, kit, *flags), tag="r2")
    for f in (f3, f2):
        f.wait_log(f"dialing 127.0.0.1:{tp}")
        f.wait_log("retrying in 1s")  # nobody listens yet: followers retry
    assert "tf-dsv41-lanes (simulator): rank 3 of 4 dialing" in f3.text()
    assert "pool 2097152" in f3.text()  # the last --pool wins

    env = head_env(
        kit, caches[0], 4, tp, TF_DS_TOKEN_MAP=str(token_map), TF_DS_ENGRAM=str(kit), TF_DS_RDMA_KERNELS=str(fatbin)
    )
    head = procs.start("tensorfold-native", *head_args(model, port), env=env, tag="head")
    head.wait_log("(simulator): rank 0 of 4")
    f3.wait_log("joined head")
    f2.wait_log("joined head")
    # two of three followers: loading
    body = wait_health(port, 503)
    assert body == {"status": "loading", "joined": 3, "world": 4}
    assert http(port, "/v1/completions", {"prompt": "x"})[0] == 503

    f1 = procs.start("tf-dsv41-lanes", *follower_args(model, caches[1], 1, 4, tp, kit, *flags), tag="r1")
    f1.wait_log("joined head")
    assert wait_health(port, 200) == {"status": "ok"}
    head.wait_log("all 4 ranks joined: ready")
    check_api(port, "deepseek-v4.1-flash")

    # a rank already joined is refused (and logged by the head)
    cache_dup = tmp_path / "cache-dup"
    rank_cache(sim_bin, model, cache_dup, 2, 4)
    dup = procs.start("tf-dsv41-lanes", *follower_args(model, cache_dup, 2, 4, tp, kit), tag="dup")
    assert dup.wait_exit() == 1
    assert "rank 2 has already joined" in dup.text()
    head.wait_log("refused a follower")
    # a follower of another world is refused
    cache_w2 = tmp_path / "cache-w2"
    rank_cache(sim_bin, model, cache_w2, 1, 2)
    w2 = procs.start("tf-dsv41-lanes", *follower_args(model, cache_w2, 1, 2, tp, kit), tag="w2")
    assert w2.wait_exit() == 1
    assert "has a world of 2, this head's is 4" in w2.text()
    # a probe of the rendezvous port (a readiness check) is not a follower
    assert listening(tp)
    assert head.running() and wait_health(port, 200) == {"status": "ok"}

    # followers open no port: only the head's two are listening among this test's processes
    for f in (f1, f2, f3):
        assert f.running()
        assert not _listening_ports(f.p.pid)
    assert _listening_ports(head.p.pid) == {port, tp}

    # the head goes away: every follower exits 1
    head.p.send_signal(signal.SIGTERM)
    assert head.wait_exit(5) == 0
    for f in (f1, f2, f3):
        assert f.wait_exit() == 1
        assert "head went away" in f.text()


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports a process listens on (from /proc: its sockets' inodes against /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.build
def test_head_exits_when_a_follower_goes(procs: Procs, sim_bin: Path, model: Path, kit: Path, tmp_path: Path) -> None:
    port, tp = free_port(), free_port()
    c0, c1 = tmp_path / "c0", tmp_path / "c1"
    rank_cache(sim_bin, model, c0, 0, 2)
    rank_cache(sim_bin, model, c1, 1, 2)
    head = procs.start("tensorfold-native", *head_args(model, port), env=head_env(kit, c0, 2, tp))
    f1 = procs.start("tf-dsv41-lanes", *follower_args(model, c1, 1, 2, tp, kit))
    wait_health(port, 200)
    f1.p.kill()
    assert head.wait_exit() == 1
    assert "rank 1 went away" in head.text()


@pytest.mark.build
def test_sigterm_stops_promptly(procs: Procs, sim_bin: Path, model: Path, kit: Path, tmp_path: Path) -> None:
    cache = tmp_path / "c1"
    rank_cache(sim_bin, model, cache, 1, 2)
    f = procs.start("tf-dsv41-lanes", *follower_args(model, cache, 1, 2, free_port(), kit))
    f.wait_log("retrying in 1s")
    t0 = time.monotonic()
    f.p.send_signal(signal.SIGTERM)
    assert f.wait_exit(5) == 0
    assert time.monotonic() - t0 < 2
    assert "stopping on a signal" in f.text()


# --------------------------------------------------------------------------- tf-dsv41-rank-cache


@pytest.mark.build
def test_rank_cache_is_deterministic(sim_bin: Path, model: Path, tmp_path: Path) -> None:
    a = rank_cache(sim_bin, model, tmp_path / "a", 0, 4, "--token-map", str(tmp_path / "a" / "map.json"))
    # the same model elsewhere, another output folder: the same name and bytes
    copy = tmp_path / "copy" / "model"
    shutil.copytree(model, copy)
    b = rank_cache(sim_bin, copy, tmp_path / "b", 0, 4, "--token-map", str(tmp_path / "b" / "map.json"))
    assert a.name == b.name and a.read_bytes() == b.read_bytes()
    assert (tmp_path / "a" / "map.json").read_bytes() == (tmp_path / "b" / "map.json").read_bytes()
    token_map = json.loads((tmp_path / "a" / "map.json").read_text())
    assert token_map["source"] == "tokenizer.json"
    assert len(a.name) == len("rank0of4-") + 20 + len(".bin")
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no temp left
    # another rank: another file
    r1 = rank_cache(sim_bin, model, tmp_path / "a", 1, 4)
    assert r1.name != a.name and r1.read_bytes() != a.read_bytes()
    # other model bytes: another name; the older file of that rank is replaced
    (copy / "model-00001-of-00001.safetensors").write_bytes(b"other weights")
    c = rank_cache(sim_bin, copy, tmp_path / "b", 0, 4)
    assert c.name != b.name and not b.exists()
    # no config.json: refused
    (copy / "config.json").unlink()
    r = run(sim_bin, "tf-dsv41-rank-cache", str(copy), str(tmp_path / "c"), "0", "4")
    assert r.returncode == 1 and "config.json not found" in r.stderr
    assert run(sim_bin, "tf-dsv41-rank-cache", str(model), str(tmp_path / "c"), "0").returncode == 2
    assert run(sim_bin, "tf-dsv41-rank-cache", str(model), str(tmp_path / "c"), "4", "4").returncode == 1


# --------------------------------------------------------------------------- tensorfold (Python engine)


def py_env(rank: int, world: int, store: int, model: Path, **extra: str) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store),
        "TF_DSV41_BIAS_VL": str(model),
        "TF_SIM_ENGRAM_DIR": str(model / "no-engram"),
        **extra,
    }


def py_args(model: Path, port: int) -> list[str]:
    return ["serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--parallel", "4"]


@pytest.mark.build
def test_python_engine_refusals(sim_bin: Path, model: Path, tmp_path: Path) -> None:
    port, store = free_port(), free_port()
    bad = run(sim_bin, "tensorfold", *py_args(model, port), "--bogus", env=py_env(0, 2, store, model))
    assert bad.returncode == 2 and "tensorfold: error: unrecognized arguments: --bogus" in bad.stderr
    full = py_env(0, 2, store, model)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_DSV41_BIAS_VL"):
        env = {k: v for k, v in full.items() if k != var}
        r = run(sim_bin, "tensorfold", *py_args(model, port), env=env)
        assert r.returncode == 1 and f"set {var}" in r.stderr, (var, r.stderr)

    # /engram mounted: this rank's two packs and no other rank's
    src = tmp_path / "engram-src"
    src.mkdir()
    (src / "config.json").write_text("{}\n")
    (src / "model-00047-of-00048.safetensors").write_bytes(b"engram rows")
    engram = tmp_path / "engram"
    for rank in (0, 1):
        r = pack(sim_bin, src, engram, rank)
        assert r.returncode == 0, r.stderr
    r = run(sim_bin, "tensorfold", *py_args(model, port), env={**full, "TF_SIM_ENGRAM_DIR": str(engram)})
    assert r.returncode == 1 and "engram: engram-l1-r1of2.bin is rank 1's, this is rank 0" in r.stderr
    for p in [*engram.glob("engram-*-r1of2.bin"), engram / "engram-l1-r0of2.bin"]:
        p.unlink()
    r = run(sim_bin, "tensorfold", *py_args(model, port), env={**full, "TF_SIM_ENGRAM_DIR": str(engram)})
    assert r.returncode == 1 and "no engram-l1-r0of2.bin" in r.stderr
    assert not listening(port) and not listening(store)


@pytest.mark.build
def test_python_engine_rank1_first_times_out(procs: Procs, sim_bin: Path, model: Path) -> None:
    """Rank 1 before rank 0: torch's store gives up (why the lane starts rank 0 first)."""
    port, store = free_port(), free_port()
    t0 = time.monotonic()
    r1 = procs.start("tensorfold", *py_args(model, port), env=py_env(1, 2, store, model, TF_SIM_STORE_TIMEOUT="2"))
    assert r1.wait_exit(10) == 1
    assert 1.5 < time.monotonic() - t0 < 8
    assert "DistStoreError: Timed out after 2 seconds waiting for clients. 1/2 clients joined." in r1.text()
    assert "retrying in 1s" in r1.text()


@pytest.mark.build
def test_python_engine_rank0_first(procs: Procs, sim_bin: Path, model: Path, tmp_path: Path) -> None:
    port, store = free_port(), free_port()
    src = tmp_path / "engram-src"
    src.mkdir()
    (src / "config.json").write_text("{}\n")
    (src / "model-00048-of-00048.safetensors").write_bytes(b"more engram rows")
    engram = {r: tmp_path / f"engram{r}" for r in (0, 1)}
    for r, d in engram.items():
        assert pack(sim_bin, src, d, r).returncode == 0

    r0 = procs.start(
        "tensorfold", *py_args(model, port), env=py_env(0, 2, store, model, TF_SIM_ENGRAM_DIR=str(engram[0]))
    )
    r0.wait_log("store listening")
    wait_for(lambda: listening(store), 10, "the store port")  # the lane's readiness: the store port
    assert wait_health(port, 503) == {"status": "loading", "joined": 1, "world": 2}
    r1 = procs.start(
        "tensorfold", *py_args(model, port), env=py_env(1, 2, store, model, TF_SIM_ENGRAM_DIR=str(engram[1]))
    )
    r1.wait_log("joined store")
    assert wait_health(port, 200) == {"status": "ok"}
    check_api(port, str(model))  # no served-name flag: it lists MODEL
    assert r0.running() and r1.running()
    assert _listening_ports(r1.p.pid) == set()


@pytest.mark.build
def test_python_engine_lists_the_lanes_served_name(procs: Procs, sim_bin: Path, model: Path, tmp_path: Path) -> None:
    """With builder's launch file in the container ($BUILDER_CONFIG), rank 0 lists the lane's served name
    first (the real engine's name flag is unknown), then MODEL."""
    port, store = free_port(), free_port()
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"format": 2, "serve": {"served_name": "deepseek-v4.1-flash-1017-tensorfold"}}))
    r0 = procs.start("tensorfold", *py_args(model, port), env=py_env(0, 1, store, model, BUILDER_CONFIG=str(config)))
    assert wait_health(port, 200) == {"status": "ok"}  # a world of one: nobody to wait for
    check_api(port, "deepseek-v4.1-flash-1017-tensorfold", str(model))
    assert "served-name flag is UNKNOWN" in r0.text()


# --------------------------------------------------------------------------- vllm


def vllm_args(model: Path, rank: int, nnodes: int, mp: int, port: int | None, *extra: str) -> list[str]:
    head = ["--host", "127.0.0.1", "--port", str(port)] if port is not None else []
    return [
        "serve", str(model), "--served-model-name", "deepseek-v4.1-flash", *head,
        "--tensor-parallel-size", str(nnodes), "--nnodes", str(nnodes), "--node-rank", str(rank),
        "--master-addr", "127.0.0.1", "--master-port", str(mp), "--max-model-len", "300000",
        "--gpu-memory-utilization", "0.80", "--block-size", "128", *extra,
    ]  # fmt: skip


@pytest.mark.build
def test_vllm_refusals(sim_bin: Path, model: Path) -> None:
    mp, port = free_port(), free_port()
    bad = run(sim_bin, "vllm", *vllm_args(model, 0, 2, mp, port, "--bogus", "1"))
    assert bad.returncode == 2 and "vllm: error: unrecognized arguments: --bogus 1" in bad.stderr
    assert run(sim_bin, "vllm", *vllm_args(model, 0, 2, mp, port, "--port", "x")).returncode == 2
    for argv, needle in (
        (vllm_args(model, 1, 2, mp, None), "runs --headless"),
        (vllm_args(model, 0, 2, mp, port, "--headless"), "node rank 0 serves the API"),
        (vllm_args(model, 2, 2, mp, None, "--headless"), "--node-rank 2 is not in --nnodes 2"),
    ):
        r = run(sim_bin, "vllm", *argv)
        assert r.returncode == 1 and needle in r.stderr, (needle, r.stderr)
    r = run(sim_bin, "vllm", *vllm_args(model.parent / "nowhere", 0, 2, mp, port))
    assert r.returncode == 1 and "model:" in r.stderr


def shipped_vllm_argv(lane: str, rank: int, model: Path, port: int, mp: int) -> list[str]:
    """Rank `rank` of the shipped lane as `builder launch` renders it (after ``vllm``), on loopback ports."""
    p = clirun.run("launch", "--fleet", "spark-tp4", "--lane", lane, "--json", cwd=ROOT,
                   env=clirun.environment(drop=("BUILDER_",)), timeout=120)
    assert p.returncode == 0, p.stderr
    argv = next(h for h in json.loads(p.stdout)["hosts"] if h["rank"] == rank)["argv"]
    out = argv[argv.index("--entrypoint") + 3:]
    out[1] = str(model)
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port)), ("--master-addr", "127.0.0.1"),
                        ("--master-port", str(mp))):
        out[out.index(flag) + 1] = value
    return out


@pytest.mark.build
@pytest.mark.parametrize("lane", ["vllm-native", "vllm-native-1m"])
def test_vllm_takes_the_shipped_lanes_command_lines(procs: Procs, sim_bin: Path, model: Path, lane: str) -> None:
    mp, port = free_port(), free_port()
    head = procs.start("vllm", *shipped_vllm_argv(lane, 0, model, port, mp), tag="n0")
    assert wait_health(port, 503) == {"status": "loading", "joined": 1, "world": 4}  # (the head counts)
    worker = shipped_vllm_argv(lane, 1, model, port, mp)
    w1 = procs.start("vllm", *worker, tag="n1")
    w1.wait_log("joined head")
    assert wait_health(port, 503) == {"status": "loading", "joined": 2, "world": 4}
    assert head.p.poll() is None
    # still refused: an unknown flag, and a config option whose value is not a JSON object
    bad = run(sim_bin, "vllm", *worker, "--max-num-batch-tokens", "8192")
    assert bad.returncode == 2 and "unrecognized arguments: --max-num-batch-tokens 8192" in bad.stderr
    spec = worker.index("--speculative-config") + 1
    bad = run(sim_bin, "vllm", *worker[:spec], "dspark", *worker[spec + 1:])
    assert bad.returncode == 2 and "--speculative-config: not a JSON object" in bad.stderr


@pytest.mark.build
def test_vllm_headless_nodes_dial_the_head(procs: Procs, sim_bin: Path, model: Path, kit: Path, tmp_path: Path) -> None:
    mp, port = free_port(), free_port()
    w1 = procs.start("vllm", *vllm_args(model, 1, 3, mp, None, "--headless"), tag="n1")
    w1.wait_log(f"dialing 127.0.0.1:{mp}")
    w1.wait_log("retrying in 1s")
    head = procs.start("vllm", *vllm_args(model, 0, 3, mp, port, "--quantization", "exl3"), tag="n0")
    w1.wait_log("joined head")
    assert wait_health(port, 503) == {"status": "loading", "joined": 2, "world": 3}
    w2 = procs.start("vllm", *vllm_args(model, 2, 3, mp, None, "--headless"), tag="n2")
    w2.wait_log("joined head")
    assert wait_health(port, 200) == {"status": "ok"}
    check_api(port, "deepseek-v4.1-flash")
    assert _listening_ports(w1.p.pid) == set() and _listening_ports(w2.p.pid) == set()
    assert _listening_ports(head.p.pid) == {port, mp}
    # a TensorFold follower cannot join a vLLM head
    cache = tmp_path / "cache1"
    rank_cache(sim_bin, model, cache, 1, 4)
    tf = procs.start("tf-dsv41-lanes", *follower_args(model, cache, 1, 4, mp, kit), tag="tf")
    assert tf.wait_exit() == 1
    assert "a tensorfold-native rank cannot join a vllm head" in tf.text()
    assert head.running()
    head.p.kill()
    for w in (w1, w2):
        assert w.wait_exit() == 1 and "head went away" in w.text()


# --------------------------------------------------------------------------- the chat API (what the serving gates ask)


def sse(port: int, path: str, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """A streamed request: its content type and its chunks (the body must be server-sent events
    ending with ``data: [DONE]``)."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200
        ctype, text = str(r.headers.get("Content-Type")), r.read().decode()
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], text[-200:]
    chunks = []
    for ev in events[:-2]:
        assert ev.startswith("data: "), ev
        chunks.append(json.loads(ev.removeprefix("data: ")))
    return ctype, chunks


def joined(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Streamed chat or text chunks joined as a client joins them."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "ids": [], "finish": None, "tool_calls": [], "usage": None}
    for c in chunks:
        out["usage"] = c.get("usage") or out["usage"]
        for ch in c["choices"]:
            assert out["finish"] is None, "a chunk after the one with the finish reason"
            d = ch.get("delta") or {}
            if d.get("reasoning_content"):
                assert not out["content"], "reasoning after content"
            out["content"] += d.get("content") or ch.get("text") or ""
            out["reasoning"] += d.get("reasoning_content") or ""
            out["tool_calls"] += d.get("tool_calls") or []
            out["ids"] += ch.get("token_ids") or []
            out["finish"] = ch["finish_reason"]
    return out


SERVED = "deepseek-v4.1-flash"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip


def chat_body(prompt: str | list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return {"model": SERVED, "messages": messages, "temperature": 0, "max_tokens": 32, "return_token_ids": True} | extra


def ask(port: int, prompt: str | list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    status, body = http(port, "/v1/chat/completions", chat_body(prompt, **extra))
    assert status == 200, body
    return dict(body)


def single_head(procs: Procs, model: Path, port: int, **env: str) -> Proc:
    head = procs.start("vllm", *vllm_args(model, 0, 1, free_port(), port), env=env)
    assert wait_health(port, 200) == {"status": "ok"}
    return head


@pytest.mark.build
def test_chat_api_answers_as_vllm_does(procs: Procs, model: Path) -> None:
    """The chat API the serving gates ask (builder/hostscripts/gates.py), over HTTP: the probe, streamed
    equals non-streamed, tool calls and tool results, reasoning, the draft switch, several at once."""
    port = free_port()
    single_head(procs, model, port)

    # the chat probe: a known prompt, its ids and usage
    r = ask(port, "17*19=")
    ch = r["choices"][0]
    assert r["object"] == "chat.completion" and r["model"] == SERVED
    assert ch["message"] == {"role": "assistant", "content": "323"} and ch["finish_reason"] == "stop"
    assert len(ch["token_ids"]) == 1 and r["usage"]["completion_tokens"] == 1
    assert r["usage"]["prompt_tokens"] == len(r["prompt_token_ids"]) > 0
    assert ask(port, "17*23=")["choices"][0]["message"]["content"] == "391"
    count = ask(port, "Count from one to twenty.")["choices"][0]["message"]["content"]
    assert count == " ".join(str(i) for i in range(1, 21))
    words = ask(port, "Tell me about the sea.")["choices"][0]["message"]["content"].split()
    assert len(words) >= 8 and len(set(words)) == len(words)
    assert ask(port, "Tell me about the sea.") == ask(port, "Tell me about the sea.")  # deterministic
    cut = ask(port, "Count from 1 to 100, separated by spaces.", max_tokens=10)["choices"][0]
    assert cut["message"]["content"] == "1 2 3 4 5 6 7 8 9 10" and cut["finish_reason"] == "length"
    assert len(cut["token_ids"]) == 10

    # streamed equals non-streamed: content, token ids, finish reason
    for p in ("17*19=", "Count from one to twenty.", "Tell me about the sea."):
        plain = ask(port, p)["choices"][0]
        ctype, chunks = sse(port, "/v1/chat/completions", chat_body(p, stream_options={"include_usage": True}))
        assert ctype.startswith("text/event-stream")
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        got = joined(chunks)
        want = (plain["message"]["content"], plain["token_ids"], plain["finish_reason"])
        assert (got["content"], got["ids"], got["finish"]) == want
        assert len(chunks) >= len(got["ids"]) + 2 and got["usage"]["completion_tokens"] == len(got["ids"])

    # the draft switch changes nothing
    assert ask(port, "17*19=", draft=False) == ask(port, "17*19=", draft=True)

    # reasoning: on when asked for, before the content; the ids are the content's
    on = ask(port, "17*19=", chat_template_kwargs={"thinking": True})["choices"][0]
    assert on["message"]["reasoning_content"] and on["message"]["content"] == "323"
    assert on["token_ids"] == ch["token_ids"]
    off = ask(port, "17*19=", chat_template_kwargs={"thinking": False})["choices"][0]["message"]
    assert not off.get("reasoning_content")
    got = joined(sse(port, "/v1/chat/completions", chat_body("17*19=", chat_template_kwargs={"thinking": True}))[1])
    assert got["reasoning"] == on["message"]["reasoning_content"] and got["content"] == "323"

    # a tool call, plain and streamed
    t = ask(port, "What is the weather in Paris?", tools=WEATHER, tool_choice="auto")["choices"][0]
    assert t["finish_reason"] == "tool_calls" and t["message"]["content"] is None
    (call,) = t["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    got = joined(sse(port, "/v1/chat/completions", chat_body("What is the weather in Paris?", tools=WEATHER))[1])
    assert got["finish"] == "tool_calls" and got["content"] == "" and got["ids"] == t["token_ids"]
    (delta,) = got["tool_calls"]
    assert delta["index"] == 0 and delta["id"] == call["id"] and delta["function"] == call["function"]
    assert ask(port, "17*19=", tools=WEATHER, tool_choice="none")["choices"][0]["message"]["content"] == "323"

    # the turn after the tool's result uses it
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_gate0", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_gate0", "content": json.dumps({"condition": "sunny", "temp_c": 21})},
    ]  # fmt: skip
    res = ask(port, turns, tools=WEATHER, tool_choice="auto")["choices"][0]
    assert res["finish_reason"] == "stop" and not res["message"].get("tool_calls")
    assert "sunny" in res["message"]["content"] and "21" in res["message"]["content"]
    assert "<tool_call>" not in res["message"]["content"]

    # several at once: each its own answer, as alone
    prompts = ["17*19=", "Count from 1 to 100, separated by spaces.", "Name a colour.", "Tell me about the sea."] * 3
    solo = {p: ask(port, p, max_tokens=128) for p in set(prompts)}
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: ask(port, p, max_tokens=128), prompts))
    assert [r["choices"] for r in together] == [solo[p]["choices"] for p in prompts]

    # raw completions: the same machinery, with ids, streamed or not
    s, raw = http(port, "/v1/completions", {"model": SERVED, "prompt": "17*19=", "return_token_ids": True})
    assert s == 200 and raw["choices"][0]["text"] == "323" and raw["choices"][0]["token_ids"] == ch["token_ids"]
    got = joined(sse(port, "/v1/completions", {"prompt": "Count from one to twenty.", "return_token_ids": True})[1])
    assert got["content"] == count and len(got["ids"]) == 20 and got["finish"] == "stop"

    # refusals: a bad body is 400, as vLLM's are
    assert http(port, "/v1/chat/completions", {"messages": []})[0] == 400
    assert http(port, "/v1/chat/completions", chat_body("x", max_tokens=0))[0] == 400


@pytest.mark.build
def test_sim_fault_garbage_token(procs: Procs, sim_bin: Path, model: Path) -> None:
    """SIM_FAULT=garbage-token: the head boots cleanly, then every completion is one token repeated."""
    port = free_port()
    head = single_head(procs, model, port, SIM_FAULT="garbage-token")
    assert "SIM_FAULT=garbage-token" in head.text()
    assert http(port, "/v1/models")[1]["data"][0]["id"] == SERVED
    ch = ask(port, "17*19=", max_tokens=16)["choices"][0]
    text, ids = ch["message"]["content"], ch["token_ids"]
    assert ch["finish_reason"] == "length" and len(ids) == 16 and len(set(ids)) == 1
    assert len(set(text)) == 1 and text != "323"
    got = joined(sse(port, "/v1/chat/completions", chat_body("17*19=", max_tokens=16))[1])
    assert (got["content"], got["ids"], got["finish"]) == (text, ids, "length")
    tools = ask(port, "What is the weather in Paris?", tools=WEATHER)["choices"][0]
    assert not tools["message"].get("tool_calls") and len(set(tools["token_ids"])) == 1
    s, raw = http(port, "/v1/completions", {"prompt": "Say OK.", "return_token_ids": True})
    assert s == 200 and len(raw["choices"][0]["token_ids"]) >= 8 and len(set(raw["choices"][0]["token_ids"])) == 1

    # any other fault is refused at start, in one line
    other = free_port()
    r = run(sim_bin, "vllm", *vllm_args(model, 0, 1, free_port(), other), env={"SIM_FAULT": "slow"})
    assert r.returncode == 1
    assert r.stderr == "vllm (simulator): SIM_FAULT: unknown fault 'slow' (known: garbage-token)\n"
    assert not listening(other)


# --------------------------------------------------------------------------- python3 pack_engram.py


def pack(exe: Path, src: Path, out: Path, rank: int, *extra: str) -> subprocess.CompletedProcess[str]:
    script = src.parent / "scripts" / "pack_engram.py"
    script.parent.mkdir(exist_ok=True)
    script.touch()
    return run(
        exe, "python3", str(script), "--src", str(src), "--config", str(src / "config.json"), "--out", str(out),
        "--rank", str(rank), *extra,
    )  # fmt: skip


def check(exe: Path, src: Path | None, d: Path, rank: int, *extra: str) -> subprocess.CompletedProcess[str]:
    script = d.parent / "scripts" / "pack_engram.py"
    script.parent.mkdir(exist_ok=True)
    script.touch()
    with_src = ["--src", str(src), "--config", str(src / "config.json")] if src else []
    return run(exe, "python3", str(script), *with_src, "--check", str(d), "--rank", str(rank), *extra)


@pytest.mark.build
def test_pack_engram(sim_bin: Path, tmp_path: Path) -> None:
    src = tmp_path / "engram-src"
    src.mkdir()
    (src / "config.json").write_text('{"engram_layers": [1, 14]}\n')
    (src / "model-00047-of-00048.safetensors").write_bytes(b"a" * 1000)
    (src / "model-00048-of-00048.safetensors").write_bytes(b"b" * 1000)
    a, b = tmp_path / "a", tmp_path / "b"
    r = pack(sim_bin, src, a, 0)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in a.iterdir()) == ["engram-l1-r0of2.bin", "engram-l14-r0of2.bin"]
    assert pack(sim_bin, src, b, 0).returncode == 0
    for name in ("engram-l1-r0of2.bin", "engram-l14-r0of2.bin"):
        assert (a / name).read_bytes() == (b / name).read_bytes()  # deterministic
    assert pack(sim_bin, src, b, 1, "--tp", "4").returncode == 0
    assert (b / "engram-l1-r1of4.bin").read_bytes() != (a / "engram-l1-r0of2.bin").read_bytes()

    ok = check(sim_bin, src, a, 0)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count(": ok") == 2
    assert check(sim_bin, None, a, 0).returncode == 0  # header and payload only
    assert check(sim_bin, None, b, 1).returncode == 0  # the world inferred from the names
    assert check(sim_bin, None, a, 1).returncode == 1  # no rank 1 files

    other = tmp_path / "other-src"
    shutil.copytree(src, other)
    (other / "model-00048-of-00048.safetensors").write_bytes(b"c" * 1000)
    r = check(sim_bin, other, a, 0)
    assert r.returncode == 1 and "packed from other --src files" in r.stderr
    damaged = a / "engram-l14-r0of2.bin"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    r = check(sim_bin, src, a, 0)
    assert r.returncode == 1 and "engram-l14-r0of2.bin: not an Engram pack, or damaged" in r.stderr

    script = tmp_path / "scripts" / "pack_engram.py"
    bad = run(sim_bin, "python3", str(script), "--check", str(a), "--rank", "0", "--bogus")
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr
    other_script = tmp_path / "scripts" / "serve.py"
    other_script.touch()
    assert run(sim_bin, "python3", str(other_script)).returncode == 2
    assert run(sim_bin, "python3", "-c", "print(1)").returncode == 2
    missing = run(sim_bin, "python3", str(tmp_path / "nowhere" / "pack_engram.py"), "--rank", "0")
    assert missing.returncode == 2 and "can't open file" in missing.stderr


# --------------------------------------------------------------------------- the sim image (Docker)


@pytest.fixture(scope="module")
def sim_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """images/sim built from nothing on the engine, with the context `builder image sim` lays out:
    the recipe folder, the wheel's ziglang/ folder at zig/, the bundle's main at src/."""
    ctx = tmp_path_factory.mktemp("sim-image") / "ctx"
    shutil.copytree(ROOT / "images" / "sim", ctx)

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(
        zig_dir(),
        ctx / "zig",
        ignore=shutil.ignore_patterns("__pycache__", "__init__.py", "__main__.py"),
        copy_function=link_or_copy,
    )
    git("clone", "-q", "--branch", "main", str(BUNDLE), str(ctx / "src"))
    commit = git("rev-parse", "HEAD", cwd=ctx / "src")
    shutil.rmtree(ctx / "src" / ".git")
    tag = f"builder-test-sim-{uuid.uuid4().hex[:10]}:one"
    try:
        # in its turn with `builder image sim`'s builds: this one removes what it made (tests/test_demo_engine.py)
        with dockerbuild.turn(ctx):
            dockerbuild.build(ctx, buildargs={"ENGINE_COMMIT": commit}, tag=tag, nocache=True, cleanup=True)
        yield tag, commit
    finally:
        with dockerbuild.turn(ctx):
            dockerio.remove(tag, force=True)


@pytest.mark.docker
def test_sim_image_has_every_engine_path(sim_image: tuple[str, str]) -> None:
    tag, _ = sim_image
    info = dockerio.image_inspect(tag)
    assert info is not None
    assert info["Config"]["Entrypoint"] == ["/engine/tensorfold-native"]
    assert "PATH=/usr/local/bin:/usr/bin:/bin" in info["Config"]["Env"]
    assert len(info["RootFS"]["Layers"]) == 1
    r = dockerlib.run(tag, ["--version"])
    assert r.exit_code == 0 and r.stdout == "tensorfold-native 0.1.0 (simulator)\n"
    # the entrypoints the seed lanes name, by path or through PATH
    for entry, name in (
        ("/engine/tensorfold-native", "tensorfold-native"),
        ("/engine/tensorfold", "tensorfold"),
        ("tensorfold", "tensorfold"),
        ("/engine/tf-dsv41-lanes", "tf-dsv41-lanes"),
        ("/engine/tf-dsv41-rank-cache", "tf-dsv41-rank-cache"),
        ("vllm", "vllm"),
    ):
        r = dockerlib.run(tag, ["--version"], entrypoint=[entry])
        assert r.exit_code == 0 and r.stdout == f"{name} 0.1.0 (simulator)\n", (entry, r.stdout, r.stderr)
    # python3 (both paths) finds the pack_engram.py marker, then simulates it
    for py in ("python3", "/usr/bin/python3", "/usr/local/bin/python3"):
        r = dockerlib.run(tag, ["/opt/tensorfold/scripts/pack_engram.py", "--check", "/nowhere", "--rank", "0"],
                         entrypoint=[py])  # fmt: skip
        assert r.exit_code == 1 and "--check: /nowhere not found" in r.stderr, (py, r.stderr)
    # the RDMA kernels placeholder is there
    container = dockerio.client().containers.create(tag)
    try:
        chunks, stat = container.get_archive("/engine/rdma_gather.fatbin")
        b"".join(chunks)
        assert stat["size"] > 0
    finally:
        container.remove(force=True)


# --------------------------------------------------------------------------- the serving gates


def ask_gates(port: int, gates: dict[str, object]) -> dict[str, Any]:
    """builder/hostscripts/gates.py as a head runs it (``python3 -I -S -c SOURCE ARG``) against the API."""
    arg = hs.dumps({"base": f"http://127.0.0.1:{port}", "model": SERVED, "gates": gates})
    r = subprocess.run([sys.executable, "-I", "-S", "-c", hs.GATES, arg], capture_output=True, text=True,
                       timeout=300, env={"PATH": os.environ["PATH"], "NO_PROXY": "*"})
    assert r.returncode == 0, r.stderr
    got: dict[str, Any] = json.loads(r.stdout)
    return got


SEED_LANES = ("tensorfold-tp4", "tensorfold-tp2", "vllm-native", "tensorfold-python-tp2", "vllm-mia-tp2")


@pytest.mark.build
def test_every_seed_lanes_gates_pass_and_the_garbage_token_fault_fails_them(procs: Procs, model: Path) -> None:
    """The shipped seed lanes' gates (pins.toml), asked of the simulator as the serving audit asks them:
    all pass; with SIM_FAULT=garbage-token (an image built from a force-pushed branch: it boots cleanly and
    emits one repeated token) the probe, the tool gates and the garble gate fail, saying what came back."""
    lanes = load_pins(ROOT / "pins.toml").lanes
    port = free_port()
    single_head(procs, model, port)
    for name in SEED_LANES:
        gates = lanes[name].gates
        assert gates is not None, name
        got = ask_gates(port, gates.model_dump(mode="json"))
        assert {g: r["why"] for g, r in got["gates"].items() if not r["ok"]} == {}, name
        want = {"models", "chat_probe", "reasoning_stream", "tool_call", "tool_call_stream", "tool_result", "burst",
                "concurrent_equals_solo", "streamed_equals_plain", "garble"} | (
            {"drafted_equals_serial"} if gates.draft_switch else set())
        assert set(got["gates"]) == want, name
        assert [r["prompt"] for r in got["replay"]] == gates.replay and all(r["ids"] for r in got["replay"])
        assert got["speed"]["tokens"] > 8 and got["speed"]["tok_s"] > 0
    bad = free_port()
    single_head(procs, model, bad, SIM_FAULT="garbage-token")
    gates = lanes["tensorfold-tp4"].gates
    assert gates is not None
    got = ask_gates(bad, gates.model_dump(mode="json"))
    failed = {g for g, r in got["gates"].items() if not r["ok"]}
    assert {"chat_probe", "tool_call", "tool_call_stream", "tool_result", "garble"} <= failed
    assert "models" not in failed and "burst" not in failed  # (it boots and answers: only what it says is wrong)
    assert re.search(r"'17\*19=': one token repeated \(\d+ x id \d+\)", got["gates"]["garble"]["why"])
