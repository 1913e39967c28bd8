"""Runtime inputs: kernel kits and plain files a lane mounts, locked, fetched, placed, bundled, installed.

Real files throughout: a kit folder and its MANIFEST (the shape of bertholomus-tp4's ``kit/MANIFEST``:
``sha256 bytes origin two-node path``), a real git repository holding a kit under ``kit/``, the real
CLI for lock and fetch, the real bundle and (with a Docker Engine) the real installer. The drift of
installed kit and runtime files on a fleet is tests/test_journey.py's.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from builder.bundle import BundleOptions, load_bundle_inputs, make_bundle, verify_dir
from builder.errors import ConfigError, ResolveError
from builder.foundation.canon import atomic_write
from builder.inputs.hosts import find_host
from builder.inputs.pins import load_pins
from builder.lock import kits
from builder.lock import plainfiles as plain
from builder.lock.diff import diff_locks
from builder.lock.lockfile import load_lock, render_lock, spec_hash
from builder.store.placement import mount_path, place_models
from tests.lib import bundlelib as bl
from tests.lib import clirun, factory
from tests.lib.gitlib import Upstream

KIT = {
    "aot/aot.json": b'{"kernels": ["00ab"]}\n',
    "aot/cubins/00ab.cubin": bytes(range(256)) * 20,
    "cubins/linear.cubin": b"\x7fELF" + bytes(3000),
    "rope.json": b'{"theta": 10000}\n',
    "rope-plain-cos.f32": b"\x00\x00\x80\x3f" * 512,
    "vision/gate_bias_vl.safetensors": b"\x01" * 700,
}
#: made by the kit's tools (verify_kit.sh): in a verified kit folder, never in its git tree
MADE = {"rope-plain-cos.f32": "rope", "vision/gate_bias_vl.safetensors": "bias"}
TEMPLATE = b"{%- for m in messages -%}<|{{ m.role }}|>{{ m.content }}{%- endfor -%}\n"
OVERLAY = b"# overlay: mounted over the engine's engram.py\nENGRAM = True\n"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_bytes(files: dict[str, bytes]) -> bytes:
    head = (
        "# a test kit in the shape of bertholomus-tp4's kit/MANIFEST\n"
        f"# {len(files)} files. Columns: sha256, bytes, origin, two-node, path.\n"
    )
    lines = [f"{sha(b)} {len(b):>11}  {MADE.get(rel, 'git'):<4}  -    {rel}" for rel, b in sorted(files.items())]
    return (head + "\n".join(lines) + "\n").encode()


def write_kit(d: Path, files: dict[str, bytes] = KIT) -> bytes:
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    m = manifest_bytes(files)
    (d / "MANIFEST").write_bytes(m)
    return m


def cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = clirun.environment({"BUILDER_STORE": str(root / "store"), "HF_HOME": str(root / "hf-home")},
                             drop=("HF_", "BUILDER_"))
    r = clirun.run(*args, cwd=root, pins=root / "pins.toml", env=env, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def errors(r: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]


LANE = {
    "images": {"x": factory.image("images/x", platform="linux/amd64")},
    "lanes": {"run": factory.lane(
        "x", [],
        mounts=[{"source": "input:tp-kit", "target": "/kit"},
                {"source": "input:chat-template", "target": "/templates/chat_template.jinja"},
                {"source": "input:overlay", "target": "/usr/lib/engine/engram.py"}],
        serve={"tensor_parallel": 2, "context": 4096, "streams": 1, "port": 8000, "served_name": "x"},
    )},
}


class Proj:
    """A project with a local kit, a chat template and an overlay file, and a lane that mounts them."""

    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "proj"
        self.kit = self.root / "kits" / "tp-kit"
        self.kit.mkdir(parents=True)
        self.manifest = write_kit(self.kit)
        (self.root / "files").mkdir()
        (self.root / "files" / "chat.jinja").write_bytes(TEMPLATE)
        (self.root / "files" / "engram.py").write_bytes(OVERLAY)
        (self.root / "images" / "x").mkdir(parents=True)
        (self.root / "images" / "x" / "Dockerfile").write_text("FROM scratch\n")
        self.write()

    def doc(self, kit: dict[str, Any] | None = None, lane: bool = True) -> dict[str, Any]:
        """The pins: the local kit (with `kit`'s keys), the two files and (with `lane`) the lane."""
        return factory.pins(
            kits={"tp-kit": {"local": "kits/tp-kit", "expect_files": len(KIT), **(kit or {})}},
            files={"chat-template": {"url": "files/chat.jinja", "sha256": sha(TEMPLATE)},
                   "overlay": {"url": "files/engram.py", "sha256": sha(OVERLAY)}},
            **(LANE if lane else {}),
        )

    def write(self, kit: dict[str, Any] | None = None, lane: bool = True) -> None:
        factory.write_pins(self.root, self.doc(kit, lane))

    def lock(self) -> dict[str, object]:
        return json.loads((self.root / "pins.lock").read_text())  # type: ignore[no-any-return]


@pytest.fixture
def proj(tmp_path: Path) -> Proj:
    return Proj(tmp_path)


# --------------------------------------------------------------------------- lock: a local kit


def test_a_local_kit_is_locked_file_by_file_against_its_manifest(proj: Proj) -> None:
    r = cli(proj.root, "lock", "--offline")
    assert r.returncode == 0, r.stderr
    k = proj.lock()["kits"]["tp-kit"]  # type: ignore[index]
    assert k["origin"] == "local" and k["commit"] is None and k["source"] is None
    assert k["manifest"] == {"path": "MANIFEST", "size": len(proj.manifest), "sha256": sha(proj.manifest)}
    assert k["files"] == [{"path": p, "size": len(b), "sha256": sha(b)} for p, b in sorted(KIT.items())]
    assert k["total_size"] == sum(len(b) for b in KIT.values())
    assert cli(proj.root, "lock", "--check").returncode == 0
    # the lane's closure takes its runtime inputs (and `--check` of the lane knows them)
    assert cli(proj.root, "lock", "--check", "run").returncode == 0
    # the MANIFEST's hash, pinned: right, then wrong
    proj.write(kit={"manifest_sha256": sha(proj.manifest)})
    assert cli(proj.root, "lock", "--offline").returncode == 0
    proj.write(kit={"manifest_sha256": "0" * 64})
    assert "kits.tp-kit: pins changed" in cli(proj.root, "lock", "--check").stderr
    r = cli(proj.root, "lock", "--offline")
    (line,) = errors(r)
    assert r.returncode == 1 and "kits.tp-kit" in line and sha(proj.manifest) in line and "manifest_sha256" in line


def _one_error(proj: Proj) -> str:
    r = cli(proj.root, "lock", "--offline")
    (line,) = errors(r)
    assert r.returncode == 1 and line.startswith("error: kits.tp-kit: "), r.stderr
    assert not (proj.root / "pins.lock").exists()  # a lock that fails writes nothing
    return line


def test_a_changed_byte_is_named(proj: Proj) -> None:
    p = proj.kit / "cubins/linear.cubin"
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(bytes(data))
    line = _one_error(proj)
    assert "differ cubins/linear.cubin (sha256" in line and "MANIFEST says" in line


def test_a_missing_file_is_named(proj: Proj) -> None:
    (proj.kit / "rope-plain-cos.f32").unlink()
    assert "missing rope-plain-cos.f32" in _one_error(proj)


def test_an_extra_file_is_named_unless_ignored(proj: Proj) -> None:
    (proj.kit / "README.md").write_text("the kit\n")
    assert "not in the MANIFEST README.md" in _one_error(proj)
    proj.write(kit={"ignore": ["README.md"]})
    assert cli(proj.root, "lock", "--offline").returncode == 0


def test_the_manifest_count_against_expect_files(proj: Proj) -> None:
    proj.write(kit={"expect_files": 356})
    assert f"MANIFEST lists {len(KIT)} files, expect_files = 356" in _one_error(proj)


def test_a_malformed_manifest_line_is_named(proj: Proj) -> None:
    with open(proj.kit / "MANIFEST", "a") as f:
        f.write("not-a-hash 12 git - extra.bin\n")
    assert f"MANIFEST line {len(KIT) + 3}: want `sha256 bytes origin two-node path`" in _one_error(proj)


def test_parse_manifest_refuses_escaping_and_repeated_paths() -> None:
    good = f"{'a' * 64} 1 git - x\n"
    with pytest.raises(ResolveError, match="escapes"):
        kits.parse_manifest(f"{'a' * 64} 1 git - ../x\n".encode(), "kits.k")
    with pytest.raises(ResolveError, match="listed twice"):
        kits.parse_manifest((good * 2).encode(), "kits.k")
    with pytest.raises(ResolveError, match="lists no files"):
        kits.parse_manifest(b"# only a comment\n\n", "kits.k")
    (line,) = kits.parse_manifest(f"# c\n{'A' * 64}   10  rope tp2  dir/with space.f32\n".encode(), "kits.k")
    assert (line.sha256, line.size, line.origin, line.path) == ("a" * 64, 10, "rope", "dir/with space.f32")


# --------------------------------------------------------------------------- lock: a kit from a git tree


class GitKit:
    """A recipe repository (a real git repo, pushed to a bare one) whose kit/ folder is a kit."""

    def __init__(self, tmp: Path, proj: Proj) -> None:
        self.up = Upstream(tmp, "recipe")
        self.proj = proj
        in_git = {k: v for k, v in KIT.items() if k not in MADE}
        for rel, data in in_git.items():
            (self.up.work / "kit" / rel).parent.mkdir(parents=True, exist_ok=True)
            (self.up.work / "kit" / rel).write_bytes(data)
        (self.up.work / "kit" / "MANIFEST").write_bytes(manifest_bytes(KIT))  # lists the made files too
        (self.up.work / "README.md").write_text("the recipe\n")
        self.c1 = self.up.commit({})
        self.up.push()

    def pins(self, **kit: Any) -> None:
        """Pins of the git kit (with `kit`'s keys) and its source alone."""
        factory.write_pins(self.proj.root, factory.pins(
            sources={"recipe": {"url": str(self.up.url), "ref": "main"}},
            kits={"git-kit": {"source": "recipe", "path": "kit", **kit}}))


def test_a_kit_from_a_git_tree_names_the_made_files_it_lacks(proj: Proj, tmp_path: Path) -> None:
    g = GitKit(tmp_path, proj)
    g.pins()
    r = cli(proj.root, "lock", "git-kit")
    (line,) = errors(r)
    assert r.returncode == 1 and line.startswith("error: kits.git-kit: 2 of 6 files its MANIFEST lists are not "
                                                  f"in recipe at {g.c1[:12]}, kit/: ")
    assert "rope-plain-cos.f32, vision/gate_bias_vl.safetensors" in line and "origin bias, rope" in line
    assert "point `local` at a verified kit folder" in line
    assert not (proj.root / "pins.lock").exists()  # a lock that fails writes nothing, not even its source


def test_a_kit_from_a_git_tree_locks_at_its_sources_commit(proj: Proj, tmp_path: Path) -> None:
    g = GitKit(tmp_path, proj)
    in_git = {k: v for k, v in KIT.items() if k not in MADE}
    (g.up.work / "kit" / "MANIFEST").write_bytes(manifest_bytes(in_git))
    g.up.commit({})
    g.up.push()
    g.pins()
    r = cli(proj.root, "lock", "git-kit")
    assert r.returncode == 0, r.stderr
    lock = proj.lock()
    k = lock["kits"]["git-kit"]  # type: ignore[index]
    commit = lock["sources"]["recipe"]["commit"]  # type: ignore[index]
    assert (k["origin"], k["source"], k["commit"], k["path"]) == ("git", "recipe", commit, "kit")
    assert k["files"] == [{"path": p, "size": len(b), "sha256": sha(b)} for p, b in sorted(in_git.items())]
    assert k["manifest"]["sha256"] == sha(manifest_bytes(in_git))
    # a file of the tree that is not the kit's is named; `ignore` leaves it out
    (g.up.work / "kit" / "verify_kit.sh").write_text("#!/bin/sh\n")
    c3 = g.up.commit({})
    g.up.push()
    before = (proj.root / "pins.lock").read_bytes()
    r = cli(proj.root, "lock", "--update", "recipe", "git-kit")
    (line,) = errors(r)
    assert "kits.git-kit: 1 file(s) do not match its MANIFEST" in line and "verify_kit.sh" in line
    # nothing written: neither the kit nor its source moves to the commit the kit failed at
    assert (proj.root / "pins.lock").read_bytes() == before
    g.pins(ignore=["verify_kit.sh"])
    assert cli(proj.root, "lock", "--update", "recipe", "git-kit").returncode == 0
    assert proj.lock()["kits"]["git-kit"]["commit"] == c3  # type: ignore[index]
    assert cli(proj.root, "lock", "--check", "git-kit").returncode == 0
    # fetch writes its files into the store from the mirror the lock filled (offline)
    r = cli(proj.root, "fetch", "--offline", "git-kit")
    assert r.returncode == 0 and "5 imported" in r.stderr, r.stderr
    for b in [*in_git.values(), manifest_bytes(in_git)]:
        assert (proj.root / "store" / "models" / "objects" / sha(b)).read_bytes() == b


# --------------------------------------------------------------------------- fetch, placement, diff


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A plain HTTP server on loopback serving a folder."""
    d = tmp_path / "www"
    d.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(d))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", d
    finally:
        srv.shutdown()
        srv.server_close()


def test_fetch_fills_the_store_with_kit_and_runtime_files(proj: Proj, served: tuple[str, Path]) -> None:
    url, www = served
    (www / "engram.py").write_bytes(OVERLAY)
    doc = proj.doc()
    doc["files"]["overlay"]["url"] = f"{url}/engram.py"
    factory.write_pins(proj.root, doc)
    assert cli(proj.root, "lock").returncode == 0
    r = cli(proj.root, "fetch", "--offline", "--json", "run")
    assert r.returncode == 1 and "files.overlay: engram.py: not in the store and --offline was given" in r.stderr
    rep = json.loads(r.stdout)
    assert rep["missing"] == ["overlay/engram.py"]
    assert sorted(rep["imported"]) == sorted(["chat-template/chat.jinja", "tp-kit/MANIFEST",
                                              *(f"tp-kit/{p}" for p in KIT)])
    r = cli(proj.root, "fetch", "--json", "run")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["downloaded"] == ["overlay/engram.py"] and len(rep["present"]) == len(KIT) + 2
    objects = proj.root / "store" / "models" / "objects"
    for b in [*KIT.values(), proj.manifest, TEMPLATE, OVERLAY]:
        assert (objects / sha(b)).read_bytes() == b
    views = proj.root / "store" / "models" / "views"
    assert (views / "kits" / "tp-kit" / sha(proj.manifest) / "aot/cubins/00ab.cubin").samefile(
        objects / sha(KIT["aot/cubins/00ab.cubin"]))
    assert (views / "files" / "chat-template" / sha(TEMPLATE) / "chat.jinja").read_bytes() == TEMPLATE
    # the local kit's files are imported by hard link, not copied
    assert (objects / sha(KIT["rope.json"])).samefile(proj.kit / "rope.json")
    r = cli(proj.root, "fetch", "--offline", "--verify", "run")
    assert r.returncode == 0 and f"{len(KIT) + 3} present" in r.stderr, r.stderr
    # bytes at the URL that are not the locked ones are refused and named
    (objects / sha(OVERLAY)).chmod(0o644)
    (objects / sha(OVERLAY)).unlink()
    (www / "engram.py").write_bytes(b"# another overlay\n")
    r = cli(proj.root, "fetch", "overlay")
    assert r.returncode == 1 and "files.overlay: engram.py:" in r.stderr and "sha256 mismatch" in r.stderr


def test_fetch_names_a_local_kit_file_changed_or_gone_since_the_lock(proj: Proj) -> None:
    assert cli(proj.root, "lock", "--offline").returncode == 0
    (proj.kit / "rope.json").write_bytes(b'{"theta": 50000}\n')
    (proj.kit / "aot/aot.json").unlink()
    r = cli(proj.root, "fetch", "tp-kit")
    assert r.returncode == 1 and f"{len(KIT) - 1} imported" in r.stderr and "2 failed" in r.stderr, r.stderr
    assert "kits.tp-kit: rope.json: " in r.stderr and "the lock says" in r.stderr
    assert f"kits.tp-kit: aot/aot.json: not in the store, and not in the kit's folder {proj.kit}" in r.stderr
    assert not (proj.root / "store" / "models" / "objects" / sha(b'{"theta": 50000}\n')).exists()


def test_placement_puts_runtime_inputs_at_their_mount_paths(proj: Proj) -> None:
    assert cli(proj.root, "lock", "--offline").returncode == 0
    (proj.root / "hosts").mkdir()
    (proj.root / "hosts" / "f.toml").write_text(bl.fleet_toml(bl.DEFAULT_HOSTS, lane="run"))
    pins, lock = load_pins(proj.root / "pins.toml"), load_lock(proj.root / "pins.lock")
    for name in ("spark-a", "spark-b"):
        _, _, host = find_host(proj.root / "hosts", name)
        placed = {m.name: m for m in place_models(pins, lock, "run", host)}
        mounts = {m.name: mount_path(pins, "run", host, m) for m in pins.lanes["run"].mounts}
        kit = placed["tp-kit"]
        assert (kit.role, kit.root, kit.locked_files, kit.expect_files) == ("kit", mounts["tp-kit"], 6, 6)
        assert [f.path for f in kit.files] == sorted(f"/srv/models/tp-kit/{p}" for p in [*KIT, "MANIFEST"])
        for n in ("chat-template", "overlay"):
            (f,) = placed[n].files
            assert placed[n].role == "file" and f.path == mounts[n] and f.path.startswith(f"/srv/models/{n}/")
        assert placed["chat-template"].files[0].sha256 == sha(TEMPLATE)
    # a kit whose pin changed since the lock is named before anything is placed
    proj.write(kit={"ignore": ["*.md"]})
    with pytest.raises(ConfigError, match=r"kits.tp-kit: changed since the lock"):
        place_models(load_pins(proj.root / "pins.toml"), lock, "run", host)


def test_diff_names_what_moved_in_a_kit(proj: Proj) -> None:
    assert cli(proj.root, "lock", "--offline").returncode == 0
    old = load_lock(proj.root / "pins.lock")
    changed = dict(KIT, **{"aot/aot.json": b'{"kernels": ["00ab", "00cd"]}\n'})
    write_kit(proj.kit, changed)
    assert cli(proj.root, "lock", "--offline", "--update", "tp-kit").returncode == 0
    new = load_lock(proj.root / "pins.lock")
    lines = {c.what for c in diff_locks(old, new) if c.input == "kits.tp-kit"}
    assert f"MANIFEST sha256 {sha(proj.manifest)[:12]} -> {sha(manifest_bytes(changed))[:12]}" in lines
    assert "kit files changed: 1 changed (aot/aot.json)" in lines
    r = cli(proj.root, "lock", "--offline", "--update", "tp-kit")
    assert "(unchanged)" in r.stderr


# --------------------------------------------------------------------------- bundle and install


def with_inputs(p: bl.Project) -> None:
    """Give bundlelib's demo lane a kit and a chat template, mounted, and lock them (real files hashed)."""
    write_kit(p.root / "kit")
    (p.root / "files").mkdir()
    (p.root / "files" / "chat.jinja").write_bytes(TEMPLATE)
    doc = bl.pins_doc()
    doc["lanes"][bl.LANE]["mounts"] = [{"source": "input:tp-kit", "target": "/kit"},
                                       {"source": "input:chat-template", "target": "/templates/chat.jinja"}]
    doc["kits"] = {"tp-kit": {"local": "kit"}}
    doc["files"] = {"chat-template": {"url": "files/chat.jinja", "sha256": sha(TEMPLATE)}}
    factory.write_pins(p.root, doc)
    bl.write_lock(p.root)
    pins = load_pins(p.pins)
    lock = load_lock(p.root / "pins.lock")
    kit = kits.resolve_local("tp-kit", pins.kits["tp-kit"], p.root, spec_hash(pins.kits["tp-kit"]))
    tmpl = plain.resolve_file("chat-template", pins.files["chat-template"], root=p.root, offline=True,
                              spec_hash=spec_hash(pins.files["chat-template"]))
    atomic_write(p.root / "pins.lock",
                 render_lock(lock.model_copy(update={"kits": {"tp-kit": kit}, "files": {"chat-template": tmpl}})))
    bl.write_record_for(p.root, p.image_id, p.diff_ids)


def _bundle(p: bl.Project, out: Path) -> Path:
    ctx = load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)
    return make_bundle(ctx, "spark-b", BundleOptions(key=p.key, out=out, with_models=True)).path


