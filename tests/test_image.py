"""`builder image`: the demo lane built from a copy of the shipped project, and every bad input refused.

Unmarked tests need no Docker engine (context assembly, labels, no engine). The ``docker`` tier
builds the shipped demo lane once per session in a copy of the project with its own store
(``built``), then checks tags, labels, the no-op, ``--check-reproducible`` and ``docker run``;
and refuses a corrupt store entry, a wrong wheel, a patch that no longer applies, a platform the
engine is not, and a recipe that needs the network (the build runs with network none).
Tags the tests create are removed afterwards (a tag that existed before the session is restored).

The ziglang wheel comes from a wheelhouse: $BUILDER_WHEELHOUSE or <project>/.cache/wheelhouse
(CI fills it once), else the developer's store, else one `pip download` per session.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest
import ziglang

from builder.foundation import dockerbuild, dockerio
from builder.image import build as core
from builder.image.imagerecord import tag_for
from builder.image.plan import make_plan
from builder.inputs.pins import load_pins
from builder.lock.lockfile import load_lock
from builder.store.content import Store
from tests.lib import dockerlib, factory
from tests.lib.dockerlib import Tags
from tests.lib.fleetlib import docker_available
from tests.lib.shipped import (
    NO_DOCKER,
    PATCH_REL,
    Result,
    builder,
    copy_project,
    plan_of,
    relock,
)

ARCH = {"amd64": ("x86_64-linux-musl", "linux/arm64", "aarch64-linux-musl"),
        "arm64": ("aarch64-linux-musl", "linux/amd64", "x86_64-linux-musl")}


# --------------------------------------------------------------------------- session fixtures




@dataclass
class Built:
    root: Path
    store: Path
    env: dict[str, str]
    first: Result
    rec: dict[str, Any]
    plan: dict[str, Any]


@pytest.fixture(scope="session")
def session_tags() -> Iterator[Tags]:
    tags = Tags()
    yield tags
    if docker_available():
        tags.restore()


@pytest.fixture
def tags() -> Iterator[Tags]:
    t = Tags()
    yield t
    t.restore()


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory, wheelhouse: Path, session_tags: Tags) -> Built:
    """The shipped demo lane, built once per session from a copy of the project with its own store."""
    if not docker_available():
        pytest.skip("no Docker engine")
    base = tmp_path_factory.mktemp("built")
    root = copy_project(base / "proj")
    store = base / "store"
    env = {"BUILDER_WHEELHOUSE": str(wheelhouse), "HOME": str(base)}
    plan = plan_of(root)
    session_tags.watch(tag_for("demo", plan["input_address"]))
    session_tags.watch(f"builder-check/demo:{plan['input_address'][:32]}")
    first = builder(root, "image", "demo", "--json", store=store, env=env)
    assert first.rc == 0, first.err
    return Built(root, store, env, first, first.json(), plan)


def fresh(tmp_path: Path, wheelhouse: Path) -> tuple[Path, Path, dict[str, str]]:
    root = copy_project(tmp_path / "proj")
    return root, tmp_path / "store", {"BUILDER_WHEELHOUSE": str(wheelhouse)}


def nothing_half_written(store: Path) -> None:
    assert not (store / "images").exists() or list((store / "images").iterdir()) == []
    assert not (store / "tmp").exists() or list((store / "tmp").iterdir()) == []


def one_line_refusal(r: Result, rc: int, *needles: str) -> None:
    assert r.rc == rc, r.err
    errors = [ln for ln in r.err_lines if ln.startswith("error:")]
    assert len(errors) == 1, r.err  # one line; progress lines (indented) may precede it
    assert all(ln == errors[0] or ln.startswith("  ") for ln in r.err_lines), r.err
    assert "Traceback" not in r.err
    for n in needles:
        assert n in r.err, r.err


# --------------------------------------------------------------------------- no engine needed


def test_labels_never_carry_credentials(tmp_path: Path) -> None:
    root = copy_project(tmp_path / "proj")
    pins = load_pins(root / "pins.toml")
    lock = load_lock(root / "pins.lock")
    p = make_plan(pins, lock, "demo", root)
    for url, shown in [
        ("https://user:s3cr3t@git.example.invalid/org/engine.git", "https://git.example.invalid/org/engine.git"),
        ("https://x:pa@ss@git.example.invalid/e.git?token=abc#frag", "https://git.example.invalid/e.git"),
        ("ssh://git@git.example.invalid/org/engine", "ssh://git.example.invalid/org/engine"),
        ("engine-src/demo-engine.bundle", "engine-src/demo-engine.bundle"),
    ]:
        closure = json.loads(json.dumps(p.closure))
        closure["sources"]["demo-engine"]["url"] = url
        labels = core.labels_for(type(p)(name=p.name, closure=closure, address=p.address, lock_hash=p.lock_hash),
                                 lock, pins)
        assert labels["org.opencontainers.image.source"] == shown
        assert "s3cr3t" not in json.dumps(labels) and "token" not in json.dumps(labels)


def test_dockerignore_literals_and_skipped_extraction(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / ".dockerignore").write_text("# comment\nzig/lib/libc\n/zig/docs/\n*.md\nzig/lib/../../../etc\n")
    assert core.dockerignore_literals(ctx) == ["zig/lib/libc", "zig/docs"]
    (ctx / ".dockerignore").write_text("zig/lib/libc\n!zig/lib/libc/keep\n")
    assert core.dockerignore_literals(ctx) == []  # exceptions: leave it all to Docker
    whl = tmp_path / "t.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("pkg/zig", b"\x7fELF")
        z.writestr("pkg/lib/std/std.zig", b"std")
        z.writestr("pkg/lib/libc/musl/x.c", b"c")
        z.writestr("pkg/lib/libcxx/y.h", b"h")
        z.writestr("other/z", b"z")
    core.extract_wheel_folder(whl, "pkg/", tmp_path / "out", skip=["lib/libc"])
    got = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert got == ["lib/libcxx/y.h", "lib/std/std.zig", "zig"]


def test_demo_context_from_the_store(tmp_path: Path, wheelhouse: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `builder image demo` uploads: recipe, verified Zig without libc, source with the patch applied."""
    root = copy_project(tmp_path / "proj")
    pins = load_pins(root / "pins.toml")
    lock = load_lock(root / "pins.lock")
    p = make_plan(pins, lock, "demo", root)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    monkeypatch.setenv("BUILDER_WHEELHOUSE", str(wheelhouse))
    args = core.assemble_context(pins, lock, p, root, Store(tmp_path / "store"), ctx, offline=True,
                                 build_platform="linux/amd64", on_log=lambda s: None)
    src = lock.sources["demo-engine"]
    assert args["ENGINE_COMMIT"] == src.commit
    assert args["SOURCE_DATE_EPOCH"] == str(lock.images["demo"].source_date_epoch)
    assert args["ZIG_TARGET"] == "x86_64-linux-musl"
    assert {"Dockerfile", ".dockerignore", "build-engine.zig", "zig", "src"} <= {x.name for x in ctx.iterdir()}
    assert 'version_suffix = "+patched"' in (ctx / "src" / "src" / "main.zig").read_text()
    assert os.access(ctx / "zig" / "zig", os.X_OK)
    assert (ctx / "zig" / "lib" / "std" / "std.zig").is_file()
    assert not (ctx / "zig" / "lib" / "libc").exists()  # never extracted: .dockerignore names it
    size = sum(f.stat().st_size for f in ctx.rglob("*") if f.is_file())
    assert size < 220 * 2**20, size  # the zig binary plus std, not the 400 MB wheel folder
    assert json.loads((ctx / ".builder-closure.json").read_text()) == p.closure


