"""`builder diff`: two locks, or a lock against a git revision of itself, as a table and as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.errors import ConfigError
from builder.lock.diff import Change, _base, diff_locks, read_lock
from builder.lock.lockfile import LockedBase, load_lock
from tests.lib import factory
from tests.lib.gitlib import run_git
from tests.lib.lockproject import Project


@pytest.fixture
def moved(tmp_path: Path) -> tuple[Project, Path, str, str]:
    """A project locked twice: the engine moved one commit and its patch changed; a model file changed."""
    proj = Project(tmp_path)
    assert proj.run("lock").rc == 0
    old = tmp_path / "old.lock"
    old.write_bytes(proj.lock.read_bytes())
    c2 = proj.up.commit({"src/new.zig": "const x = 1;\n"})
    proj.up.push()
    (proj.root / "patches" / "0001-fix.patch").write_text("--- a/README\n+++ b/README\n@@ v2\n")
    (proj.root / "models" / "tiny" / "config.json").write_text('{"hidden": 16}\n')
    r = proj.run("lock", "--update", "engine", "--update", "tiny")
    assert r.rc == 0, r.err
    return proj, old, proj.c1, c2


def test_diff_shows_commit_patch_and_model_changes(moved: tuple[Project, Path, str, str]) -> None:
    proj, old, c1, c2 = moved
    changes = diff_locks(load_lock(old), load_lock(proj.lock))
    whats = [(c.input, c.what) for c in changes]
    assert ("sources.engine", f"commit {c1[:12]} -> {c2[:12]}") in whats
    patch = [w for i, w in whats if w.startswith("patch changed patches/0001-fix.patch (sha256 ")]
    assert len(patch) == 1
    assert ("models.tiny", "model files changed: 1 changed") in whats
    assert (
        "images.demo",
        f"source date {json.loads(old.read_text())['images']['demo']['source_date_epoch']} -> "
        f"{json.loads(proj.lock.read_text())['images']['demo']['source_date_epoch']}",
    ) in whats
    assert all(i != "files.template" for i, _ in whats)


def test_diff_cli_table_and_json(moved: tuple[Project, Path, str, str]) -> None:
    proj, old, c1, c2 = moved
    r = proj.run("diff", str(old))
    assert r.rc == 0, r.err
    assert f"commit {c1[:12]} -> {c2[:12]}" in r.out
    assert "patch changed patches/0001-fix.patch" in r.out
    assert r.err == ""  # the table is the data (stdout); --json gives it as JSON instead
    r = proj.run("diff", str(old), str(proj.lock), "--json")
    data = json.loads(r.out)
    assert {"input": "sources.engine", "kind": "source", "what": f"commit {c1[:12]} -> {c2[:12]}"} in data[
        "changes"
    ]
    assert proj.run("diff", str(old), "--exit-code").rc == 1
    same = proj.run("diff", str(proj.lock), str(proj.lock), "--exit-code")
    assert same.rc == 0 and "no changes" in same.err


def test_added_removed_and_patch_series(tmp_path: Path) -> None:
    proj = Project(tmp_path)
    assert proj.run("lock").rc == 0
    old = load_lock(proj.lock)
    (proj.root / "patches" / "0002-more.patch").write_text("x\n")
    doc = proj.doc()
    doc["sources"]["engine"]["patches"].append({"file": "patches/0002-more.patch", "reason": "more"})
    doc["files"] = {"other": {"url": "files/chat.jinja",
                              "sha256": json.loads(proj.lock.read_text())["files"]["template"]["sha256"]},
                    **doc["files"]}
    factory.write_pins(proj.root, doc)
    assert proj.run("lock").rc == 0
    new = load_lock(proj.lock)
    whats = {(c.input, c.what) for c in diff_locks(old, new)}
    assert ("sources.engine", "patch added patches/0002-more.patch") in whats
    assert ("files.other", "added") in whats
    back = {(c.input, c.what) for c in diff_locks(new, old)}
    assert ("sources.engine", "patch removed patches/0002-more.patch") in back
    assert ("files.other", "removed") in back
    assert diff_locks(old, old) == []


def test_digest_changes_are_named_by_platform() -> None:
    a = LockedBase(
        spec_hash="0" * 64,
        ref="r:1",
        index_digest="sha256:" + "1" * 64,
        platforms={"linux/arm64": "sha256:" + "2" * 64, "linux/amd64": "sha256:" + "3" * 64},
        source="registry",
        config_env={"linux/arm64": ["A=1"]},
    )
    b = a.model_copy(
        update={
            "index_digest": "sha256:" + "4" * 64,
            "platforms": {"linux/arm64": "sha256:" + "5" * 64, "linux/amd64": "sha256:" + "3" * 64},
            "config_env": {"linux/arm64": ["A=1", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1"]},
        }
    )
    assert _base(a, b) == [
        "index digest changed sha256:111111111111 -> sha256:444444444444",
        "digest changed linux/arm64 sha256:222222222222 -> sha256:555555555555",
        "config env changed linux/arm64: TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    ]


def test_diff_against_a_git_revision_of_the_lock(moved: tuple[Project, Path, str, str]) -> None:
    proj, old, c1, c2 = moved
    repo = proj.root
    run_git("init", "-q", "-b", "main", cwd=repo)
    new_bytes = proj.lock.read_bytes()
    proj.lock.write_bytes(old.read_bytes())
    run_git("add", "pins.lock", cwd=repo)
    run_git("commit", "-q", "-m", "old lock", cwd=repo)
    proj.lock.write_bytes(new_bytes)
    lock, label = read_lock("HEAD:pins.lock", cwd=repo)
    assert label == "HEAD:pins.lock" and lock.sources["engine"].commit == c1
    r = proj.run("diff")  # OLD defaults to HEAD:<the lock>, NEW to the lock
    assert r.rc == 0, r.err
    assert f"commit {c1[:12]} -> {c2[:12]}" in r.out
    r = proj.run("diff", "HEAD:pins.lock", str(proj.lock), "--json")
    assert any(ch["what"] == f"commit {c1[:12]} -> {c2[:12]}" for ch in json.loads(r.out)["changes"])
    with pytest.raises(ConfigError, match=r"HEAD~5:pins\.lock: not readable from git"):
        read_lock("HEAD~5:pins.lock", cwd=repo)


def test_bad_inputs_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.lock"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad\.lock: malformed JSON"):
        read_lock(str(bad))
    with pytest.raises(ConfigError, match=r"nope\.lock: no such lock file"):
        read_lock(str(tmp_path / "nope.lock"))
    assert Change("a", "b", "c").as_dict() == {"input": "a", "kind": "b", "what": "c"}
