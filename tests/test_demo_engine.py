"""The demo engine: its git bundle, its patch, its static reproducible build, and the demo image.

Unmarked tests use real git and the pinned Zig (the ziglang wheel) on this machine; the ``docker``
tests build images/demo from nothing on the engine, with the network off, twice.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ziglang

from builder.foundation import dockerbuild, dockerio
from builder.image import layers
from tests.lib import dockerlib

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "engine-src" / "demo-engine.bundle"
PLAIN = ROOT / "engine-src" / "demo-engine"
PATCH = ROOT / "patches" / "demo" / "0001-version-suffix-patched.patch"
RECIPE = ROOT / "images" / "demo"

GIT_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
}


def git(*args: str, cwd: Path | None = None) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, env=GIT_ENV, check=True, capture_output=True, text=True
    ).stdout.strip()


def zig_dir() -> Path:
    return Path(ziglang.__file__).resolve().parent


def checkout(dest: Path, *, patched: bool) -> tuple[Path, str, int]:
    """Clone the bundle (by path, as the lock does), optionally apply the patch; drop .git.

    Returns (tree, main commit, commit time)."""
    git("clone", "-q", "--branch", "main", str(BUNDLE), str(dest))
    commit = git("rev-parse", "HEAD", cwd=dest)
    epoch = int(git("log", "-1", "--format=%ct", cwd=dest))
    if patched:
        git("apply", "--check", str(PATCH), cwd=dest)
        git("apply", str(PATCH), cwd=dest)
    shutil.rmtree(dest / ".git")
    return dest, commit, epoch


def compile_engine(src: Path, out: Path, cache: Path, *, target: str, commit: str) -> Path:
    """What `zig build` does for the engine, without the build runner: one `zig build-exe`."""
    opts = src / "build_options.zig"
    opts.write_text(f'pub const commit: []const u8 = "{commit}";\npub const version: []const u8 = "0.1.0";\n')
    out.mkdir(parents=True, exist_ok=True)
    exe = out / "demo-engine"
    env = {**os.environ, "ZIG_GLOBAL_CACHE_DIR": str(cache / "global")}
    subprocess.run(
        [
            str(zig_dir() / "zig"), "build-exe", "-OReleaseSmall", "-target", target, "-fstrip",
            "-fsingle-threaded", "-static", "--cache-dir", str(cache / "local"), f"-femit-bin={exe}",
            "--dep", "build_options", "-Mroot=src/main.zig", "-Mbuild_options=build_options.zig",
        ],
        cwd=src, env=env, check=True, capture_output=True,
    )  # fmt: skip
    opts.unlink()
    return exe


def elf_facts(path: Path) -> tuple[int, set[int]]:
    """(e_machine, program header types) of a 64-bit little-endian ELF."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1
    machine = struct.unpack_from("<H", data, 18)[0]
    phoff = struct.unpack_from("<Q", data, 32)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    types = {struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)}
    return machine, types


PT_DYNAMIC, PT_INTERP = 2, 3
EM_X86_64, EM_AARCH64 = 62, 183


# --------------------------------------------------------------------------- the bundle and the patch


def test_bundle_is_a_tagged_git_repository(tmp_path: Path) -> None:
    git("bundle", "verify", str(BUNDLE))
    heads = dict(reversed(line.split()) for line in git("bundle", "list-heads", str(BUNDLE)).splitlines())
    assert set(heads) == {"HEAD", "refs/heads/main", "refs/tags/v0.1.0"}
    assert heads["HEAD"] == heads["refs/heads/main"]
    tree, commit, epoch = checkout(tmp_path / "src", patched=False)
    assert commit == heads["refs/heads/main"] and len(commit) == 40
    assert epoch == 1_735_776_000  # fixed committer date: the same commit on every machine
    # The clone is exactly the plain source folder that make-bundle.sh commits.
    plain = sorted(p.relative_to(PLAIN).as_posix() for p in PLAIN.rglob("*") if p.is_file())
    cloned = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file())
    assert cloned == [p for p in plain if not p.startswith(("zig-out/", ".zig-cache/"))]
    for rel in cloned:
        assert (tree / rel).read_bytes() == (PLAIN / rel).read_bytes(), rel


