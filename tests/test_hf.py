"""builder.lock.hf against a FAKE Hub (tests/lib/fakehub.py, real HTTP on 127.0.0.1) and real files on disk."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.errors import ConfigError, ResolveError
from builder.inputs.pins import HfModel
from builder.lock import hf
from builder.lock.lockfile import LockedModel
from tests.lib import clirun, factory
from tests.lib.fakehub import FakeHub

TOKEN = "hf_FakeTokenForTests0123456789abcdefXYZ"
H = "0" * 64
FILES = {
    "config.json": b'{"hidden_size": 8}\n',
    "tokenizer.json": b'{"vocab": {}}\n',
    "model-00001-of-00003.safetensors": b"\x01" * 4096,
    "model-00002-of-00003.safetensors": b"\x02" * 4096,
    "model-00003-of-00003.safetensors": b"\x03" * 4096,
    "original/consolidated.pth": b"\x04" * 100,
}
LFS = {p for p in FILES if p.endswith((".safetensors", ".pth"))}


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    with FakeHub(token=TOKEN) as h:
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "std-hub"))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        import huggingface_hub.constants as hc

        # huggingface_hub reads HF_HUB_OFFLINE once, at import (conftest sets it for every test)
        monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
        yield h


def resolve(
    spec: HfModel,
    tmp_path: Path,
    *,
    offline: bool = False,
    previous: LockedModel | None = None,
    name: str = "m",
) -> LockedModel:
    return hf.resolve(
        name, spec, root=tmp_path, cache=tmp_path / "cache", offline=offline, spec_hash=H, previous=previous
    )


def test_hub_lock_uses_lfs_metadata_and_hashes_small_files(hub: FakeHub, tmp_path: Path) -> None:
    commit = hub.add_repo("org/model", FILES, lfs=LFS)
    got = resolve(HfModel(repo="org/model", revision="main", exclude=["original/*"]), tmp_path)
    assert got.commit == commit and got.source == "hub" and got.revision == "main"
    assert [(f.path, f.size, f.sha256) for f in got.files] == sorted(
        (p, len(b), sha(b)) for p, b in FILES.items() if not p.startswith("original/")
    )
    assert got.total_size == sum(len(b) for p, b in FILES.items() if not p.startswith("original/"))
    # LFS files were not downloaded; small ones were
    downloads = {
        s.path.rsplit("/", 1)[-1] for s in hub.requests if s.method == "GET" and "/resolve/" in s.path
    }
    assert downloads == {"config.json", "tokenizer.json"}
    # every request carried the token
    assert all(
        s.authorization == f"Bearer {TOKEN}"
        for s in hub.requests
        if s.path.startswith(("/api/models", "/org/"))
    )
    assert TOKEN not in got.model_dump_json()


def test_include_patterns_expect_files_and_pinned_commit(hub: FakeHub, tmp_path: Path) -> None:
    commit = hub.add_repo("org/model", FILES, lfs=LFS)
    spec = HfModel(repo="org/model", revision=commit, include=["model-0000[23]-*"], expect_files=2)
    got = resolve(spec, tmp_path)
    assert [f.path for f in got.files] == [
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    with pytest.raises(ResolveError, match=r"models\.m: expected 3 files, found 2"):
        resolve(spec.model_copy(update={"expect_files": 3}), tmp_path)
    with pytest.raises(ResolveError, match=r"models\.m: no files of org/model"):
        resolve(HfModel(repo="org/model", revision="main", include=["*.gguf"]), tmp_path)


def test_hub_errors_are_one_line_without_the_token(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.add_repo("org/model", FILES, lfs=LFS)
    cases = [
        (HfModel(repo="org/none", revision="main"), "RepositoryNotFound"),
        (HfModel(repo="org/model", revision="nope"), "RevisionNotFound"),
    ]
    for spec, what in cases:
        with pytest.raises(ResolveError) as ei:
            resolve(spec, tmp_path)
        assert str(ei.value).startswith(f"models.m: {spec.repo}@{spec.revision}: ") and what in str(ei.value)
    monkeypatch.setenv("HF_TOKEN", "hf_WrongTokenForTests0123456789abcdefXYZ")
    with pytest.raises(ResolveError) as ei:
        resolve(HfModel(repo="org/model", revision="main"), tmp_path)
    assert "401" in str(ei.value) and "hf_Wrong" not in str(ei.value) and "\n" not in str(ei.value)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ResolveError, match=r"models\.m: org/model@main: .*(refused|connect)"):
        resolve(HfModel(repo="org/model", revision="main"), tmp_path)


def test_scrub_removes_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert TOKEN not in hf.scrub(f"failed with Authorization: Bearer {TOKEN} at x")
    assert "hf_Other0123456789abcdefghijk" not in hf.scrub("token hf_Other0123456789abcdefghijk leaked")


def test_cli_lock_against_the_fake_hub_keeps_the_token_out(hub: FakeHub, tmp_path: Path) -> None:
    commit = hub.add_repo("org/model", FILES, lfs=LFS)
    proj = tmp_path / "proj"
    proj.mkdir()
    factory.write_pins(proj, factory.pins(models={"m": factory.model("org/model")}))
    env: dict[str, str] = {}  # (what the child gets beyond tests.lib.clirun.environment())
    p = clirun.run("lock", "--json", cwd=proj, pins=proj / "pins.toml", env=clirun.environment(env))
    assert p.returncode == 0, p.stderr
    lock = (proj / "pins.lock").read_text()
    assert json.loads(lock)["models"]["m"]["commit"] == commit
    assert TOKEN not in lock and TOKEN not in p.stdout and TOKEN not in p.stderr
    # a failure is one line, exit 1, no token
    factory.write_pins(proj, factory.pins(models={"m": factory.model("org/gone")}))
    env["HF_TOKEN"] = TOKEN
    p = clirun.run("lock", cwd=proj, pins=proj / "pins.toml", env=clirun.environment(env))
    assert p.returncode == 1 and "Traceback" not in p.stderr and TOKEN not in p.stderr
    assert [ln for ln in p.stderr.splitlines() if ln.startswith("error:")][0].startswith(
        "error: models.m: org/gone@main"
    )


# ---------------------------------------------------------------------------------------
# files on disk


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)


def make_hf_cache(hub_dir: Path, repo: str, commit: str, files: dict[str, bytes], ref: str = "main") -> Path:
    """The layout huggingface_hub writes: blobs/<etag>, snapshots/<commit>/<path> -> ../blobs, refs/<ref>."""
    repo_dir = hub_dir / ("models--" + repo.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / ref).write_text(commit)
    (repo_dir / "blobs").mkdir()
    for rel, data in files.items():
        blob = repo_dir / "blobs" / sha(data)
        blob.write_bytes(data)
        link = repo_dir / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    return repo_dir


def test_plain_local_folder(tmp_path: Path) -> None:
    commit = "ab" * 20
    write_files(tmp_path / "snap", FILES)
    write_files(tmp_path / "snap", {".cache/huggingface/x.lock": b"", ".git/HEAD": b"ref"})
    got = resolve(HfModel(repo="org/model", revision=commit, local="snap"), tmp_path)
    assert got.source == "local" and got.commit == commit
    assert {f.path: f.sha256 for f in got.files} == {p: sha(b) for p, b in FILES.items()}
    with pytest.raises(ConfigError, match=r"models\.m\.revision: a plain local folder needs a 40-hex"):
        resolve(HfModel(repo="org/model", revision="main", local="snap"), tmp_path)
    with pytest.raises(ResolveError, match=r"models\.m: local folder not found"):
        resolve(HfModel(repo="org/model", revision=commit, local="nope"), tmp_path)


def test_hf_cache_layout_by_ref_and_by_commit(tmp_path: Path) -> None:
    commit = "cd" * 20
    repo_dir = make_hf_cache(tmp_path / "hub", "org/model", commit, FILES)
    for local in (str(repo_dir), str(tmp_path / "hub")):
        for rev in ("main", commit):
            got = resolve(
                HfModel(repo="org/model", revision=rev, local=local, include=["*.safetensors"]), tmp_path
            )
            assert got.commit == commit and len(got.files) == 3
            assert got.files[0].sha256 == sha(FILES["model-00001-of-00003.safetensors"])
    with pytest.raises(ResolveError, match=r"revision dev of org/model is not in the HF cache"):
        resolve(HfModel(repo="org/model", revision="dev", local=str(repo_dir)), tmp_path)


def test_offline_uses_the_standard_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hc

    commit = "ef" * 20
    make_hf_cache(tmp_path / "std", "org/model", commit, FILES)
    # (huggingface_hub reads HF_HUB_CACHE, HF_HOME and XDG_CACHE_HOME once, at import: builder asks it)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "std"))
    got = resolve(HfModel(repo="org/model", revision="main"), tmp_path, offline=True)
    assert got.commit == commit and got.source == "local" and len(got.files) == len(FILES)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "home" / "hub"))
    with pytest.raises(ResolveError) as ei:
        resolve(HfModel(repo="org/model", revision="main"), tmp_path, offline=True)
    assert str(ei.value) == "models.m: not in the cache and --offline was given (org/model@main)"


@pytest.mark.parametrize(("env", "want"), [
    ({"HF_HUB_CACHE": "{t}/c", "HF_HOME": "{t}/h", "XDG_CACHE_HOME": "{t}/x"}, "{t}/c"),
    ({"HF_HOME": "{t}/h", "XDG_CACHE_HOME": "{t}/x"}, "{t}/h/hub"),
    ({"XDG_CACHE_HOME": "{t}/x"}, "{t}/x/huggingface/hub"),
    ({}, "{t}/home/.cache/huggingface/hub"),
])
def test_the_hf_cache_is_the_one_huggingface_hub_computes(tmp_path: Path, env: dict[str, str], want: str) -> None:
    """One place (builder.lock.hf.hub_cache) and huggingface_hub's own answer, whatever says where it is."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_", "HUGGINGFACE_"))}
    base.update({k: v.format(t=tmp_path) for k, v in env.items()}, HOME=str(tmp_path / "home"))
    code = ("import huggingface_hub.constants as c\nfrom builder.lock import hf\n"
            "print(hf.hub_cache()); print(c.HF_HUB_CACHE); print(hf.hub_cache_dirs()[0])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [want.format(t=tmp_path)] * 3


def test_vanished_files_are_named(tmp_path: Path) -> None:
    commit = "12" * 20
    repo_dir = make_hf_cache(tmp_path / "hub", "org/model", commit, FILES)
    spec = HfModel(repo="org/model", revision="main", local=str(repo_dir))
    first = resolve(spec, tmp_path)
    # a blob deleted under its snapshot link (a dangling symlink)
    (repo_dir / "blobs" / sha(FILES["model-00002-of-00003.safetensors"])).unlink()
    with pytest.raises(ResolveError, match=r"models\.m: file vanished: model-00002-of-00003\.safetensors"):
        resolve(spec, tmp_path)
    # a file removed from a plain folder, noticed against the previous lock of the same commit
    write_files(tmp_path / "snap", FILES)
    plain = HfModel(repo="org/model", revision=commit, local="snap")
    before = resolve(plain, tmp_path)
    (tmp_path / "snap" / "tokenizer.json").unlink()
    with pytest.raises(ResolveError, match=r"models\.m: file vanished: tokenizer\.json"):
        resolve(plain, tmp_path, previous=before)
    assert first.commit == commit


def test_hashes_many_files_in_parallel(tmp_path: Path) -> None:
    files = {f"shard-{i:03d}.bin": bytes([i % 256]) * (i * 100) for i in range(40)}
    write_files(tmp_path / "snap", files)
    got = hf.hash_files(tmp_path / "snap", sorted(files), where="models.m", workers=4)
    assert got == [(p, sha(files[p]), len(files[p])) for p in sorted(files)]
