"""builder.foundation.dockerio and its build (dockerbuild) against the real engine (small FROM scratch images, no
network, no pulls)."""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from docker.errors import DockerException
from requests.exceptions import ConnectionError as RequestsConnectionError
from urllib3.exceptions import ProtocolError

from builder.errors import BuilderError
from builder.foundation import dockerbuild, dockerio
from builder.image import layers


def test_no_engine_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/nothing.sock")
    with pytest.raises(BuilderError) as exc:
        dockerio.client()
    # one plain line naming DOCKER_HOST and what to do, not the SDK's ('Connection aborted.', ...) tuple
    assert str(exc.value) == (f"no Docker engine: unix://{tmp_path}/nothing.sock (DOCKER_HOST): no such socket: "
                              "start the Docker engine, or set DOCKER_HOST to one that runs")


def test_no_engine_on_tcp_says_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("DOCKER_HOST", f"tcp://127.0.0.1:{port}")
    with pytest.raises(BuilderError) as exc:
        dockerio.client()
    assert str(exc.value) == (f"no Docker engine: tcp://127.0.0.1:{port} (DOCKER_HOST): connection refused: "
                              "the engine is not running there, or listens elsewhere")


def _sdk_error(inner: BaseException) -> BaseException:
    """An error shaped as the SDK raises it: DockerException from requests' ConnectionError, carrying
    urllib3's ProtocolError('Connection aborted.', OSError)."""
    req = RequestsConnectionError(ProtocolError("Connection aborted.", inner))
    try:
        try:
            raise req
        except RequestsConnectionError as e:
            raise DockerException(f"Error while fetching server API version: {e}") from e
    except DockerException as e:
        return e


@pytest.mark.parametrize(("host", "inner", "want"), [
    ("", FileNotFoundError(2, "No such file or directory"),
     "no Docker engine: /var/run/docker.sock (the local socket; DOCKER_HOST is not set): no such socket: "
     "start the Docker engine, or set DOCKER_HOST to one that runs"),
    ("", PermissionError(13, "Permission denied"),
     "no Docker engine: /var/run/docker.sock (the local socket; DOCKER_HOST is not set): permission denied: "
     "join the docker group, or set DOCKER_HOST to an engine you may use"),
    ("ssh://op@spark-head", BrokenPipeError(32, "Broken pipe"),
     "no Docker engine: ssh://op@spark-head (DOCKER_HOST): ssh reached no Docker engine there (see ssh's "
     "message; check that `ssh op@spark-head docker version` works)"),
])
def test_engine_problems_are_plain(host: str, inner: BaseException, want: str) -> None:
    assert dockerio.engine_problem(host, _sdk_error(inner)) == want


def test_a_missing_paramiko_is_named() -> None:
    msg = dockerio.engine_problem("ssh://op@spark-head:2222", DockerException(
        "Install paramiko package to enable ssh:// support"))
    assert msg == ("no Docker engine: ssh://op@spark-head:2222 (DOCKER_HOST): the Docker SDK's ssh:// transport "
                   "needs paramiko (a dependency of builder: reinstall builder)")


def test_build_refuses_missing_dockerfile(tmp_path: Path) -> None:
    with pytest.raises(BuilderError, match="no such Dockerfile"):
        dockerbuild.build(tmp_path)