def test_bundle_history_and_tag(tmp_path: Path) -> None:
    git("clone", "-q", str(BUNDLE), str(tmp_path / "r"))
    log = git("log", "--format=%H %cI %s", "main", cwd=tmp_path / "r").splitlines()
    assert len(log) == 2
    assert [line.split()[1] for line in log] == ["2025-01-02T00:00:00Z", "2025-01-01T00:00:00Z"]
    assert git("rev-parse", "v0.1.0^{commit}", cwd=tmp_path / "r") == log[0].split()[0]
    assert git("cat-file", "-t", "v0.1.0", cwd=tmp_path / "r") == "tag"


def test_make_bundle_is_reproducible_and_up_to_date() -> None:
    out = subprocess.run(
        ["bash", str(ROOT / "engine-src" / "make-bundle.sh"), "--check"],
        capture_output=True,
        text=True,
        env=GIT_ENV,
    )
    assert out.returncode == 0, out.stderr
    assert "up to date" in out.stdout


def test_patch_applies_and_marks_the_version(tmp_path: Path) -> None:
    tree, _, _ = checkout(tmp_path / "src", patched=True)
    assert 'pub const version_suffix = "+patched";' in (tree / "src" / "main.zig").read_text()
    text = PATCH.read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "diff --git a/src/main.zig b/src/main.zig" in text


# --------------------------------------------------------------------------- the engine, built here


@pytest.fixture(scope="module")
def local_engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    base = tmp_path_factory.mktemp("engine")
    tree, commit, _ = checkout(base / "src", patched=True)
    exe = compile_engine(tree, base / "out", base / "cache", target="x86_64-linux-musl", commit=commit)
    return exe, commit


@pytest.mark.build
def test_static_build_is_byte_identical(local_engine: tuple[Path, str], tmp_path: Path) -> None:
    exe, commit = local_engine
    machine, types = elf_facts(exe)
    assert machine == EM_X86_64
    assert PT_INTERP not in types and PT_DYNAMIC not in types  # fully static
    # Another checkout at another path with a cold cache gives the same bytes.
    tree, _, _ = checkout(tmp_path / "elsewhere" / "src", patched=True)
    again = compile_engine(
        tree, tmp_path / "out", tmp_path / "cache", target="x86_64-linux-musl", commit=commit
    )
    assert again.read_bytes() == exe.read_bytes()


@pytest.mark.build
def test_aarch64_build(tmp_path: Path) -> None:
    tree, commit, _ = checkout(tmp_path / "src", patched=True)
    exe = compile_engine(
        tree, tmp_path / "out", tmp_path / "cache", target="aarch64-linux-musl", commit=commit
    )
    machine, types = elf_facts(exe)
    assert machine == EM_AARCH64
    assert PT_INTERP not in types and PT_DYNAMIC not in types