def test_no_docker_engine_is_one_line(tmp_path: Path, wheelhouse: Path) -> None:
    root, store, env = fresh(tmp_path, wheelhouse)
    r = builder(root, "image", "demo", store=store, env={**env, **NO_DOCKER})
    one_line_refusal(r, 1, "no Docker engine", "unix:///nonexistent/docker.sock")
    nothing_half_written(store)


# --------------------------------------------------------------------------- the demo lane (Docker)


@pytest.mark.docker
def test_build_is_tagged_and_labelled(built: Built) -> None:
    rec, plan = built.rec, built.plan
    lock = load_lock(built.root / "pins.lock")
    src = lock.sources["demo-engine"]
    assert rec["built"] is True and rec["input_address"] == plan["input_address"]
    assert rec["tag"] == tag_for("demo", plan["input_address"])
    info = dockerio.image_inspect(rec["tag"])
    assert info is not None and info["Id"] == rec["image_id"]
    assert info["RootFS"]["Layers"] == rec["diff_ids"]
    labels = info["Config"]["Labels"]
    assert labels["io.builder.input-address"] == plan["input_address"]
    assert labels["io.builder.lock-hash"] == plan["lock_hash"] == rec["lock_hash"]
    assert labels["io.builder.engine-commit"] == src.commit
    assert labels["io.builder.patches"] == ",".join(p.sha256 for p in src.patches)
    assert labels["io.builder.zig-sha256"] == lock.toolchains["zig-wheel"].platforms["linux/amd64"].sha256
    assert labels["org.opencontainers.image.revision"] == src.commit
    assert labels["org.opencontainers.image.source"] == src.url and "@" not in src.url
    assert labels["org.opencontainers.image.created"] == "2025-01-02T00:00:00Z"
    assert info["Created"] == "2025-01-02T00:00:00Z"
    assert info["Config"]["Entrypoint"] == ["/usr/local/bin/demo-engine"]
    # the record beside the address says the same
    stored = json.loads((built.store / "images" / f"{plan['input_address']}.json").read_text())
    assert stored["image_id"] == rec["image_id"] and stored["diff_ids"] == rec["diff_ids"]
    assert list((built.store / "tmp").iterdir()) == []  # the build's context is gone
    # the build ran: the log streamed through stderr, with the network off
    assert "Step " in built.first.err and "applied patches/demo/0001" in built.first.err


