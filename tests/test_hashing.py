"""Hashing on real files: builder.foundation.hashing's, and the installer's check of a model file.

The installer (builder.installer.record.model_ok) reports a size mismatch without reading a byte,
trusts a file whose apply record still vouches for it (size, mtime and inode as when it was hashed),
and hashes the rest; fast mode catches a replaced file and (documented) trusts an in-place edit whose
mtime was put back.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from builder.core.fastmode import fast_mode_drift
from builder.errors import ResolveError
from builder.foundation import hashing
from builder.foundation.canon import address, sha256_tree
from builder.installer.record import model_cached, model_ok, model_records


def _make(root: Path, n: int = 6) -> list[dict[str, Any]]:
    """Model files under ``root`` as an install's manifest lists them: absolute path, size, sha256."""
    out = []
    for i in range(n):
        data = os.urandom(1000 + i * 70_000) + bytes([i]) * (i * 5_000_000 // max(1, n))
        p = root / "sub" / f"f{i}.bin" if i % 2 else root / f"f{i}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        out.append({"path": str(p), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return out


def _record(models: list[dict[str, Any]]) -> dict[str, Any]:
    """The apply record's models, as an install writes them once the files are in place."""
    return {"models": model_records({"models": models})}


def test_sha256_file_matches_hashlib_and_openssl(tmp_path: Path) -> None:
    p = tmp_path / "x"
    data = os.urandom(hashing.READ_SIZE * 2 + 12345)
    p.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert hashing.sha256_file(p) == (want, len(data))
    assert hashing.sha256_file(p, read_size=1000) == (want, len(data))
    out = subprocess.run(["openssl", "dgst", "-sha256", "-r", str(p)], capture_output=True, text=True)
    if out.returncode == 0:
        assert out.stdout.split()[0] == want


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "empty"
    p.write_bytes(b"")
    assert hashing.sha256_file(p) == (hashlib.sha256(b"").hexdigest(), 0)
    assert model_ok({"path": str(p), "size": 0, "sha256": hashlib.sha256(b"").hexdigest()}, None) is None


def test_a_folder_hashed_in_parallel_equals_serial(tmp_path: Path) -> None:
    models = _make(tmp_path)
    rels = [os.path.relpath(m["path"], tmp_path) for m in models]
    par = hashing.hash_folder_files(tmp_path, rels, where="models.m", workers=4)
    ser = hashing.hash_folder_files(tmp_path, rels, where="models.m", workers=1)
    assert par == ser == [(r, m["sha256"], m["size"]) for r, m in zip(rels, models, strict=True)]  # in order
    os.unlink(models[2]["path"])
    with pytest.raises(ResolveError, match=f"^models.m: file vanished: {rels[2]} "):
        hashing.hash_folder_files(tmp_path, rels, where="models.m", workers=2)


def test_full_check_all_good(tmp_path: Path) -> None:
    assert [model_ok(m, None) for m in _make(tmp_path)] == [None] * 6


def test_full_check_finds_one_corrupted_byte(tmp_path: Path) -> None:
    models = _make(tmp_path)
    victim = models[3]
    with open(victim["path"], "r+b") as f:
        f.seek(victim["size"] // 2)
        b = f.read(1)
        f.seek(victim["size"] // 2)
        f.write(bytes([b[0] ^ 0x01]))
    assert [model_ok(m, None) for m in models] == [None, None, None, "sha256 differs", None, None]


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("rchar:"))


def test_size_mismatch_found_without_reading(tmp_path: Path) -> None:
    """The kernel's count of bytes this process read (/proc/self/io rchar) barely moves: the 32 MiB
    file with one byte appended is reported from its size, never hashed."""
    if not os.path.exists("/proc/self/io"):
        pytest.skip("no /proc/self/io")
    big = tmp_path / "big.bin"
    data = os.urandom(1 << 20) * 32
    big.write_bytes(data + b"x")
    m = {"path": str(big), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    before = _rchar()
    why = model_ok(m, None)
    read = _rchar() - before
    assert why == f"{len(data) + 1} bytes, expected {len(data)}"
    assert read < 1 << 20, f"read {read} bytes"
    # and the same file with the right size is read in full (the counter does count our reads)
    big.write_bytes(data)
    before = _rchar()
    assert model_ok(m, None) is None
    assert _rchar() - before >= len(data)


def test_size_mismatch_on_sparse_file_is_instant(tmp_path: Path) -> None:
    """A 1 TiB sparse file with the wrong size is reported from its stat alone (reading it would take
    minutes, and the check returns the size problem, not a hash)."""
    p = tmp_path / "huge"
    with open(p, "wb") as f:
        f.truncate(1 << 40)
    assert model_ok({"path": str(p), "size": 5, "sha256": "0" * 64}, None) == f"{1 << 40} bytes, expected 5"


def test_missing_and_not_a_file(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    assert model_ok({"path": str(tmp_path / "nope"), "size": 1, "sha256": "0" * 64}, None) == "missing"
    assert model_ok({"path": str(tmp_path / "dir"), "size": 1, "sha256": "0" * 64}, None) == "not a regular file"


def test_fast_mode_passes_with_a_fresh_record_and_reads_nothing(tmp_path: Path) -> None:
    models = _make(tmp_path)
    record = _record(models)
    assert all(model_cached(m, record) for m in models)
    if os.path.exists("/proc/self/io"):
        before = _rchar()
        assert [model_ok(m, record) for m in models] == [None] * 6
        assert _rchar() - before < 1 << 20
    # the staged release's record beside the applied one: either may vouch
    assert [model_ok(m, [None, record]) for m in models] == [None] * 6


def test_fast_mode_catches_a_replaced_file(tmp_path: Path) -> None:
    models = _make(tmp_path, n=3)
    record = _record(models)
    victim = Path(models[2]["path"])
    st = os.stat(victim)
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    new = victim.with_name(victim.name + ".new")
    new.write_bytes(bytes(data))
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only the inode differs
    os.replace(new, victim)
    assert os.stat(victim).st_ino != st.st_ino
    assert [model_cached(m, record) for m in models] == [True, True, False]
    assert [model_ok(m, record) for m in models] == [None, None, "sha256 differs"]  # hashed, not trusted


def test_fast_mode_catches_an_edit_that_moves_mtime(tmp_path: Path) -> None:
    models = _make(tmp_path, n=3)
    record = _record(models)
    victim = models[0]["path"]
    st = os.stat(victim)
    with open(victim, "r+b") as f:
        f.write(b"Z")
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert [model_cached(m, record) for m in models] == [False, True, True]
    assert [model_ok(m, record) for m in models] == ["sha256 differs", None, None]


def test_fast_mode_trusts_an_in_place_same_size_edit_with_restored_mtime(tmp_path: Path) -> None:
    """Documented limit: fast mode trusts the file system. An in-place edit of the same size whose
    mtime is put back keeps size, mtime and inode, so fast mode passes it; full mode catches it."""
    models = _make(tmp_path, n=3)
    record = _record(models)
    victim = models[1]["path"]
    st = os.stat(victim)
    with open(victim, "r+b") as f:
        f.seek(10)
        f.write(b"\x00\x01\x02")
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(victim).st_ino == st.st_ino
    assert [model_ok(m, record) for m in models] == [None, None, None]
    assert [model_ok(m, None) for m in models] == [None, "sha256 differs", None]


def test_fast_mode_never_vouches_without_a_record(tmp_path: Path) -> None:
    models = _make(tmp_path, n=2)
    record = _record(models[:1])
    assert [model_cached(m, record) for m in models] == [True, False]
    # a record for another sha256 (a new lock for the same path) does not count either
    stale = {"models": [dict(r, sha256="f" * 64) for r in _record(models)["models"]]}
    assert [model_cached(m, stale) for m in models] == [False, False]
    # nor does a damaged record, or none
    assert not any(model_cached(m, rec) for m in models for rec in ({"models": "x"}, {}, None))


def test_fast_mode_size_change_reported(tmp_path: Path) -> None:
    models = _make(tmp_path, n=2)
    record = _record(models)
    with open(models[0]["path"], "ab") as f:
        f.write(b"more")
    assert model_ok(models[0], record) == f"{models[0]['size'] + 4} bytes, expected {models[0]['size']}"


def test_in_parallel_keeps_the_items_order_and_starts_the_largest_first() -> None:
    started: list[int] = []
    sizes = [1, 50, 3, 20]

    def one(n: int) -> int:
        started.append(n)
        return n * 10

    assert hashing.in_parallel(one, sizes, size=lambda n: n, workers=1) == [10, 500, 30, 200]
    assert started == [50, 20, 3, 1]
    assert hashing.in_parallel(one, sizes, size=lambda n: n, workers=3) == [10, 500, 30, 200]
    assert hashing.in_parallel(one, []) == []


def test_fast_mode_drift_names_each_kind_of_drift(tmp_path: Path) -> None:
    models = _make(tmp_path, n=1)
    (rec,) = _record(models)["models"]
    st = os.stat(models[0]["path"])
    # the operator side's stamps (builder.store.modelstore's) are the record's keys, read by the same rule
    assert hashing.stamp(models[0]["path"]) == {k: rec[k] for k in ("size", "mtime", "inode")}
    e = SimpleNamespace(**models[0])
    assert fast_mode_drift(rec, e.sha256, e.size, st.st_size, st.st_mtime_ns, st.st_ino) is None
    assert fast_mode_drift(None, e.sha256, e.size, st.st_size, st.st_mtime_ns, st.st_ino) == "no-record"
    assert fast_mode_drift(dict(rec, sha256="f" * 64), e.sha256, e.size, st.st_size, st.st_mtime_ns,
                           st.st_ino) == "no-record"
    assert fast_mode_drift(rec, e.sha256, e.size, st.st_size + 1, st.st_mtime_ns, st.st_ino) == "size"
    assert fast_mode_drift(rec, e.sha256, e.size, st.st_size, st.st_mtime_ns, st.st_ino + 1) == "replaced"
    assert fast_mode_drift(rec, e.sha256, e.size, st.st_size, st.st_mtime_ns + 1, st.st_ino) == "modified"
    # seconds as a float (another writer's record) match within a millisecond, nanoseconds exactly
    secs = dict(rec, mtime=st.st_mtime_ns / 1e9)
    assert fast_mode_drift(secs, e.sha256, e.size, st.st_size, st.st_mtime_ns + 1, st.st_ino) is None
    assert fast_mode_drift(secs, e.sha256, e.size, st.st_size, st.st_mtime_ns + 2_000_000, st.st_ino) == "modified"
    assert fast_mode_drift(dict(rec, mtime="x"), e.sha256, e.size, st.st_size, st.st_mtime_ns, st.st_ino) == (
        "modified")


TREE_HASH_AS = """
import os, sys
from pathlib import Path
from builder.foundation.canon import sha256_tree
if os.geteuid() == 0:  # root may run anything with an x bit: hash as a user who may not run this file
    os.setgid(65534)
    os.setuid(65534)
assert not os.access(Path(sys.argv[1]) / "bin" / "run", os.X_OK)
print(sha256_tree(Path(sys.argv[1])))
"""


def test_a_tree_hash_reads_the_mode_bits_not_who_may_run_the_file() -> None:
    """The exec bit in sha256_tree is the file's own (any x bit), whoever hashes it: a file this user
    may not run (its x bit is the group's only) hashes as executable, as it does for its owner and in git."""
    d = Path(tempfile.mkdtemp(prefix="builder-test-tree-"))  # (the other user must reach it: not tmp_path)
    try:
        d.chmod(0o755)
        (d / "bin").mkdir(mode=0o755)
        run = d / "bin" / "run"
        run.write_bytes(b"#!/bin/sh\necho hi\n")
        (d / "README").write_bytes(b"hi\n")
        (d / "README").chmod(0o644)
        run.chmod(0o755)
        want = address(sorted([["README", "644", hashlib.sha256(b"hi\n").hexdigest()],
                               ["bin/run", "755", hashlib.sha256(b"#!/bin/sh\necho hi\n").hexdigest()]]))
        assert sha256_tree(d) == want
        run.chmod(0o654)  # x for the group only: neither root's nor the owner's nor others' to run
        p = subprocess.run([sys.executable, "-c", TREE_HASH_AS, str(d)], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == want
    finally:
        shutil.rmtree(d, ignore_errors=True)