_HOLD = """
import sys
from builder.foundation import dockerbuild
with dockerbuild.turn(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def _waiting_on_a_lock(pid: int) -> bool:
    """Whether ``pid`` waits for a flock another process holds (the kernel's /proc/locks lists each
    waiter as "-> FLOCK ... PID ...")."""
    return any(f[1:3] == ["->", "FLOCK"] and f[5] == str(pid)
               for f in map(str.split, Path("/proc/locks").read_text().splitlines()))


def test_builds_of_one_recipe_take_turns_whatever_their_tmpdir(tmp_path: Path) -> None:
    """The turn's lock is the machine's: a build run with another TMPDIR (a CI job's, a test's) waits for
    it as well, and has it once the first lets go."""
    ctx = _context(tmp_path, f"FROM scratch\nLABEL nonce={uuid.uuid4().hex}\n", {})
    procs: list[subprocess.Popen[str]] = []

    def hold(name: str) -> subprocess.Popen[str]:
        (tmp_path / name).mkdir()
        procs.append(subprocess.Popen([sys.executable, "-c", _HOLD, str(ctx)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, "TMPDIR": str(tmp_path / name)}))
        return procs[-1]

    try:
        holder = hold("first")
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        waiter = hold("second")
        deadline = time.monotonic() + 60
        while not _waiting_on_a_lock(waiter.pid):
            assert waiter.poll() is None and time.monotonic() < deadline, "the second build did not wait its turn"
            time.sleep(0.05)
        holder.communicate("", timeout=60)
        out, _ = waiter.communicate("", timeout=60)
        assert out == "held\n" and waiter.returncode == 0 and holder.returncode == 0
    finally:
        for pr in procs:
            pr.kill()
            pr.wait()


def test_a_lock_file_this_user_may_not_write_is_a_lock_still(tmp_path: Path) -> None:
    """Another user's lock file in a shared folder (the turns' folder): opened for reading, it is locked
    all the same (flock asks for no write access). Root, which may write anything, runs the holder
    without CAP_DAC_OVERRIDE, so that the file's mode binds it as it binds any user."""
    path = tmp_path / "other.lock"
    path.touch()
    path.chmod(0o444)
    drop = ["setpriv", "--bounding-set=-dac_override", "--inh-caps=-dac_override"] if os.geteuid() == 0 else []
    code = ("import sys\nfrom builder.foundation.canon import file_lock\n"
            "with file_lock(sys.argv[1]):\n    print('held', flush=True)\n    sys.stdin.read()\n")
    holder = subprocess.Popen([*drop, sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n", holder.communicate()[1]  # type: ignore[union-attr]
        with open(path) as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        holder.communicate("", timeout=60)
        assert holder.returncode == 0
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture
def repo() -> Iterator[str]:
    name = f"builder-test-dockerio-{uuid.uuid4().hex[:10]}"
    yield name
    for ref in (f"{name}:a", f"{name}:b", f"{name}:norm", f"{name}:loaded"):
        dockerio.remove(ref, force=True)


def _context(tmp_path: Path, dockerfile: str, files: dict[str, str]) -> Path:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(dockerfile)
    for name, text in files.items():
        (ctx / name).write_text(text)
    return ctx


@pytest.mark.docker
def test_engine_platform() -> None:
    plat = dockerio.engine_platform()
    assert plat.startswith("linux/") and plat.split("/")[1] in {"amd64", "arm64"}


@pytest.mark.docker
def test_build_inspect_tag_save_load_remove(tmp_path: Path, repo: str) -> None:
    ctx = _context(
        tmp_path,
        'FROM scratch\nARG NOTE=unset\nCOPY hello.txt /srv/hello.txt\nLABEL recipe=test\nCMD ["serve"]\n',
        {"hello.txt": "hello\n"},
    )
    lines: list[str] = []
    image_id = dockerbuild.build(
        ctx,
        buildargs={"NOTE": "x"},
        labels={"org.example.input": "abc"},
        tag=f"{repo}:a",
        on_log=lines.append,
    )
    assert image_id.startswith("sha256:") and len(image_id) == 71
    assert any(line.startswith("Step 1/") for line in lines)
    info = dockerio.image_inspect(f"{repo}:a")
    assert info is not None and info["Id"] == image_id
    assert info["Config"]["Labels"] == {"recipe": "test", "org.example.input": "abc"}
    assert dockerio.image_exists(image_id)
    assert dockerio.image_id(f"{repo}:a") == image_id

    dockerio.tag(image_id, repo, "b")
    assert dockerio.image_id(f"{repo}:b") == image_id

    # save streams a docker-archive that names the image's config.
    data = b"".join(dockerio.save(f"{repo}:a"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        manifest = json.loads(tf.extractfile("manifest.json").read())  # type: ignore[union-attr]
    assert manifest[0]["Config"].startswith(image_id.removeprefix("sha256:"))

    # Normalize, then load from a path, a file object and an iterator: one image ID each time.
    rec = layers.normalize_image(io.BytesIO(data), tmp_path / "w", source_date_epoch=1_735_776_000)
    archive = tmp_path / "norm.tar"
    layers.write_archive(rec, archive, repo_tags=[f"{repo}:norm"])
    assert dockerio.load(archive) == rec.image_id
    with open(archive, "rb") as f:
        assert dockerio.load(f) == rec.image_id
    assert dockerio.load(layers.archive_chunks(rec)) == rec.image_id
    assert dockerio.image_id(f"{repo}:norm") == rec.image_id
    norm = dockerio.image_inspect(rec.image_id)
    assert norm is not None
    assert norm["Created"].startswith("2025-01-02T00:00:00")
    assert norm["RootFS"]["Layers"] == rec.diff_ids
    assert norm["Config"]["Cmd"] == ["serve"]

    assert dockerio.remove(f"{repo}:b") is True
    assert dockerio.remove(f"{repo}:b") is False
    assert dockerio.image_inspect(f"{repo}:b") is None


@pytest.mark.docker
def test_build_failure_names_the_step(tmp_path: Path, repo: str) -> None:
    ctx = _context(tmp_path, "FROM scratch\nCOPY hello.txt /a\nCOPY missing.txt /b\n", {"hello.txt": "hi"})
    with pytest.raises(BuilderError) as exc:
        dockerbuild.build(ctx, tag=f"{repo}:a", cleanup=True)
    msg = str(exc.value)
    assert "Step 3/3 : COPY missing.txt /b" in msg
    assert "missing.txt" in msg and "\n" not in msg
    assert dockerio.image_inspect(f"{repo}:a") is None


@pytest.mark.docker
def test_missing_image_and_bad_archive(tmp_path: Path) -> None:
    ref = f"builder-test-absent-{uuid.uuid4().hex[:10]}:none"
    assert dockerio.image_inspect(ref) is None
    assert dockerio.image_exists(ref) is False
    with pytest.raises(BuilderError, match="no such image"):
        b"".join(dockerio.save(ref))
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not an archive" * 100)
    with pytest.raises(BuilderError, match="docker load"):
        dockerio.load(junk)
    with pytest.raises(BuilderError, match="no such archive"):
        dockerio.load(tmp_path / "absent.tar")


def _import_probe(docker_host: str | None) -> dict[str, bool]:
    code = (
        "import json, sys\n"
        "from builder.foundation import dockerio\n"
        "dockerio._import_docker()\n"
        "import docker.transport as t\n"
        "out = {'paramiko_loaded': 'paramiko' in sys.modules, 'ssh_transport': hasattr(t, 'SSHHTTPAdapter')}\n"
        "import paramiko  # still importable afterwards\n"
        "out['paramiko_after'] = 'paramiko' in sys.modules\n"
        "print(json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    if docker_host:
        env["DOCKER_HOST"] = docker_host
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    out: dict[str, bool] = json.loads(r.stdout)
    return out


def test_the_sdk_loads_without_paramiko_unless_the_engine_is_reached_over_ssh() -> None:
    pytest.importorskip("paramiko")
    assert _import_probe(None) == {"paramiko_loaded": False, "ssh_transport": False, "paramiko_after": True}
    assert _import_probe("unix:///var/run/docker.sock")["paramiko_loaded"] is False
    # an ssh:// engine (a documentation address; nothing is contacted): the SDK's ssh transport is there
    assert _import_probe("ssh://spark@192.0.2.10") == {"paramiko_loaded": True, "ssh_transport": True,
                                                      "paramiko_after": True}


def _pause_elf() -> bytes:
    """A static x86-64 Linux program of 129 bytes that waits in pause(2) until it is killed: a RUN step
    that never ends, for an image FROM scratch (no shell, no libc, nothing pulled)."""
    base, code = 0x400000, bytes.fromhex("b822000000" "0f05" "ebf7")  # loop: mov eax, 34 (pause); syscall; jmp loop
    size = 64 + 56 + len(code)
    ehdr = (b"\x7fELF\x02\x01\x01" + bytes(9)
            + (2).to_bytes(2, "little") + (62).to_bytes(2, "little") + (1).to_bytes(4, "little")
            + (base + 120).to_bytes(8, "little") + (64).to_bytes(8, "little") + bytes(8)
            + bytes(4) + (64).to_bytes(2, "little") + (56).to_bytes(2, "little") + (1).to_bytes(2, "little")
            + bytes(6))
    phdr = ((1).to_bytes(4, "little") + (5).to_bytes(4, "little") + bytes(8)
            + base.to_bytes(8, "little") + base.to_bytes(8, "little")
            + size.to_bytes(8, "little") + size.to_bytes(8, "little") + (0x1000).to_bytes(8, "little"))
    return ehdr + phdr + code


def _made_by(marker: str) -> tuple[list[str], list[str]]:
    """The images (with intermediates) and containers that carry the label ``marker``."""
    images = subprocess.run(["docker", "images", "-a", "-q", "--no-trunc", "-f", f"label={marker}"],
                            capture_output=True, text=True, check=True).stdout.split()
    containers = subprocess.run(["docker", "ps", "-a", "-q", "--no-trunc", "-f", f"label={marker}"],
                                capture_output=True, text=True, check=True).stdout.split()
    return images, containers


@pytest.mark.docker
@pytest.mark.parametrize("interrupt", ["SIGINT while reading", "KeyboardInterrupt in on_log", "a failing step",
                                       "KeyboardInterrupt after a COPY step"])
def test_an_interrupted_or_failed_build_leaves_no_image_or_container(tmp_path: Path, interrupt: str) -> None:
    """Interrupted while its RUN step runs (SIGINT to the main thread, as Ctrl-C sends it, arriving while
    the build's stream is read; or KeyboardInterrupt raised by the log callback), interrupted right after an
    early COPY step (only committed images so far), or failing at its last step, a build removes every
    image and container it made: no `<none>` image is left."""
    if dockerio.engine_platform() != "linux/amd64":
        pytest.skip("the waiting program is x86-64 code")
    marker = f"builder.test.run={uuid.uuid4().hex}"  # a LABEL step: every image after it carries it
    last = "COPY missing.txt /c\n" if interrupt == "a failing step" else 'RUN ["/pause"]\n'
    ctx = _context(tmp_path, f"FROM scratch\nLABEL {marker}\nCOPY a.txt /a\nCOPY pause /pause\n{last}",
                   {"a.txt": "a"})
    (ctx / "pause").write_bytes(_pause_elf())
    (ctx / "pause").chmod(0o755)
    dangling = ["docker", "images", "-q", "--no-trunc", "-f", "dangling=true", "-f", f"label={marker}"]
    seen: list[str] = []
    step = [""]

    def on_log(line: str) -> None:
        seen.append(line)
        if line.startswith("Step "):
            step[0] = line
        if interrupt == "KeyboardInterrupt after a COPY step" and re.match(r"^ ---> [0-9a-f]{12}$", line) and (
                "COPY pause" in step[0]):  # an early step: only committed images so far, no container
            raise KeyboardInterrupt
        if line.startswith(" ---> Running in ") and " : RUN " in step[0]:  # the RUN step's container runs
            made, running = _made_by(marker)
            assert len(made) >= 3 and running, (made, running)  # (what there is to remove)
            if interrupt == "KeyboardInterrupt in on_log":
                raise KeyboardInterrupt
            main = threading.main_thread().ident
            assert main is not None
            threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT)).start()

    # a bound on a hang, not a speed test: an interrupt that never arrives leaves /pause running for ever,
    # so after 5 minutes its container is killed, and the build's failure fails the test
    bound = threading.Timer(300, lambda: [subprocess.run(["docker", "kill", c], capture_output=True)
                                          for c in _made_by(marker)[1]])
    bound.start()
    try:
        with pytest.raises(BuilderError if interrupt == "a failing step" else KeyboardInterrupt):
            dockerbuild.build(ctx, nocache=True, on_log=on_log)
    finally:
        bound.cancel()
    assert sum(1 for ln in seen if re.match(r"^ ---> [0-9a-f]{12}$", ln)) >= 3, seen  # LABEL, COPY, COPY
    # (each of those steps committed an image the build must remove)
    time.sleep(1)  # (anything the engine still committed would show by now)
    assert _made_by(marker) == ([], [])
    assert subprocess.run(dangling, capture_output=True, text=True, check=True).stdout.split() == []