@pytest.mark.docker
def test_second_run_is_a_noop(built: Built) -> None:
    r = builder(built.root, "image", "demo", "--json", store=built.store, env=built.env)
    assert r.rc == 0, r.err
    d = r.json()
    assert d["built"] is False and d["image_id"] == built.rec["image_id"]
    assert "up to date" in r.err and "Step " not in r.err


def _steps_then(log: str) -> list[tuple[str, str]]:
    """Each build step of a progress log with the line that followed it."""
    lines = [ln.strip() for ln in log.splitlines()]
    return [(ln, nxt) for ln, nxt in zip(lines, lines[1:], strict=False) if ln.startswith("Step ")]


@pytest.mark.docker
def test_a_build_from_another_store_reuses_the_engines_build_cache(tmp_path: Path, wheelhouse: Path,
                                                                   tags: Tags) -> None:
    """The engine keeps a build's stages: the same steps built again from a new store compile nothing,
    and give the same image. The recipe is made this test's own from its second step (a label), so that
    no other build's cache can answer the first build, nor stand beside it as a newer match for the
    same step (the engine answers with the newest, and the steps after follow it)."""
    root, _, env = fresh(tmp_path, wheelhouse)
    recipe = root / "images" / "demo" / "Dockerfile"
    text = recipe.read_text()
    nonce = f"LABEL io.builder.test-nonce={uuid.uuid4().hex}\n"
    recipe.write_text(text.replace("FROM scratch AS build\n", "FROM scratch AS build\n" + nonce, 1))
    assert nonce in recipe.read_text()
    relock = builder(root, "lock", "--offline", "demo", env=env)
    assert relock.rc == 0, relock.err
    tags.watch(tag_for("demo", plan_of(root)["input_address"]))
    runs = [builder(root, "image", "demo", "--json", store=tmp_path / f"store-{i}", env=env) for i in (1, 2)]
    made = re.findall(r"^\s*---> ([0-9a-f]{12})\s*$", runs[0].err, flags=re.M)
    try:
        assert [r.rc for r in runs] == [0, 0], runs[0].err + runs[1].err
        assert [r.json()["built"] for r in runs] == [True, True]
        assert runs[0].json()["image_id"] == runs[1].json()["image_id"]
        compiles = [[nxt for s, nxt in _steps_then(r.err) if 'RUN ["/zig/zig", "run"' in s] for r in runs]
        assert compiles[0] and "---> Using cache" not in compiles[0], runs[0].err
        assert compiles[1] == ["---> Using cache"] * len(compiles[0]), runs[1].err
    finally:  # this recipe's cache, which nobody else builds: each image it made, not their parents
        api = docker.from_env().api
        for image in reversed(made):
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                api.remove_image(image, noprune=True)