@pytest.mark.build
def test_engine_unit_tests(tmp_path: Path) -> None:
    tree, commit, _ = checkout(tmp_path / "src", patched=False)
    (tree / "build_options.zig").write_text(
        f'pub const commit: []const u8 = "{commit}";\npub const version: []const u8 = "0.1.0";\n'
    )
    out = subprocess.run(
        [
            str(zig_dir() / "zig"), "test", "--cache-dir", str(tmp_path / "local"),
            "--dep", "build_options", "-Mroot=src/main.zig", "-Mbuild_options=build_options.zig",
        ],
        cwd=tree, env={**os.environ, "ZIG_GLOBAL_CACHE_DIR": str(tmp_path / "global")},
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "passed" in out.stderr or out.stderr == ""


@pytest.mark.build
def test_version_and_capabilities(local_engine: tuple[Path, str]) -> None:
    exe, commit = local_engine
    v = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True)
    assert v.stdout == f"demo-engine 0.1.0+patched (commit {commit})\n"
    c = subprocess.run([str(exe), "capabilities", "--json"], capture_output=True, text=True, check=True)
    caps = json.loads(c.stdout)
    assert caps["commit"] == commit and caps["version"] == "0.1.0+patched"
    assert set(caps["serve_flags"]) == {"--host", "--port", "--served-name"}
    assert {"TF_RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(caps["env"])
    bad = subprocess.run([str(exe), "nonsense"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command" in bad.stderr
    bad_port = subprocess.run([str(exe), "serve", "--port", "x"], capture_output=True, text=True)
    assert bad_port.returncode == 2 and "BadPort" in bad_port.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(port: int, path: str, body: dict[str, Any] | bytes | None = None) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method="POST" if data else "GET"
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_health(port: int, tries: int = 100) -> dict[str, Any]:
    for _ in range(tries):
        try:
            status, body = http(port, "/health")
            if status == 200:
                return dict(body)
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"no /health on 127.0.0.1:{port}")


def check_api(port: int, served: str) -> None:
    status, models = http(port, "/v1/models")
    assert status == 200 and models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [served]
    s1, c1 = http(port, "/v1/completions", {"model": served, "prompt": "hello", "max_tokens": 1})
    s2, c2 = http(port, "/v1/completions", {"model": served, "prompt": "hello", "max_tokens": 1})
    assert s1 == s2 == 200 and c1 == c2
    assert c1["model"] == served and c1["choices"][0]["text"] == "ok"
    assert c1["usage"]["completion_tokens"] == 1
    s3, chat = http(
        port, "/v1/chat/completions", {"model": served, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert s3 == 200 and chat["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    assert http(port, "/v1/completions", b"not json")[0] == 400
    assert http(port, "/nope")[0] == 404


@pytest.mark.build
def test_serve_answers_like_tensorfold(local_engine: tuple[Path, str]) -> None:
    exe, _ = local_engine
    port = free_port()
    env = {"TF_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    proc = subprocess.Popen(
        [str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), "--served-name", "demo-lane"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        health = wait_health(port)
        assert health == {
            "status": "ok",
            "rank": 1,
            "world_size": 2,
            "master_addr": "127.0.0.1",
            "master_port": 29500,
            "served_name": "demo-lane",
        }
        check_api(port, "demo-lane")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()


# --------------------------------------------------------------------------- the demo image (Docker)


def assemble_context(dest: Path) -> tuple[Path, str, int]:
    """The build context as `builder image demo` lays it out: Dockerfile, zig/, src/."""
    shutil.copytree(RECIPE, dest)

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(
        zig_dir(),
        dest / "zig",
        ignore=shutil.ignore_patterns("__pycache__", "__init__.py", "__main__.py"),
        copy_function=link_or_copy,
    )
    _, commit, epoch = checkout(dest / "src", patched=True)
    return dest, commit, epoch


class DemoImage:
    def __init__(self, ctx: Path, commit: str, epoch: int, repo: str) -> None:
        self.ctx, self.commit, self.epoch, self.repo = ctx, commit, epoch, repo
        self.labels = {
            "org.opencontainers.image.revision": commit,
            "org.opencontainers.image.version": "0.1.0",
        }
        self.log: list[str] = []

    def build(self, *, raw_tag: str, norm_tag: str, workdir: Path) -> tuple[str, layers.SpooledImage]:
        # in its turn with `builder image`'s builds of the same recipe: they take the engine's newest
        # image for a step as its cache, and this build removes what it made
        with dockerbuild.turn(self.ctx):
            raw = dockerbuild.build(
                self.ctx,
                buildargs={"ENGINE_COMMIT": self.commit, "ENGINE_VERSION": "0.1.0"},
                tag=f"{self.repo}:{raw_tag}",
                nocache=True,
                cleanup=True,
                on_log=self.log.append,
            )
        record = layers.normalize_and_load(
            f"{self.repo}:{raw_tag}",
            source_date_epoch=self.epoch,
            labels=self.labels,
            repo_tags=[f"{self.repo}:{norm_tag}"],
            workdir=workdir,
        )
        return raw, record

    def remove(self, *tags: str) -> None:
        with dockerbuild.turn(self.ctx):
            for t in tags:
                dockerio.remove(f"{self.repo}:{t}", force=True)


@pytest.fixture(scope="module")
def demo_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DemoImage, layers.SpooledImage]]:
    base = tmp_path_factory.mktemp("demo-image")
    ctx, commit, epoch = assemble_context(base / "ctx")
    image = DemoImage(ctx, commit, epoch, f"builder-test-demo-{uuid.uuid4().hex[:10]}")
    try:
        _, record = image.build(raw_tag="raw1", norm_tag="one", workdir=base / "w1")
        yield image, record
    finally:
        image.remove("raw1", "one", "raw2", "two")


@pytest.mark.docker
def test_demo_image_runs_version(demo_image: tuple[DemoImage, layers.SpooledImage]) -> None:
    image, record = demo_image
    assert any('RUN ["/zig/zig", "run"' in line for line in image.log)
    result = dockerlib.run(f"{image.repo}:one", ["--version"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"demo-engine 0.1.0+patched (commit {image.commit})\n"
    assert dockerio.image_id(f"{image.repo}:one") == record.image_id


@pytest.mark.docker
def test_demo_image_shape(demo_image: tuple[DemoImage, layers.SpooledImage]) -> None:
    image, record = demo_image
    info = dockerio.image_inspect(record.image_id)
    assert info is not None
    assert info["Config"]["Entrypoint"] == ["/usr/local/bin/demo-engine"]
    assert info["Config"]["Cmd"] == ["serve", "--port", "8080"]
    assert set(info["Config"]["ExposedPorts"]) == {"8080/tcp"}
    assert info["Config"]["Labels"] == image.labels
    assert info["Created"] == "2025-01-02T00:00:00Z"
    assert info["RootFS"]["Layers"] == record.diff_ids and len(record.diff_ids) == 1
    assert info["Architecture"] == dockerio.engine_platform().split("/")[1]


@pytest.mark.docker
def test_demo_image_serves_health(demo_image: tuple[DemoImage, layers.SpooledImage]) -> None:
    image, _ = demo_image
    cid = dockerlib.start(
        f"{image.repo}:one",
        ["serve", "--port", "8080", "--served-name", "demo"],
        env={"TF_RANK": "0", "WORLD_SIZE": "2"},
        publish={8080: None},
        bind_address="127.0.0.1",
    )
    try:
        port = dockerlib.published_port(cid, 8080)
        health = wait_health(port)
        assert health["status"] == "ok" and health["rank"] == 0 and health["world_size"] == 2
        check_api(port, "demo")
    finally:
        dockerlib.stop(cid)


@pytest.mark.docker
def test_demo_image_rebuilds_to_the_same_id(
    demo_image: tuple[DemoImage, layers.SpooledImage], tmp_path: Path
) -> None:
    image, first = demo_image
    # From nothing: the first build's intermediates are gone (cleanup) and nothing is cached.
    image.remove("raw1")
    raw, second = image.build(raw_tag="raw2", norm_tag="two", workdir=tmp_path / "w2")
    assert second.image_id == first.image_id
    assert second.diff_ids == first.diff_ids
    assert second.config == first.config
    assert dockerio.image_id(f"{image.repo}:two") == first.image_id
    # And a deterministic `docker save` of it gives the same archive bytes twice.
    _, d1 = layers.save_archive(f"{image.repo}:two", tmp_path / "a.tar", repo_tags=[f"{image.repo}:two"])
    _, d2 = layers.save_archive(f"{image.repo}:two", tmp_path / "b.tar", repo_tags=[f"{image.repo}:two"])
    assert d1 == d2
