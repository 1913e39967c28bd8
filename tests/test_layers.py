"""builder.image.layers: deterministic layers, configs and archives, on synthetic docker-archives."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builder.errors import BuilderError
from builder.image import layers

EPOCH = 1_735_776_000  # 2025-01-02T00:00:00Z
BASE_CREATED = "2024-06-01T00:00:00Z"


# --------------------------------------------------------------------------- helpers


def make_tar(entries: list[dict], *, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A tar from entry dicts: name, type ('file', 'dir', 'sym', 'link', 'chr', 'fifo'), data, mtime..."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for e in entries:
            ti = tarfile.TarInfo(e["name"])
            ti.mtime = e.get("mtime", 1_800_000_000.5)
            ti.uid = e.get("uid", 1000)
            ti.gid = e.get("gid", 1000)
            ti.uname = e.get("uname", "builder")
            ti.gname = e.get("gname", "builder")
            ti.mode = e.get("mode", 0o644)
            kind = e.get("type", "file")
            data = e.get("data", b"")
            if kind == "file":
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
                continue
            ti.type = {
                "dir": tarfile.DIRTYPE,
                "sym": tarfile.SYMTYPE,
                "link": tarfile.LNKTYPE,
                "chr": tarfile.CHRTYPE,
                "fifo": tarfile.FIFOTYPE,
            }[kind]
            ti.linkname = e.get("linkname", "")
            tf.addfile(ti)
    return buf.getvalue()


def normalize(tmp_path: Path, data: bytes, **kw) -> tuple[layers.LayerResult, bytes]:
    src = tmp_path / f"src-{hashlib.sha256(data).hexdigest()[:8]}.tar"
    src.write_bytes(data)
    out = io.BytesIO()
    res = layers.normalize_layer(src, out, source_date_epoch=kw.pop("epoch", EPOCH), **kw)
    return res, out.getvalue()


def members(data: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        return tf.getmembers()


TREE = [
    {"name": "usr/local/bin/engine", "data": b"\x7fELF...", "mode": 0o755},
    {"name": "etc/engine.toml", "data": b"port = 8080\n"},
    {"name": "etc", "type": "dir", "mode": 0o755},
    {"name": "usr/local/bin/tf", "type": "sym", "linkname": "engine", "mode": 0o777},
]


def docker_archive(
    layer_tars: list[bytes], *, created: str = "2026-11-29T12:35:37.2Z", extra: dict | None = None
) -> bytes:
    """A docker-save style archive (legacy layout, like Docker 20.10 writes) around the given layers."""
    diff_ids = ["sha256:" + hashlib.sha256(t).hexdigest() for t in layer_tars]
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "container": "97f6db259a13",
        "docker_version": "20.10.24",
        "container_config": {"Hostname": "97f6db259a13", "Cmd": ["/bin/sh", "-c", "#(nop) CMD"]},
        "config": {
            "Hostname": "",
            "Env": ["PATH=/usr/bin"],
            "Entrypoint": ["/usr/local/bin/engine"],
            "Cmd": ["serve"],
            "WorkingDir": "",
            "ExposedPorts": {"8080/tcp": {}},
            "Image": "sha256:" + "1" * 64,
            "Labels": {"from.recipe": "yes"},
            "Volumes": None,
        },
        "history": [
            # The first entry stands for a base image's layer: its date is the base's, not this build's.
            {
                "created": BASE_CREATED if i == 0 else created,
                "created_by": f"/bin/sh -c #(nop) COPY file:{'a' * 64} in /x",
            }
            for i in range(len(layer_tars))
        ]
        + [{"created": created, "created_by": '/bin/sh -c #(nop)  CMD ["serve"]', "empty_layer": True}],
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        **(extra or {}),
    }
    config_bytes = json.dumps(config).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    files: dict[str, bytes] = {config_name: config_bytes}
    names = []
    for i, t in enumerate(layer_tars):
        d = f"{i:064x}"
        files[f"{d}/layer.tar"] = t
        files[f"{d}/VERSION"] = b"1.0"
        names.append(f"{d}/layer.tar")
    files["manifest.json"] = json.dumps(
        [{"Config": config_name, "RepoTags": ["x:1"], "Layers": names}]
    ).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mtime = 1_800_000_000
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def chunks(data: bytes, size: int = 777):
    for i in range(0, len(data), size):
        yield data[i : i + size]


# --------------------------------------------------------------------------- one layer


def test_two_mtimes_give_one_diff_id(tmp_path: Path) -> None:
    a = make_tar([{**e, "mtime": 1_800_000_000.25} for e in TREE])
    b = make_tar([{**e, "mtime": 1_900_000_123} for e in reversed(TREE)])
    assert a != b
    ra, da = normalize(tmp_path, a)
    rb, db = normalize(tmp_path, b)
    assert ra.diff_id == rb.diff_id
    assert da == db
    assert ra.diff_id == "sha256:" + hashlib.sha256(da).hexdigest()
    assert ra.size == len(da)
    # A content change is still a change.
    c = make_tar([{**TREE[0], "data": b"other"}, *TREE[1:]])
    rc, _ = normalize(tmp_path, c)
    assert rc.diff_id != ra.diff_id


def test_headers_are_normalized(tmp_path: Path) -> None:
    old = 1_000_000_000  # before the epoch: kept (clamping only lowers)
    data = make_tar([*TREE, {"name": "opt/old.txt", "data": b"x", "mtime": old, "mode": 0o4755}])
    _, out = normalize(tmp_path, data)
    ms = members(out)
    names = [m.name for m in ms]
    assert names == sorted(names, key=lambda n: n.encode())
    # Parents are explicit and come before their children.
    assert names == [
        "etc",
        "etc/engine.toml",
        "opt",
        "opt/old.txt",
        "usr",
        "usr/local",
        "usr/local/bin",
        "usr/local/bin/engine",
        "usr/local/bin/tf",
    ]
    for m in ms:
        assert (m.uid, m.gid, m.uname, m.gname) == (0, 0, "", "")
        assert isinstance(m.mtime, int)
        assert m.mtime == (old if m.name == "opt/old.txt" else EPOCH)
        assert m.pax_headers == {}
    by = {m.name: m for m in ms}
    assert by["opt/old.txt"].mode == 0o4755  # permission bits (setuid too) survive
    assert by["usr/local/bin/engine"].mode == 0o755
    assert by["usr"].isdir() and by["usr"].mode == 0o755
    assert by["usr/local/bin/tf"].issym() and by["usr/local/bin/tf"].linkname == "engine"
    # No PAX extended headers at all in the bytes: ustar magic on every header, no 'x' type.
    assert b"PaxHeader" not in out


def test_keep_owners(tmp_path: Path) -> None:
    _, out = normalize(tmp_path, make_tar(TREE), keep_owners=True)
    assert {(m.uid, m.gid) for m in members(out) if m.name == "etc/engine.toml"} == {(1000, 1000)}
    assert all(m.uname == "" for m in members(out))


def test_hardlinks_become_files(tmp_path: Path) -> None:
    data = make_tar(
        [
            {"name": "bin/a", "data": b"payload", "mode": 0o755},
            {"name": "bin/b", "type": "link", "linkname": "bin/a"},
        ]
    )
    _, out = normalize(tmp_path, data)
    with tarfile.open(fileobj=io.BytesIO(out)) as tf:
        b = tf.getmember("bin/b")
        assert b.isreg() and not b.islnk()
        assert b.mode == 0o755
        assert tf.extractfile(b).read() == b"payload"  # type: ignore[union-attr]


def test_hardlink_to_missing_target_is_refused(tmp_path: Path) -> None:
    data = make_tar([{"name": "bin/b", "type": "link", "linkname": "bin/elsewhere"}])
    with pytest.raises(BuilderError, match="target not in this layer"):
        normalize(tmp_path, data)


def test_devices_and_fifos_are_skipped(tmp_path: Path) -> None:
    data = make_tar([*TREE, {"name": "dev/null", "type": "chr"}, {"name": "run/pipe", "type": "fifo"}])
    res, out = normalize(tmp_path, data)
    assert set(res.skipped) == {"dev/null", "run/pipe"}
    names = {m.name for m in members(out)}
    assert "dev/null" not in names and "run/pipe" not in names
    assert res.diff_id == normalize(tmp_path, make_tar(TREE))[0].diff_id


@pytest.mark.parametrize("bad", ["/etc/passwd", "../escape", "a/../../b", "usr/../../etc"])
def test_unsafe_paths_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(BuilderError, match="absolute path|escapes the layer"):
        normalize(tmp_path, make_tar([{"name": bad, "data": b"x"}]))


def test_dot_slash_names_and_duplicates(tmp_path: Path) -> None:
    data = make_tar(
        [
            {"name": "./a.txt", "data": b"old"},
            {"name": "a.txt", "data": b"new"},
            {"name": "./", "type": "dir"},
        ]
    )
    _, out = normalize(tmp_path, data)
    with tarfile.open(fileobj=io.BytesIO(out)) as tf:
        assert tf.getnames() == ["a.txt"]
        assert tf.extractfile("a.txt").read() == b"new"  # type: ignore[union-attr]


def test_long_names_still_normalize(tmp_path: Path) -> None:
    long = "d/" + "x" * 150 + ".txt"
    a, _ = normalize(tmp_path, make_tar([{"name": long, "data": b"1", "mtime": 1_800_000_001}]))
    b, _ = normalize(
        tmp_path, make_tar([{"name": long, "data": b"1", "mtime": 1_900_000_001}], fmt=tarfile.GNU_FORMAT)
    )
    assert a.diff_id == b.diff_id


@settings(max_examples=25, deadline=None)
@given(
    perm=st.permutations(list(range(len(TREE)))),
    mtimes=st.lists(st.integers(min_value=EPOCH, max_value=2**33), min_size=len(TREE), max_size=len(TREE)),
)
def test_order_and_times_never_matter(tmp_path_factory: pytest.TempPathFactory, perm, mtimes) -> None:
    tmp = tmp_path_factory.mktemp("h")
    entries = [{**TREE[i], "mtime": mtimes[i]} for i in perm]
    res, _ = normalize(tmp, make_tar(entries))
    ref, _ = normalize(tmp, make_tar(TREE))
    assert res.diff_id == ref.diff_id


# --------------------------------------------------------------------------- whole images


def test_normalize_image_is_deterministic(tmp_path: Path) -> None:
    base = make_tar([{"name": "lib/base.so", "data": b"base", "mtime": 1_600_000_000}])
    added_1 = make_tar([{**e, "mtime": 1_800_000_000} for e in TREE])
    added_2 = make_tar([{**e, "mtime": 1_900_000_000} for e in reversed(TREE)])
    arch_1 = docker_archive([base, added_1], created="2026-11-29T12:00:00Z")
    arch_2 = docker_archive([base, added_2], created="2027-01-01T00:00:00Z")
    labels = {"org.opencontainers.image.revision": "3" * 40}
    r1 = layers.normalize_image(
        chunks(arch_1), tmp_path / "w1", source_date_epoch=EPOCH, base_layers=1, labels=labels
    )
    r2 = layers.normalize_image(
        io.BytesIO(arch_2), tmp_path / "w2", source_date_epoch=EPOCH, base_layers=1, labels=labels
    )
    assert r1.image_id == r2.image_id
    assert r1.config == r2.config
    assert r1.image_id == "sha256:" + hashlib.sha256(r1.config).hexdigest()
    # The base layer went through byte for byte; the added one was rewritten.
    assert r1.layers[0].path.read_bytes() == base
    assert r1.layers[1].path.read_bytes() != added_1
    assert r1.diff_ids[0] == "sha256:" + hashlib.sha256(base).hexdigest()
    assert r1.diff_ids[1] == "sha256:" + hashlib.sha256(r1.layers[1].path.read_bytes()).hexdigest()

    cfg = json.loads(r1.config)
    assert cfg["created"] == "2025-01-02T00:00:00Z"
    assert cfg["rootfs"] == {"type": "layers", "diff_ids": r1.diff_ids}
    assert cfg["config"] == {
        "Env": ["PATH=/usr/bin"],
        "Entrypoint": ["/usr/local/bin/engine"],
        "Cmd": ["serve"],
        "ExposedPorts": {"8080/tcp": {}},
        "Labels": {"from.recipe": "yes", **labels},
    }
    for noise in ("container", "container_config", "docker_version"):
        assert noise not in cfg
    # The base's history entry is kept as it was; the added ones carry the epoch, no source hashes.
    assert cfg["history"][0]["created"] == BASE_CREATED
    assert [h["created"] for h in cfg["history"][1:]] == ["2025-01-02T00:00:00Z"] * 2
    assert cfg["history"][1]["created_by"] == "/bin/sh -c #(nop) COPY file:- in /x"
    assert "a" * 64 in cfg["history"][0]["created_by"]  # the base's entry is untouched
    assert cfg["history"][2]["empty_layer"] is True
    # Canonical bytes: sorted keys, no spaces.
    assert r1.config == json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()

    # The archives are byte-identical too, whether streamed or written.
    a1 = tmp_path / "a1.tar"
    d1 = layers.write_archive(r1, a1, repo_tags=["demo:x"], mtime=EPOCH)
    streamed = b"".join(layers.archive_chunks(r2, repo_tags=["demo:x"], mtime=EPOCH))
    assert a1.read_bytes() == streamed
    assert d1 == hashlib.sha256(streamed).hexdigest()
    assert len(streamed) % tarfile.RECORDSIZE == 0


def test_archive_layout(tmp_path: Path) -> None:
    added = make_tar(TREE)
    rec = layers.normalize_image(io.BytesIO(docker_archive([added])), tmp_path / "w", source_date_epoch=EPOCH)
    data = b"".join(layers.archive_chunks(rec, repo_tags=["demo:abc"], mtime=EPOCH))
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        ms = tf.getmembers()
        names = [m.name for m in ms]
        assert names == sorted(names)
        assert all(m.mtime == EPOCH and m.uid == 0 and m.gid == 0 for m in ms)
        manifest = json.loads(tf.extractfile("manifest.json").read())  # type: ignore[union-attr]
        assert manifest == [
            {
                "Config": "blobs/sha256/" + rec.image_id.removeprefix("sha256:"),
                "RepoTags": ["demo:abc"],
                "Layers": ["blobs/sha256/" + rec.diff_ids[0].removeprefix("sha256:")],
            }
        ]
        layer = tf.extractfile(manifest[0]["Layers"][0]).read()  # type: ignore[union-attr]
        assert "sha256:" + hashlib.sha256(layer).hexdigest() == rec.diff_ids[0]
        assert layer[:2] != b"\x1f\x8b"  # uncompressed
        index = json.loads(tf.extractfile("index.json").read())  # type: ignore[union-attr]
        assert index["manifests"][0]["digest"] == rec.manifest_digest
        oci = tf.extractfile("blobs/sha256/" + rec.manifest_digest.removeprefix("sha256:")).read()  # type: ignore[union-attr]
        assert json.loads(oci)["config"]["digest"] == rec.image_id


def test_read_image_passes_through(tmp_path: Path) -> None:
    added = make_tar(TREE)
    arch = docker_archive([added])
    rec = layers.read_image(io.BytesIO(arch), tmp_path / "w")
    cfg_in = [m for m in members(arch) if m.name.endswith(".json") and m.name != "manifest.json"][0]
    with tarfile.open(fileobj=io.BytesIO(arch)) as tf:
        assert rec.config == tf.extractfile(cfg_in).read()  # type: ignore[union-attr]
    assert rec.layers[0].path.read_bytes() == added
    a = layers.write_archive(rec, tmp_path / "a.tar")
    rec2 = layers.read_image(tmp_path / "a.tar", tmp_path / "w2")
    assert rec2.image_id == rec.image_id and rec2.diff_ids == rec.diff_ids
    assert layers.write_archive(rec2, tmp_path / "b.tar") == a


def test_gzip_base_layer_is_decompressed_and_checked(tmp_path: Path) -> None:
    base = make_tar([{"name": "lib/base.so", "data": b"base"}])
    arch = docker_archive([base])
    # Replace the layer bytes with their gzip form (as newer engines may write); the DiffID stays.
    with tarfile.open(fileobj=io.BytesIO(arch)) as tf:
        files = {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}  # type: ignore[union-attr]
    layer_name = next(n for n in files if n.endswith("layer.tar"))
    files[layer_name] = gzip.compress(base, mtime=0)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for n, d in files.items():
            ti = tarfile.TarInfo(n)
            ti.size = len(d)
            tf.addfile(ti, io.BytesIO(d))
    rec = layers.read_image(io.BytesIO(buf.getvalue()), tmp_path / "w")
    assert rec.layers[0].path.read_bytes() == base


def test_base_layers_must_match(tmp_path: Path) -> None:
    base = make_tar([{"name": "lib/base.so", "data": b"base"}])
    arch = docker_archive([base, make_tar(TREE)])
    good = "sha256:" + hashlib.sha256(base).hexdigest()
    rec = layers.normalize_image(
        io.BytesIO(arch), tmp_path / "ok", source_date_epoch=EPOCH, base_layers=[good]
    )
    assert rec.diff_ids[0] == good
    with pytest.raises(BuilderError, match="expected base layers"):
        layers.normalize_image(
            io.BytesIO(arch), tmp_path / "bad", source_date_epoch=EPOCH, base_layers=["sha256:" + "0" * 64]
        )
    with pytest.raises(BuilderError, match="base_layers=3"):
        layers.normalize_image(io.BytesIO(arch), tmp_path / "bad2", source_date_epoch=EPOCH, base_layers=3)


def test_tampered_base_layer_is_refused(tmp_path: Path) -> None:
    base = make_tar([{"name": "lib/base.so", "data": b"base"}])
    arch = docker_archive([base], extra={"rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]}})
    with pytest.raises(BuilderError, match="the config says"):
        layers.read_image(io.BytesIO(arch), tmp_path / "w")


def test_bad_archives(tmp_path: Path) -> None:
    with pytest.raises(BuilderError, match="not a docker archive"):
        layers.read_image(io.BytesIO(b"not a tar at all" * 64), tmp_path / "a")
    empty = io.BytesIO()
    with tarfile.open(fileobj=empty, mode="w"):
        pass
    with pytest.raises(BuilderError, match="manifest.json"):
        layers.read_image(io.BytesIO(empty.getvalue()), tmp_path / "b")
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tf:
        ti = tarfile.TarInfo("../manifest.json")
        tf.addfile(ti, io.BytesIO(b""))
    with pytest.raises(BuilderError, match="escapes"):
        layers.read_image(io.BytesIO(evil.getvalue()), tmp_path / "c")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(BuilderError, match="not empty"):
        layers.read_image(io.BytesIO(docker_archive([make_tar(TREE)])), tmp_path / "busy")