@pytest.mark.docker
def test_image_answers_version_with_the_pinned_commit(built: Built) -> None:
    commit = load_lock(built.root / "pins.lock").sources["demo-engine"].commit
    out = dockerlib.run(built.rec["tag"], ["--version"])
    assert out.exit_code == 0, out.stderr
    assert out.stdout == f"demo-engine 0.1.0+patched (commit {commit})\n"


@pytest.mark.docker
def test_check_reproducible(built: Built) -> None:
    r = builder(built.root, "image", "demo", "--check-reproducible", "--json", store=built.store, env=built.env)
    assert r.rc == 0, r.err
    d = r.json()
    assert d["reproducible"] is True and d["image_id"] == built.rec["image_id"]
    assert "Step " in r.err  # it really rebuilt
    assert "Using cache" not in r.err
    assert "reproducible: a rebuild from nothing gave the same ImageID" in r.err
    assert dockerio.image_id(f"builder-check/demo:{built.plan['input_address'][:32]}") is None
    # the rebuild leaves no cache of its own: every image it made is gone
    made = re.findall(r"^\s*---> ([0-9a-f]{12})\s*$", r.err, flags=re.M)
    assert made and [i for i in made if dockerio.image_inspect(i) is not None] == []
    assert dockerio.image_id(built.rec["tag"]) == built.rec["image_id"]


@pytest.mark.docker
def test_no_cache_builds_every_step_and_leaves_no_build_cache(built: Built) -> None:
    r = builder(built.root, "image", "demo", "--force", "--no-cache", "--json", store=built.store, env=built.env)
    assert r.rc == 0, r.err
    assert r.json()["built"] is True and r.json()["image_id"] == built.rec["image_id"]
    assert "Step " in r.err and "Using cache" not in r.err
    made = re.findall(r"^\s*---> ([0-9a-f]{12})\s*$", r.err, flags=re.M)
    assert made and [i for i in made if dockerio.image_inspect(i) is not None] == []
    assert dockerio.image_id(built.rec["tag"]) == built.rec["image_id"]


# --------------------------------------------------------------------------- bad input (Docker)


@pytest.mark.docker
def test_corrupt_store_entry_is_refused_before_building(tmp_path: Path, wheelhouse: Path, tags: Tags) -> None:
    root, store, env = fresh(tmp_path, wheelhouse)
    tag = tags.watch(tag_for("demo", plan_of(root)["input_address"]))
    before = dockerio.image_id(tag)
    sha = load_lock(root / "pins.lock").sources["demo-engine"].patches[0].sha256
    (store / "objects").mkdir(parents=True)
    (store / "objects" / sha).write_text("not the patch the lock names\n")
    r = builder(root, "image", "demo", store=store, env=env)
    one_line_refusal(r, 1, "sources.demo-engine.patches[0]", "is corrupt")
    assert "Step " not in r.err
    assert dockerio.image_id(tag) == before
    nothing_half_written(store)


NO_NETWORK = ("unshare", "--net")  # a network namespace of its own: no interface but a down lo


def _network_namespaces() -> bool:
    return subprocess.run([*NO_NETWORK, "true"], capture_output=True).returncode == 0


@pytest.mark.docker
def test_the_demo_image_builds_with_the_network_refused(tmp_path: Path, wheelhouse: Path, tags: Tags) -> None:
    """`builder image demo`, not even --offline, in a network namespace of its own (the Docker Engine is
    reached over its unix socket): the ziglang wheel comes from the wheelhouse, checked against the lock,
    and the image builds. Without the wheel in the wheelhouse or pip's cache, one line gives the exact
    `pip download` command that puts it there."""
    if not _network_namespaces():
        pytest.skip("unshare --net is not allowed here (needs root or user namespaces)")
    root, store, env = fresh(tmp_path, wheelhouse)
    env.update(HOME=str(tmp_path / "home"), PIP_CACHE_DIR=str(tmp_path / "pip-cache"), PIP_RETRIES="0")
    tags.watch(tag_for("demo", plan_of(root)["input_address"]))
    sha = load_lock(root / "pins.lock").toolchains["zig-wheel"].platforms[dockerio.engine_platform()].sha256
    r = builder(root, "image", "demo", "--json", store=store, env=env, wrap=NO_NETWORK)
    assert r.rc == 0, r.err
    assert r.json()["image_id"].startswith("sha256:") and (store / "objects" / sha).is_file()

    wh = root.resolve() / ".cache" / "wheelhouse"
    line = f"`python3 -m pip download --no-deps --only-binary=:all: -d {wh} ziglang==0.17.0`"
    bare = {**env, "BUILDER_WHEELHOUSE": ""}
    for args, needle in [(["--offline"], "is not in the store, a wheelhouse or pip's cache"),
                         ([], "pip could not download")]:
        r = builder(root, "image", "demo", "--force", *args, store=tmp_path / "empty-store", env=bare,
                    wrap=NO_NETWORK)
        one_line_refusal(r, 1, "toolchains.zig-wheel: ", needle)
        assert r.err.rstrip().endswith(line), r.err
        nothing_half_written(tmp_path / "empty-store")


