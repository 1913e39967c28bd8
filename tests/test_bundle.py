"""builder bundle / keygen / verify: determinism, parts, per-rank files, signature and hash refusal."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from builder.bundle import (
    BundleOptions,
    hostpkg,
    load_bundle_inputs,
    make_bundle,
    make_fleet_bundles,
    parse_size,
    render_bundle,
    verify_dir,
    write_stream,
)
from builder.bundle.render import lane_record
from builder.errors import BuilderError, ConfigError, UnreachableError, VerifyError
from builder.foundation import sign
from builder.foundation.hashing import READ_SIZE
from builder.image import registry
from builder.image.imagerecord import write_record
from builder.inputs.hosts import find_host
from builder.installer.manifest import bundle_id_of
from tests.lib import bundlelib as bl
from tests.lib import clirun, factory
from tests.lib.bundlelib import Project, make_project, manifest, resign, tree_bytes


def _ctx(p: Project):  # type: ignore[no-untyped-def]
    return load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)


def _bundle(p: Project, host: str = "spark-b", **kw: object) -> Path:
    opts = BundleOptions(key=p.key, **kw)  # type: ignore[arg-type]
    return make_bundle(_ctx(p), host, opts).path


@pytest.fixture
def proj(tmp_path: Path) -> Project:
    return make_project(tmp_path)


# --------------------------------------------------------------------------- shape and determinism


def test_bundle_is_deterministic(proj: Project, tmp_path: Path) -> None:
    a = make_bundle(_ctx(proj), "spark-b", BundleOptions(key=proj.key, out=tmp_path / "a", part_size=4096))
    b = make_bundle(
        _ctx(proj),
        "spark-b",
        BundleOptions(key=proj.key, out=tmp_path / "b", part_size=4096, with_models=True),
    )
    c = make_bundle(
        _ctx(proj),
        "spark-b",
        BundleOptions(key=proj.key, out=tmp_path / "c", part_size=4096, with_models=True),
    )
    assert tree_bytes(b.path) == tree_bytes(c.path)
    assert b.bundle_id == c.bundle_id != a.bundle_id
    again = make_bundle(
        _ctx(proj), "spark-b", BundleOptions(key=proj.key, out=tmp_path / "a", part_size=4096)
    )
    assert again.unchanged and again.bundle_id == a.bundle_id
    assert not [p for p in (tmp_path).iterdir() if p.name.startswith(".tmp-")]


def test_a_bundle_made_by_another_process_is_byte_identical(proj: Project, tmp_path: Path) -> None:
    """The same inputs give the same bytes whatever process makes them: install.pyz included (its
    zip entries carry fixed times and modes, not the source files')."""
    a = make_bundle(_ctx(proj), "spark-b", BundleOptions(key=proj.key, out=tmp_path / "a", part_size=4096))
    r = proj.cli("bundle", "spark-b", "--key", str(proj.key), "--out", str(tmp_path / "b"), "--part-size", "4096")
    assert r.returncode == 0, r.stderr
    assert tree_bytes(a.path) == tree_bytes(tmp_path / "b")
    pyz = b"".join((a.path / f["path"]).read_bytes()
                   for f in next(f for f in manifest(a.path)["files"] if f["path"] == "install.pyz")["parts"])
    assert pyz == hostpkg.zipapp()


def test_manifest_content(proj: Project) -> None:
    d = _bundle(proj, "spark-b")
    m = manifest(d)
    assert m["bundle_id"] == bundle_id_of(m)
    assert (m["host"], m["fleet"], m["lane"], m["rank"], m["role"], m["world_size"]) == (
        "spark-b",
        "testfleet",
        "demo",
        1,
        "worker",
        2,
    )
    assert m["image"]["image_id"] == proj.image_id and m["image"]["diff_ids"] == proj.diff_ids
    assert len(m["lock_hash"]) == 64 and len(m["image"]["input_address"]) == 64
    paths = {f["path"]: f for f in m["files"]}
    assert set(paths) == {"config.json", "install.pyz", "lane.py", "rank.env", "start.sh", "stop.sh"}
    assert paths["start.sh"]["mode"] == "0755" and paths["rank.env"]["mode"] == "0644"
    for rel, f in paths.items():
        st = (d / rel).stat()
        assert st.st_size == f["size"] and oct(stat.S_IMODE(st.st_mode))[2:].zfill(4) == f["mode"]
    # rank 1 gets the r1of2 file and the shared files, not rank 0's
    files = sorted(x["file"] for x in m["models"])
    assert files == ["config.json", "tokenizer.json", "weights-r1of2.bin"]
    assert all(x["path"].startswith("/srv/models/demo-model/") for x in m["models"])
    head = manifest(_bundle(proj, "spark-a"))
    assert "weights-r0of2.bin" in {x["file"] for x in head["models"]}
    sig = (d / "manifest.json.minisig").read_text().splitlines()
    assert (
        sig[2] == f"trusted comment: builder-bundle id={m['bundle_id']} host=spark-b fleet=testfleet "
        f"lane=demo rank=1"
    )
    assert (d / "install.pyz").read_bytes() == hostpkg.zipapp()


def test_minisign_cli_accepts_the_signature(proj: Project) -> None:
    if not shutil.which("minisign"):
        pytest.skip("minisign not installed")
    d = _bundle(proj)
    p = subprocess.run(
        ["minisign", "-Vm", str(d / "manifest.json"), "-p", str(proj.pub)], capture_output=True
    )
    assert p.returncode == 0, p.stderr


def test_models_are_linked_whole_from_the_store(proj: Project) -> None:
    """A model file larger than the part size is still one file: a hard link to the store's object."""
    d = _bundle(proj, with_models=True, part_size=5000)
    m = manifest(d)
    weights = next(f for f in m["files"] if f["path"] == "models/demo-model/weights-r1of2.bin")
    assert "parts" not in weights and not (d / "parts" / "models").exists()
    obj = proj.store / "models" / "objects" / weights["sha256"]
    assert os.path.samefile(d / "models/demo-model/weights-r1of2.bin", obj)
    assert verify_dir(d, proj.pub)["bundle_id"] == m["bundle_id"]


def _disk_used(*roots: Path) -> int:
    """Bytes the files under roots take, each inode once (as du counts hard links)."""
    seen: dict[tuple[int, int], int] = {}
    for r in roots:
        for p in r.rglob("*"):
            st = p.lstat()
            if stat.S_ISREG(st.st_mode):
                seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return sum(seen.values())


def test_fleet_bundles_share_the_stores_inodes(proj: Project) -> None:
    """Every host's bundle holds its model files as links to the store: the fleet costs one copy."""
    res = make_fleet_bundles(_ctx(proj), "testfleet", BundleOptions(key=proj.key, with_models=True))
    objects = proj.store / "models" / "objects"
    linked = 0
    for r in res:
        for f in manifest(r.path)["files"]:
            if f["path"].startswith("models/"):
                st, obj = (r.path / f["path"]).stat(), (objects / f["sha256"]).stat()
                assert (st.st_ino, st.st_dev) == (obj.st_ino, obj.st_dev) and st.st_nlink >= 3
                linked += 1
    assert linked == 6  # config and tokenizer on both ranks, one weights file each
    model_bytes = sum(len(b) for b in bl.MODEL_FILES.values())
    bundles = _disk_used(*(r.path / "models" for r in res))
    everything = _disk_used(proj.store / "models", *(r.path / "models" for r in res))
    assert everything == _disk_used(proj.store / "models") and bundles <= everything
    assert everything <= model_bytes + 4 * 4096 * len(bl.MODEL_FILES)  # one copy (block rounding)


def test_a_store_object_changed_behind_builders_back_is_named(proj: Project) -> None:
    _bundle(proj, with_models=True)
    obj = next((proj.store / "models" / "objects").iterdir())
    os.chmod(obj, 0o644)
    data = obj.read_bytes()
    obj.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    r = proj.cli("bundle", "spark-b", "--with-models", "--key", str(proj.key))
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "models.demo-model: " in r.stderr and "changed behind builder's back" in r.stderr


def test_write_stream_splits_exactly(tmp_path: Path) -> None:
    for size, part in [(0, 4), (4, 4), (5, 4), (8, 4), (9, 4)]:
        d = tmp_path / f"{size}-{part}"
        d.mkdir()
        w = write_stream(io.BytesIO(b"x" * size), "f.bin", d, part, "0644")
        assert w.size == size
        if size <= part:
            assert not w.parts and (d / "f.bin").stat().st_size == size
        else:
            assert sum(p["size"] for p in w.parts) == size and all(p["size"] > 0 for p in w.parts)
            assert len(w.parts) == -(-size // part)


def test_write_stream_hashes_each_part_and_the_whole_across_short_reads(tmp_path: Path) -> None:
    """Two whole reads, short reads from a "pipe", a part boundary inside a read and a short tail."""
    data = os.urandom(READ_SIZE * 2 + 5000)
    part_size = READ_SIZE + 4096
    dest = tmp_path / "b"
    w = write_stream(io.BufferedReader(io.BytesIO(data), buffer_size=1000), "big.bin", dest, part_size, "0644")
    assert (w.size, w.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert b"".join((dest / p["path"]).read_bytes() for p in w.parts) == data
    for p in w.parts:
        assert hashlib.sha256((dest / p["path"]).read_bytes()).hexdigest() == p["sha256"]
        assert stat.S_IMODE((dest / p["path"]).stat().st_mode) == 0o644
    assert [p["size"] for p in w.parts] == [part_size, len(data) - part_size]


def test_rank_file_count_must_match_tensor_parallel(proj: Project) -> None:
    doc = bl.pins_doc()
    doc["lanes"]["demo"]["serve"]["tensor_parallel"] = 3
    factory.write_pins(proj.root, doc)
    bl.write_lock(proj.root)
    bl.write_record_for(proj.root, proj.image_id, proj.diff_ids)
    with pytest.raises(ConfigError, match="2 hosts but lane demo has tensor_parallel = 3"):
        _bundle(proj)


def test_fleet_bundles_every_host(proj: Project) -> None:
    res = make_fleet_bundles(_ctx(proj), "testfleet", BundleOptions(key=proj.key))
    assert [r.host for r in res] == ["spark-a", "spark-b"]
    assert all((r.path / "manifest.json").is_file() for r in res)


def test_parse_size() -> None:
    assert parse_size("256MiB") == 256 * 1024 * 1024
    assert parse_size("1G") == 1 << 30 and parse_size("4k") == 4096 and parse_size("100") == 100
    for bad in ("", "x", "-1", "0", "1.5G"):
        with pytest.raises(ConfigError):
            parse_size(bad)


# --------------------------------------------------------------------------- keys


def test_keygen_cli_and_key_modes(proj: Project, tmp_path: Path) -> None:
    p = proj.cli("keygen", "--out", str(tmp_path / "k"))
    assert p.returncode == 0, p.stderr
    assert stat.S_IMODE((tmp_path / "k" / "builder.key").stat().st_mode) == 0o600
    assert (tmp_path / "k" / "builder.pub").read_text().startswith("untrusted comment:")
    assert proj.cli("keygen", "--out", str(tmp_path / "k")).returncode == 2  # no silent overwrite
    os.chmod(proj.key, 0o640)
    p = proj.cli("bundle", "spark-b", "--key", str(proj.key))
    assert p.returncode == 2 and "group or others" in p.stderr and "Traceback" not in p.stderr
    assert not proj.out("spark-b").exists()


def test_signing_key_from_env_never_lands_in_output(proj: Project) -> None:
    p = proj.cli("bundle", "spark-b", "--json", env={"BUILDER_SIGNING_KEY": str(proj.key)})
    assert p.returncode == 0, p.stderr
    secret_line = proj.key.read_text().splitlines()[1]
    assert secret_line not in p.stdout + p.stderr
    for rel, (data, _) in tree_bytes(proj.out("spark-b")).items():
        assert secret_line.encode() not in data, rel
    assert not list(proj.out("spark-b").rglob("*.key"))
    assert proj.cli("bundle", "spark-b").returncode == 2  # no key anywhere: exit 2, one line


def _key_id(key: Path) -> str:
    return sign.load_secret_key(key).public_key.key_id_hex


def test_bundle_names_the_key_it_signs_with_never_its_content(proj: Project) -> None:
    p = proj.cli("bundle", "spark-b", "--key", str(proj.key))
    assert p.returncode == 0, p.stderr
    assert f"signed with {proj.key} (key id {_key_id(proj.key)}, from --key)" in p.stderr
    assert proj.key.read_text().splitlines()[1] not in p.stdout + p.stderr


def test_a_home_folder_key_is_refused_unless_asked(proj: Project, tmp_path: Path) -> None:
    """The keygen default lies in the home folder, outside the project: found by default, it is
    refused (one line naming it); named with --key, or with --allow-outside-key, it signs."""
    config = tmp_path / "home" / ".config"
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(config)}
    home_key = config / "builder" / "builder.key"
    home_key.parent.mkdir(parents=True)
    sign.generate_keypair(home_key, home_key.with_suffix(".pub"))
    p = proj.cli("bundle", "spark-b", env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert str(home_key) in line and "outside the project" in line and "--allow-outside-key" in line
    assert not proj.out("spark-b").exists()
    p = proj.cli("bundle", "spark-b", "--allow-outside-key", env=env)
    assert p.returncode == 0, p.stderr
    assert f"signed with {home_key} (key id {_key_id(home_key)}, from the keygen default)" in p.stderr
    p = proj.cli("bundle", "spark-b", "--key", str(home_key), env=env)
    assert p.returncode == 0 and f"signed with {home_key}" in p.stderr


def test_keygen_writes_the_project_keys_and_bundle_signs_with_them(proj: Project, tmp_path: Path) -> None:
    config = tmp_path / "home" / ".config"
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(config)}
    home_key = config / "builder" / "builder.key"
    home_key.parent.mkdir(parents=True)
    sign.generate_keypair(home_key, home_key.with_suffix(".pub"))
    assert proj.cli("keygen", env=env).returncode == 0
    key = proj.root / "keys" / "builder.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    p = proj.cli("bundle", "spark-b", env=env)
    assert p.returncode == 0, p.stderr
    assert f"signed with {key} (key id {_key_id(key)}, from the project's keys/)" in p.stderr
    p = proj.cli("verify", str(proj.out("spark-b")), env=env)  # the project's keys/builder.pub checks it
    assert p.returncode == 0, p.stderr


def test_keys_folder_is_ignored_by_git() -> None:
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(["git", "-C", str(root), "check-ignore", "keys/builder.key", "keys/builder.pub"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.split() == ["keys/builder.key", "keys/builder.pub"], p.stderr


# --------------------------------------------------------------------------- refusal


def _expect_refused(d: Path, pub: Path) -> str:
    with pytest.raises((VerifyError, ConfigError)) as e:
        verify_dir(d, pub)
    return str(e.value)


def _flip_offsets(d: Path, n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    files = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    sizes = {f: (d / f).stat().st_size for f in files}
    total = sum(sizes.values())
    out = []
    # every file at least once (manifest, signature, parts, image archive), then random offsets by size
    for f in files:
        out.append((f, rng.randrange(sizes[f])))
    while len(out) < n:
        x = rng.randrange(total)
        for f in files:
            if x < sizes[f]:
                out.append((f, x))
                break
            x -= sizes[f]
    return out


def _tamper_round(d: Path, pub: Path, n: int, seed: int) -> None:
    for rel, off in _flip_offsets(d, n, seed):
        p = d / rel
        with open(p, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ (1 << random.Random(off).randrange(8))]))
        try:
            _expect_refused(d, pub)
        finally:
            with open(p, "r+b") as f:
                f.seek(off)
                f.write(b)
    verify_dir(d, pub)  # restored: accepted again


def test_tamper_20_offsets(proj: Project) -> None:
    d = _bundle(proj, with_models=True, part_size=3000)
    _tamper_round(d, proj.pub, 20, seed=4)


@pytest.mark.slow
def test_tamper_200_offsets(proj: Project) -> None:
    d = _bundle(proj, with_models=True, part_size=3000)
    _tamper_round(d, proj.pub, 220, seed=17)


def test_missing_signature_unknown_key_extra_missing(proj: Project, tmp_path: Path) -> None:
    d = _bundle(proj, with_models=True, part_size=5000)
    other = tmp_path / "other"
    other.mkdir()
    sign.generate_keypair(other / "k", other / "k.pub")
    assert "not the trusted key" in _expect_refused(d, other / "k.pub")
    (d / "extra.txt").write_text("x")
    assert "extra files not in the manifest: extra.txt" in _expect_refused(d, proj.pub)
    (d / "extra.txt").unlink()
    part = d / "parts/install.pyz.part0002"
    data = part.read_bytes()
    part.unlink()
    assert "missing files: parts/install.pyz.part0002" in _expect_refused(d, proj.pub)
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert "install.pyz.part0002: sha256 mismatch (damaged part)" in _expect_refused(d, proj.pub)
    part.write_bytes(data)
    (d / "manifest.json.minisig").unlink()
    assert "manifest.json.minisig: missing" in _expect_refused(d, proj.pub)
    # and through the CLI: exit 1, one line, no traceback
    p = proj.cli("verify", str(d), "--key", str(proj.pub))
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_path_escapes_and_links_refused_even_when_signed(proj: Project) -> None:
    d = _bundle(proj)
    good = manifest(d)
    for bad in ("../evil", "/etc/passwd", "a/../../b", "./x", "a//b"):
        m = json.loads(json.dumps(good))
        m["files"][0]["path"] = bad
        resign(d, proj.key, m)
        assert "escapes" in _expect_refused(d, proj.pub) or "odd" in _expect_refused(d, proj.pub)
    m = json.loads(json.dumps(good))
    m["models"][0]["path"] = "/etc/cron.d/evil"
    resign(d, proj.key, m)
    assert "outside paths.models" in _expect_refused(d, proj.pub)
    m = json.loads(json.dumps(good))
    m["models"][0]["path"] = "/srv/models/../../etc/x"
    resign(d, proj.key, m)
    assert "not normalized" in _expect_refused(d, proj.pub)
    resign(d, proj.key, json.loads(json.dumps(good)))
    verify_dir(d, proj.pub)
    # a link inside the bundle, even one with the right content, is refused
    os.rename(d / "stop.sh", d / "stop.real")
    os.symlink("stop.real", d / "stop.sh")
    assert "symbolic link" in _expect_refused(d, proj.pub)


def test_wrong_bundle_id_or_comment(proj: Project) -> None:
    d = _bundle(proj)
    m = manifest(d)
    m["rank"] = 1
    m["bundle_id"] = "0" * 64
    resign(d, proj.key, m, fix_id=False)
    assert "bundle_id does not match" in _expect_refused(d, proj.pub)


def test_errors_are_builder_errors(proj: Project, tmp_path: Path) -> None:
    with pytest.raises(BuilderError):
        verify_dir(tmp_path / "nope", proj.pub)


# --------------------------------------------------------------------------- memory


@pytest.mark.slow
def test_peak_memory_with_a_4gib_file(tmp_path: Path) -> None:
    """A 4 GiB model file (sparse zeros) is linked into the bundle and verified with flat memory."""
    proj = make_project(tmp_path)
    big = proj.root / "models" / "demo" / "weights-r1of2.bin"
    size = 4 * 1024**3
    with open(big, "wb") as f:
        f.truncate(size)
    h = hashlib.sha256()
    zero = bytes(4 << 20)
    for _ in range(size // len(zero)):
        h.update(zero)
    small = dict(bl.MODEL_FILES)
    del small["weights-r1of2.bin"]
    saved = bl.MODEL_FILES
    try:
        bl.MODEL_FILES = small
        bl.write_lock(proj.root)
    finally:
        bl.MODEL_FILES = saved
    # add the big file to the lock by hand
    lock = json.loads((proj.root / "pins.lock").read_text())
    lock["models"]["demo-model"]["files"].append(
        {"path": "weights-r1of2.bin", "size": size, "sha256": h.hexdigest()}
    )
    lock["models"]["demo-model"]["files"].sort(key=lambda f: f["path"])
    lock["models"]["demo-model"]["total_size"] += size
    (proj.root / "pins.lock").write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n")
    bl.write_record_for(proj.root, proj.image_id, proj.diff_ids)
    script = (
        "import sys\n"
        "from builder.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        # VmHWM: this process's own peak (ru_maxrss would carry the parent's peak across exec on Linux)
        "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM')][0].split()[1]\n"
        "print('RSS', hwm, file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    for args in (
        ["bundle", "spark-b", "--with-models", "--key", str(proj.key)],
        ["verify", str(proj.out("spark-b")), "--key", str(proj.pub)],
    ):
        p = subprocess.run(
            [sys.executable, "-c", script, "--pins", str(proj.pins), *args],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert p.returncode == 0, p.stderr
        rss_kib = int(p.stderr.rsplit("RSS", 1)[1].split()[0])
        assert rss_kib < 200 * 1024, f"{args[0]}: peak RSS {rss_kib} KiB"
    assert (proj.out("spark-b") / "models/demo-model/weights-r1of2.bin").stat().st_nlink >= 3


@pytest.mark.docker
def test_image_archive_is_deterministic(tmp_path: Path) -> None:
    """--with-image twice gives the same bytes; the archive is a docker-load archive of that ImageID."""
    if not shutil.which("docker"):
        pytest.skip("no docker CLI")
    p = make_project(tmp_path, docker_image=True, marker=f"determinism-{tmp_path}")
    a = make_bundle(_ctx(p), "spark-a", BundleOptions(key=p.key, out=tmp_path / "a", with_image=True))
    b = make_bundle(_ctx(p), "spark-a", BundleOptions(key=p.key, out=tmp_path / "b", with_image=True))
    assert a.bundle_id == b.bundle_id
    assert tree_bytes(a.path) == tree_bytes(b.path)
    with tarfile.open(a.path / "image.tar") as t:
        m = json.loads(t.extractfile("manifest.json").read())  # type: ignore[union-attr]
    assert m[0]["Config"] == f"blobs/sha256/{p.image_id.removeprefix('sha256:')}"
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".tmp-")]
    subprocess.run(["docker", "image", "rm", "-f", p.image_id], capture_output=True)


# --------------------------------------------------------------------------- a fleet with a registry


def _registry_project(tmp_path: Path, url: str) -> tuple[Project, str]:
    """A project whose fleet names the registry at ``url`` and whose image record names its manifest;
    returns it and the manifest's digest."""
    p = make_project(tmp_path)
    (p.root / "hosts" / "test.toml").write_text(bl.fleet_toml(p.hosts, registry=url))
    ctx = _ctx(p)
    rec = lane_record(ctx, bl.LANE)
    rec = rec.model_copy(update={"config_size": 321, "layer_sizes": [1234]})
    write_record(p.store, rec)
    manifest_bytes = registry.manifest_of(rec)
    assert manifest_bytes is not None
    return p, "sha256:" + hashlib.sha256(manifest_bytes).hexdigest()


def test_render_bundle_alone_sends_nothing_to_the_registry(tmp_path: Path) -> None:
    """render_bundle makes files only: the bundle names the image by the digest its record gives, and
    the fleet's registry (a listening socket here) is never connected to."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        p, digest = _registry_project(tmp_path, f"http://127.0.0.1:{port}")
        ctx = _ctx(p)
        fleet_path, fleet, host = find_host(ctx.hosts_dir, "spark-b")
        res = render_bundle(ctx, fleet_path, fleet, host, tmp_path / "b", BundleOptions(key=p.key, with_image=True))
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # (a connection would be waiting here, accepted by the kernel)
    image = manifest(res.path)["image"]
    assert image["pull"] == res.pull == f"127.0.0.1:{port}/builder/tiny@{digest}"
    assert image["archive"] is None and not (res.path / "image.tar").exists()


def test_an_unreachable_registry_fails_before_any_file_is_written(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # (closed again: nothing listens there)
    p, _ = _registry_project(tmp_path, f"http://127.0.0.1:{port}")
    out = tmp_path / "b"
    with pytest.raises(UnreachableError, match=f"registry 127.0.0.1:{port}: cannot reach"):
        make_bundle(_ctx(p), "spark-b", BundleOptions(key=p.key, out=out, with_image=True))
    assert not out.exists() and not [x for x in tmp_path.iterdir() if x.name.startswith(".tmp-")]
    # without --with-image nothing is pushed: the bundle names what an earlier push recorded (nothing here)
    res = make_bundle(_ctx(p), "spark-b", BundleOptions(key=p.key, out=out))
    assert res.pull is None and "pull" not in manifest(out)["image"]


def test_a_push_that_fails_after_rendering_leaves_no_bundle(tmp_path: Path) -> None:
    """The registry answers the preflight (its HEAD: not held yet) and then fails the push: the bundle
    just rendered is removed, so no bundle names an image its registry lacks (a deploy would take such a
    bundle as current)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # noqa: N802 (the stdlib's naming)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _fail(self) -> None:
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = do_PUT = do_PATCH = _fail  # noqa: N815

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        p, _ = _registry_project(tmp_path, f"http://127.0.0.1:{server.server_address[1]}")
        out = tmp_path / "b"
        with pytest.raises(BuilderError):
            make_bundle(_ctx(p), "spark-b", BundleOptions(key=p.key, out=out, with_image=True))
    finally:
        server.shutdown()
        server.server_close()
    assert not out.exists() and not [x for x in tmp_path.iterdir() if x.name.startswith(".tmp-")]


def test_keygen_in_a_subfolder_writes_under_the_project_root_and_never_where_git_tracks(tmp_path: Path) -> None:
    """`builder keygen [--out REL]` run in a subfolder: the keys land under the project root (found as
    pins.toml is found), and a secret key goes only where git ignores it (real git), unless the folder
    is named by an absolute path."""
    root = tmp_path / "proj"
    sub = root / "builder" / "cli"
    sub.mkdir(parents=True)
    (root / "pins.toml").write_text("")
    (root / ".gitignore").write_text("/keys/\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)

    def keygen(*args: str) -> subprocess.CompletedProcess[str]:
        return clirun.run("keygen", *args, cwd=sub)  # (no --pins: the root is found from the subfolder)

    for args in ((), ("--out", "keys", "--force")):
        p = keygen(*args)
        assert p.returncode == 0, p.stderr
        assert stat.S_IMODE((root / "keys" / "builder.key").stat().st_mode) == 0o600
        assert str(root / "keys" / "builder.key") in p.stderr
    assert sorted(x.name for x in sub.iterdir()) == []  # nothing in the folder it ran in

    p = keygen("--out", "mykeys")  # under the root, and git would track it: refused, nothing written
    assert p.returncode == 2 and "Traceback" not in p.stderr
    (line,) = p.stderr.strip().splitlines()
    assert str(root / "mykeys" / "builder.key") in line and ".gitignore" in line and "absolute path" in line
    assert not (root / "mykeys").exists()
    tracked = root / "keys" / "builder.key"
    subprocess.run([*git, "add", "-f", str(tracked)], check=True)  # a key git tracks already, ignored or not
    p = keygen("--out", "keys", "--force")
    assert p.returncode == 2 and str(tracked) in p.stderr
    p = keygen("--out", str(root / "mykeys"))  # named by an absolute path: the operator's choice
    assert p.returncode == 0, p.stderr
    assert (root / "mykeys" / "builder.key").is_file()