def _mounted(host: Path) -> dict[str, bytes]:
    """What the installed kit and template are, by the path the lane mounts them from."""
    out = {f"{host}/models/tp-kit/{rel}": data for rel, data in KIT.items()}
    out[f"{host}/models/tp-kit/MANIFEST"] = manifest_bytes(KIT)
    out[f"{host}/models/chat-template/chat.jinja"] = TEMPLATE
    return out


def test_a_bundle_carries_kit_and_template_files_for_their_mount_paths(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path, hosts=bl.local_hosts(tmp_path / "host"))
    with_inputs(p)
    d = _bundle(p, tmp_path / "b")
    m = bl.manifest(d)
    want = _mounted(tmp_path / "host")
    entries = {e["path"]: e for e in m["models"]}
    assert set(want) <= set(entries)
    for path, data in want.items():
        e = entries[path]
        assert (e["size"], e["sha256"]) == (len(data), sha(data))
        assert e["bundled"] == f"models/{e['model']}/{e['file']}" and (d / e["bundled"]).read_bytes() == data
        # linked from the store, as model files are
        assert (d / e["bundled"]).samefile(p.store / "models" / "objects" / sha(data))
    cfg = json.loads((d / "config.json").read_text())
    assert {x["path"] for x in cfg["models"]} == set(entries)
    start = (d / "start.sh").read_text()
    assert f"{tmp_path}/host/models/tp-kit:/kit:ro" in start
    assert f"{tmp_path}/host/models/chat-template/chat.jinja:/templates/chat.jinja:ro" in start
    assert verify_dir(d, p.pub)["bundle_id"] == m["bundle_id"]