@pytest.mark.docker
def test_wrong_wheel_is_refused(tmp_path: Path, wheelhouse: Path, tags: Tags) -> None:
    root, store, _ = fresh(tmp_path, wheelhouse)
    tag = tags.watch(tag_for("demo", plan_of(root)["input_address"]))
    before = dockerio.image_id(tag)
    art = load_lock(root / "pins.lock").toolchains["zig-wheel"].platforms[dockerio.engine_platform()]
    bad = tmp_path / "bad-wheelhouse"
    bad.mkdir()
    (bad / str(art.filename)).write_bytes(b"PK\x05\x06" + b"\0" * 18)
    r = builder(root, "image", "demo", "--offline", store=store, env={"BUILDER_WHEELHOUSE": str(bad)})
    one_line_refusal(r, 1, "toolchains.zig-wheel", "bytes do not match the lock")
    assert "Step " not in r.err
    assert dockerio.image_id(tag) == before
    assert not (store / "objects" / art.sha256).exists()
    nothing_half_written(store)


@pytest.mark.docker
def test_patch_that_no_longer_applies(tmp_path: Path, wheelhouse: Path, tags: Tags) -> None:
    root, store, env = fresh(tmp_path, wheelhouse)
    p = root / PATCH_REL
    text = p.read_text()
    assert '-pub const version_suffix = "";' in text
    p.write_text(text.replace('-pub const version_suffix = "";', '-pub const version_suffix = "x";'))
    relock(root)  # the lock takes the new bytes; only applying it shows the conflict
    tag = tags.watch(tag_for("demo", plan_of(root)["input_address"]))
    r = builder(root, "image", "demo", store=store, env=env)
    one_line_refusal(r, 1, "sources.demo-engine.patches[0]", "patch does not apply")
    assert "Step " not in r.err
    assert dockerio.image_id(tag) is None
    nothing_half_written(store)


@pytest.mark.docker
def test_platform_mismatch_needs_emulate(tmp_path: Path, wheelhouse: Path, tags: Tags) -> None:
    root, store, env = fresh(tmp_path, wheelhouse)
    engine = dockerio.engine_platform()
    here, other, other_target = ARCH[engine.split("/")[1]]
    assert factory.read_pins(root)["images"]["demo"]["platform"] == engine
    assert factory.read_pins(root)["images"]["demo"]["build_args"]["ZIG_TARGET"] == here

    def other_platform(d: dict[str, Any]) -> None:
        d["images"]["demo"]["platform"] = other
        d["images"]["demo"]["build_args"]["ZIG_TARGET"] = other_target

    factory.edit_pins(root, other_platform)
    relock(root)
    tag = tags.watch(tag_for("demo", plan_of(root)["input_address"]))
    r = builder(root, "image", "demo", store=store, env=env)
    one_line_refusal(r, 2, f"platform {other} differs from the Docker engine's {engine}", "--emulate")
    assert dockerio.image_id(tag) is None
    nothing_half_written(store)


# --------------------------------------------------------------------------- the network is off inside the build

#: the probe the netprobe recipe runs in its build (static Zig, raw Linux syscalls)
PROBE_ZIG = Path(__file__).resolve().parent / "data" / "netprobe" / "probe.zig"


