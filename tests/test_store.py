"""The content-addressed store: nothing unverified goes in or comes out; a killed writer leaves no entry.

Real files, real processes (a writer is SIGKILLed mid-write), real git for a tree export.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.errors import ResolveError, VerifyError
from builder.foundation.canon import sha256_tree
from builder.store.content import LIVE, Store, live_marker

DATA = b"the bytes the lock names\n" * 100
SHA = hashlib.sha256(DATA).hexdigest()


def visible(store: Store) -> list[str]:
    """Every entry a reader could see (objects and trees)."""
    out = []
    for folder in (store.objects, store.trees):
        if folder.is_dir():
            out += [f"{folder.name}/{p.name}" for p in folder.iterdir()]
    return sorted(out)


def tmp_entries(store: Store) -> list[str]:
    return sorted(p.name for p in store.tmp.iterdir()) if store.tmp.is_dir() else []


def test_put_file_verifies_and_stores_read_only(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    src = tmp_path / "in.bin"
    src.write_bytes(DATA)
    p = store.put_file(src, SHA, "files.x")
    assert p == store.object_path(SHA) and p.read_bytes() == DATA
    assert (p.stat().st_mode & 0o777) == 0o444
    assert store.verified(SHA, "files.x") == p
    assert store.put_file(src, SHA, "files.x") == p  # already there: verified, not rewritten
    assert tmp_entries(store) == []


def test_put_refuses_bytes_that_do_not_match(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    src = tmp_path / "in.bin"
    src.write_bytes(DATA + b"x")
    with pytest.raises(VerifyError) as e:
        store.put_file(src, SHA, "sources.engine.patches[0]")
    msg = str(e.value)
    assert "\n" not in msg and "sources.engine.patches[0]" in msg and "do not match the lock" in msg
    assert visible(store) == [] and tmp_entries(store) == []


def test_a_corrupted_object_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    src = tmp_path / "in.bin"
    src.write_bytes(DATA)
    p = store.put_file(src, SHA, "files.x")
    p.chmod(0o644)
    with open(p, "r+b") as f:  # one flipped byte, same size
        f.seek(10)
        f.write(b"X")
    with pytest.raises(VerifyError, match=r"files\.x: store entry [0-9a-f]{16} is corrupt"):
        store.verified(SHA, "files.x")
    # putting the good bytes again does not silently trust the corrupt entry either
    with pytest.raises(VerifyError, match="corrupt"):
        store.put_file(src, SHA, "files.x")
    with pytest.raises(ResolveError, match="not in the store"):
        store.verified("0" * 64, "files.y")


def test_a_killed_writer_leaves_no_entry_and_the_next_writer_cleans_up(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    marker = tmp_path / "marker"
    sha = hashlib.sha256(b"never finished").hexdigest()
    proc = subprocess.Popen([sys.executable, "-m", "tests.lib.storeput", str(store.root), "stall", str(marker), sha])
    try:
        for _ in range(600):
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert marker.exists(), "the writer never started writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    # what it wrote sits in staging only; no entry is visible
    assert visible(store) == []
    left = tmp_entries(store)
    assert left and all(n.startswith(f"stage-{proc.pid}-") for n in left)
    assert any((store.tmp / n / "blob").exists() for n in left)
    # the next writer (another process would do the same) removes the dead writer's staging
    src = tmp_path / "in.bin"
    src.write_bytes(DATA)
    store.put_file(src, SHA, "files.x")
    assert tmp_entries(store) == []
    assert visible(store) == [f"objects/{SHA}"]


def test_staging_of_a_live_writer_is_left_alone(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    src = tmp_path / "in.bin"
    src.write_bytes(DATA)
    with store.staging() as st:  # ours, in use (a download or an image context being assembled)
        (st / "part").write_bytes(b"x")
        store.put_file(src, SHA, "files.x")  # a writer cleans tmp, but not what a live process owns
        assert (st / "part").exists()
    assert tmp_entries(store) == []


def test_a_live_marker_decides_over_the_pid_in_the_name(tmp_path: Path) -> None:
    """A staging folder with a LIVE marker is kept while a process holds the marker's flock (a child
    here, in a folder named for a pid that does not run) and removed once nobody does (named for a pid
    that runs: this test's, as a reused pid would be)."""
    store = Store(tmp_path / "store")
    held = store.tmp / "push-999999999-held"
    free = store.tmp / f"push-{os.getpid()}-free"
    for d in (held, free):
        d.mkdir(parents=True)
        (d / "image").write_bytes(b"x" * 4096)
    with live_marker(free):
        pass
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(held / LIVE)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with store.locked():
            store.clean_tmp()
        assert (held / "image").exists() and not free.exists()
    finally:
        proc.kill()
        proc.wait(30)
    with store.locked():
        store.clean_tmp()
    assert tmp_entries(store) == []


def _export(files: dict[str, bytes]):  # type: ignore[no-untyped-def]
    def export(d: Path) -> None:
        for rel, data in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(data)

    return export


def test_put_tree_checks_the_tree_hash(tmp_path: Path) -> None:
    files = {"build.zig": b"const std = @import(\"std\");\n", "src/main.zig": b"pub fn main() void {}\n"}
    ref = tmp_path / "ref"
    ref.mkdir()
    _export(files)(ref)
    good = sha256_tree(ref)
    store = Store(tmp_path / "store")
    with pytest.raises(VerifyError) as e:
        store.put_tree("1" * 64, _export(files), "sources.engine")
    assert "\n" not in str(e.value) and "sources.engine: exported tree does not match the lock" in str(e.value)
    assert visible(store) == [] and tmp_entries(store) == []
    # an export that fails half-way leaves nothing either
    def broken(d: Path) -> None:
        (d / "half").write_bytes(b"x")
        raise ResolveError("sources.engine: the mirror went away")

    with pytest.raises(ResolveError):
        store.put_tree(good, broken, "sources.engine")
    assert visible(store) == [] and tmp_entries(store) == []
    tree = store.put_tree(good, _export(files), "sources.engine")
    assert tree == store.tree_path(good) and (tree / "src" / "main.zig").read_bytes() == files["src/main.zig"]
    assert store.verified_tree(good, "sources.engine") == tree
    (tree / "src" / "main.zig").write_bytes(b"pub fn main() void { unreachable; }\n")
    with pytest.raises(VerifyError, match="sources.engine: store tree .* is corrupt"):
        store.verified_tree(good, "sources.engine")


def test_wheel_from_a_wheelhouse_is_verified(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    wh = tmp_path / "wheelhouse"
    wh.mkdir()
    name = "demo-1.0-py3-none-any.whl"
    (wh / name).write_bytes(DATA + b"tampered")
    with pytest.raises(VerifyError, match="toolchains.w: bytes do not match the lock"):
        store.fetch_wheel("demo", "1.0", name, SHA, "toolchains.w", [wh], offline=True)
    assert visible(store) == []
    (wh / name).write_bytes(DATA)
    assert store.fetch_wheel("demo", "1.0", name, SHA, "toolchains.w", [wh], offline=True).read_bytes() == DATA
    with pytest.raises(ResolveError) as e:
        store.fetch_wheel("other", "1.0", "other-1.0-py3-none-any.whl", "2" * 64, "toolchains.o",
                          [wh], offline=True)
    assert "--offline" in str(e.value) and "\n" not in str(e.value)


def _wheel(path: Path, payload: bytes) -> str:
    """A real wheel (a zip with its dist-info) of the `demo` distribution at ``path``; its sha256."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("demo/__init__.py", payload)
        z.writestr("demo-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def network_refused(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Outgoing connections refused: in this process every socket connect raises, and a child (pip)
    is sent to an index and proxies on a loopback port where nothing listens, without retries."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, closed)
    monkeypatch.setenv("PIP_INDEX_URL", f"{closed}/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)

    def refuse(*_a: object, **_k: object) -> None:
        raise OSError("network refused by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield


WHEEL = "demo-1.0-py3-none-any.whl"


def test_a_locked_wheel_in_the_wheelhouse_is_taken_with_the_network_refused(
    tmp_path: Path, network_refused: None
) -> None:
    """Not --offline either: a wheel the wheelhouse holds is taken from it, checked against the lock."""
    wh = tmp_path / "wheelhouse"
    wh.mkdir()
    sha = _wheel(wh / WHEEL, b"v = 1\n")
    store = Store(tmp_path / "store")
    got = store.fetch_wheel("demo", "1.0", WHEEL, sha, "toolchains.w", [wh], offline=False,
                            pip_cache=tmp_path / "no-pip-cache")
    assert got.read_bytes() == (wh / WHEEL).read_bytes() and got == store.object_path(sha)


def test_a_locked_wheel_in_pips_cache_is_taken_with_the_network_refused(
    tmp_path: Path, network_refused: None
) -> None:
    """pip's HTTP cache keeps the bodies it downloaded (`http-v2/a/b/c/d/e/KEY.body`): the one whose
    bytes are the lock's is taken; another build of the same wheel and a body that is no zip are not."""
    cache = tmp_path / "pip-cache"
    bodies = cache / "http-v2" / "a" / "b" / "c" / "d" / "e"
    bodies.mkdir(parents=True)
    _wheel(bodies / "0other.body", b"v = 2\n")  # (same dist-info, other bytes: not the locked wheel)
    (bodies / "1page.body").write_bytes(b"<html>the simple index page</html>")
    sha = _wheel(bodies / "2wheel.body", b"v = 1\n")
    store = Store(tmp_path / "store")
    got = store.fetch_wheel("demo", "1.0", WHEEL, sha, "toolchains.w", [tmp_path / "empty"], offline=False,
                            pip_cache=cache)
    assert got.read_bytes() == (bodies / "2wheel.body").read_bytes()


def test_a_wheel_found_nowhere_names_the_one_command_that_gets_it(tmp_path: Path, network_refused: None) -> None:
    """Offline: one line naming where it looked and the exact `pip download` line for the wheelhouse;
    online with the network refused: pip fails, and the line says so with the same command."""
    wh = tmp_path / "proj" / ".cache" / "wheelhouse"
    store = Store(tmp_path / "store")
    line = f"python3 -m pip download --no-deps --only-binary=:all: -d {wh} demo==1.0"
    with pytest.raises(ResolveError) as e:
        store.fetch_wheel("demo", "1.0", WHEEL, SHA, "toolchains.w", [wh], offline=True, pip_cache=tmp_path / "pc")
    msg = str(e.value)
    assert msg.startswith(f"toolchains.w: {WHEEL} is not in the store, a wheelhouse or pip's cache ({wh}, ")
    assert msg.endswith(f"put it in the wheelhouse: `{line}`") and "\n" not in msg, msg
    with pytest.raises(ResolveError) as e:
        store.fetch_wheel("demo", "1.0", WHEEL, SHA, "toolchains.w", [wh], offline=False, pip_cache=tmp_path / "pc")
    msg = str(e.value)
    assert msg.startswith(f"toolchains.w: pip could not download {WHEEL}") and msg.endswith(f"`{line}`"), msg
    assert "\n" not in msg and visible(store) == []


def test_fetch_url_from_project_path_file_url_and_loopback_http(tmp_path: Path) -> None:
    """One fetch step for toolchains and files: a project path, file://, or a real HTTP download."""
    root = tmp_path / "proj"
    (root / "files").mkdir(parents=True)
    (root / "files" / "a.bin").write_bytes(DATA)
    store = Store(tmp_path / "store")
    assert store.fetch_url("files/a.bin", SHA, "files.a", root=root, offline=True).read_bytes() == DATA
    store2 = Store(tmp_path / "store2")
    url = (root / "files" / "a.bin").as_uri()
    assert store2.fetch_url(url, SHA, "files.a", root=root, offline=True).read_bytes() == DATA
    with pytest.raises(ResolveError, match="no such file"):
        Store(tmp_path / "s3").fetch_url("files/missing.bin", SHA, "files.m", root=root, offline=False)

    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(root / "files"))  # noqa: E731
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        http_url = f"http://127.0.0.1:{srv.server_address[1]}/a.bin"
        store4 = Store(tmp_path / "s4")
        with pytest.raises(ResolveError, match="--offline"):
            store4.fetch_url(http_url, SHA, "files.a", root=root, offline=True)
        assert store4.fetch_url(http_url, SHA, "files.a", root=root, offline=False).read_bytes() == DATA
        with pytest.raises(VerifyError):
            Store(tmp_path / "s5").fetch_url(http_url, "0" * 64, "files.a", root=root, offline=False)
    finally:
        srv.shutdown()
    assert visible(Store(tmp_path / "s5")) == []