@pytest.mark.docker
def test_the_installer_places_kit_and_template_files_and_records_them(tmp_path: Path,
                                                                     request: pytest.FixtureRequest) -> None:
    if not shutil.which("docker"):
        pytest.skip("no docker CLI")
    p = bl.make_project(tmp_path, hosts=bl.local_hosts(tmp_path / "host"), docker_image=True,
                        marker=request.node.nodeid)
    try:
        with_inputs(p)
        d = _bundle(p, tmp_path / "b")
        root = tmp_path / "host" / "builder"

        def install() -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-I", str(bl.installer_file()), "install", str(d), "--root",
                                   str(root), "--trusted-key", str(p.pub)], capture_output=True, text=True,
                                  timeout=300, cwd="/")

        r = install()
        assert r.returncode == 0, r.stderr
        want = _mounted(tmp_path / "host")
        for path, data in want.items():
            assert Path(path).read_bytes() == data, path
        rec = json.loads((root / "state" / "applied.json").read_text())
        recorded = {x["path"]: x for x in rec["models"]}
        for path, data in want.items():
            st = os.stat(path)
            assert (recorded[path]["sha256"], recorded[path]["size"], recorded[path]["inode"]) == (
                sha(data), len(data), st.st_ino)
        assert install().returncode == 0  # the same bundle again: nothing to do
        # a kit file that drifted on the host is not vouched for: the same bundle puts it back
        kitfile = Path(f"{tmp_path}/host/models/tp-kit/cubins/linear.cubin")
        kitfile.write_bytes(b"\x00" * len(KIT["cubins/linear.cubin"]))
        assert install().returncode == 0
        assert kitfile.read_bytes() == KIT["cubins/linear.cubin"]
    finally:
        subprocess.run(["docker", "image", "rm", "-f", p.image_id], capture_output=True)