@pytest.fixture(scope="session")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny static network probe, compiled by the pinned Zig (the installed ziglang package)."""
    zig = Path(ziglang.__file__).resolve().parent / "zig"
    d = tmp_path_factory.mktemp("probe")
    shutil.copyfile(PROBE_ZIG, d / "probe.zig")
    target = ARCH[dockerlib.engine_platform().split("/")[1]][0]
    subprocess.run([str(zig), "build-exe", "-OReleaseSmall", "-target", target, "-fstrip", "-fsingle-threaded",
                    "-static", "--cache-dir", str(d / "cache"), f"-femit-bin={d / 'probe'}", str(d / "probe.zig")],
                   env={**os.environ, "ZIG_GLOBAL_CACHE_DIR": str(d / "global")}, cwd=d, check=True,
                   capture_output=True)
    return d / "probe"


def probe_project(tmp_path: Path, probe: Path, conf: str) -> Path:
    """A copy of the project with one more image: FROM scratch, the probe, RUN the probe."""
    root = copy_project(tmp_path / "proj")
    r = root / "images" / "netprobe"
    r.mkdir()
    shutil.copy2(probe, r / "probe")
    (r / "probe.conf").write_text(conf + "\n")
    (r / "Dockerfile").write_text('FROM scratch\nCOPY probe probe.conf /\nRUN ["/probe"]\nENTRYPOINT ["/probe"]\n')
    factory.edit_pins(root, lambda d: d["images"].update(
        netprobe=factory.image("images/netprobe", platform=dockerlib.engine_platform())))
    relock(root, "netprobe")
    return root


def netprobe_tag(root: Path) -> str:
    r = builder(root, "why", "netprobe", "--json", env=NO_DOCKER)
    assert r.rc == 0, r.err
    return tag_for("netprobe", r.json()["input_address"])


@pytest.mark.docker
def test_build_sees_no_network_interface_but_lo(tmp_path: Path, probe: Path, tags: Tags) -> None:
    root = probe_project(tmp_path, probe, "ifaces")
    tag = tags.watch(netprobe_tag(root))
    r = builder(root, "image", "netprobe", "--json", store=tmp_path / "store")
    assert r.rc == 0, r.err
    assert "probe: interface lo" in r.err and "eth0" not in r.err
    assert r.json()["tag"] == tag
    # the same probe, run with a network, sees one: the build above really had none
    on_bridge = dockerlib.run(tag, [], network="bridge")
    assert on_bridge.exit_code == 1 and "probe: interface lo" in on_bridge.stdout
    assert len([ln for ln in on_bridge.stdout.splitlines() if "interface" in ln]) >= 2


@pytest.mark.docker
def test_recipe_that_needs_the_network_fails(tmp_path: Path, probe: Path, built: Built, tags: Tags) -> None:
    # a server the test starts: the demo image, on the default bridge
    cid = dockerlib.start(built.rec["tag"], ["serve", "--host", "0.0.0.0", "--port", "8080"])
    try:
        ip = docker.from_env().api.inspect_container(cid)["NetworkSettings"]["IPAddress"]
        assert ip
        root = probe_project(tmp_path, probe, f"connect {ip}:8080")
        # with a network the probe reaches it (a throwaway image without the RUN step) ...
        ctx = tmp_path / "ctx"
        ctx.mkdir()
        shutil.copy2(root / "images" / "netprobe" / "probe", ctx / "probe")
        shutil.copy2(root / "images" / "netprobe" / "probe.conf", ctx / "probe.conf")
        (ctx / "Dockerfile").write_text('FROM scratch\nCOPY probe probe.conf /\nENTRYPOINT ["/probe"]\n')
        check_tag = tags.watch(f"builder-test-netprobe:{uuid.uuid4().hex[:12]}")
        dockerbuild.build(ctx, tag=check_tag, cleanup=True)
        for _ in range(50):
            reached = dockerlib.run(check_tag, [], network="bridge")
            if reached.exit_code == 0:
                break
            time.sleep(0.2)
        assert reached.exit_code == 0 and f"probe: reached {ip}:8080" in reached.stdout, reached.stdout
        # ... and inside `builder image` it cannot: one line, non-zero, nothing tagged
        tag = tags.watch(netprobe_tag(root))
        store = tmp_path / "store"
        r = builder(root, "image", "netprobe", store=store)
        assert r.rc == 1, r.err
        assert f"probe: cannot reach {ip}:8080" in r.err  # the build's own log line
        errors = [ln for ln in r.err_lines if ln.startswith("error:")]
        assert len(errors) == 1 and "RUN [\"/probe\"]" in errors[0] and "non-zero code: 3" in errors[0]
        assert dockerio.image_id(tag) is None
        nothing_half_written(store)
    finally:
        dockerlib.stop(cid)
