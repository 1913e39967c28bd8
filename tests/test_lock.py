"""`builder lock` end to end through the real CLI: a tmp project, real git, real files.

Covers determinism, stale detection (`--check`), `--update`, closures, offline reporting,
and every bad input: malformed TOML, unknown keys, a missing patch file, an unreachable
remote, a revision not on its ref, a model file that vanished, a lock edited by hand. That lock
keeps just what --check calls current is shown through the functions behind the two commands.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from builder.inputs.pins import INPUT_KINDS
from builder.lock import unknown
from builder.lock.lockfile import check_lock
from builder.lock.resolve import ResolveOptions, resolve
from tests.lib import clirun, factory
from tests.lib.gitlib import run_git
from tests.lib.lockproject import TINY_COMMIT, ZIG_SHA, Project, Result, sha


def one_line_error(r: Result, code: int, *needles: str) -> str:
    assert r.rc == code, (r.rc, r.err)
    assert "Traceback" not in r.err
    errors = [ln for ln in r.err_lines if ln.startswith("error:")]
    assert len(errors) == 1, r.err
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


@pytest.fixture
def proj(tmp_path: Path) -> Project:
    return Project(tmp_path)


@pytest.fixture
def locked(proj: Project) -> Project:
    r = proj.run("lock")
    assert r.rc == 0, r.err
    return proj


# ---------------------------------------------------------------------------------------
# the happy path


def test_lock_records_every_input(locked: Project) -> None:
    data = json.loads(locked.lock.read_text())
    src = data["sources"]["engine"]
    assert src["commit"] == locked.c1 and src["ref_head"] == locked.c1 and src["on_ref"] is True
    assert len(src["tree_sha256"]) == 64
    assert src["patches"] == [
        {
            "file": "patches/0001-fix.patch",
            "reason": "fix the readme",
            "sha256": sha((locked.root / "patches/0001-fix.patch").read_bytes()),
        }
    ]
    model = data["models"]["tiny"]
    assert model["commit"] == TINY_COMMIT and model["source"] == "local"
    assert [f["path"] for f in model["files"]] == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert model["files"][1]["sha256"] == sha(b"\x01" * 1000) and model["total_size"] == 2014
    assert data["files"]["template"] == {
        "spec_hash": data["files"]["template"]["spec_hash"],
        "url": "files/chat.jinja",
        "sha256": sha(locked.template),
        "size": len(locked.template),
        "verified": True,
    }
    assert data["toolchains"]["zig"]["platforms"]["linux/arm64"]["sha256"] == ZIG_SHA
    assert data["images"]["demo"]["source_date_epoch"] == src["commit_time"]
    assert set(data["inputs"]) == {"pins.toml", "patches/0001-fix.patch", "images/demo/Dockerfile"}
    assert locked.run("lock", "--check").rc == 0


def test_lock_is_deterministic(locked: Project) -> None:
    first = locked.lock.read_bytes()
    r = locked.run("lock")
    assert r.rc == 0 and "(unchanged)" in r.err
    locked.lock.unlink()
    shutil.rmtree(locked.root / ".cache")
    assert locked.run("lock").rc == 0
    assert locked.lock.read_bytes() == first
    # another checkout of the same project locks to the same bytes
    copy = locked.tmp / "copy"
    shutil.copytree(locked.root, copy, ignore=shutil.ignore_patterns(".cache", "pins.lock"))
    p = clirun.run("lock", cwd=copy, pins=copy / "pins.toml")
    assert p.returncode == 0, p.stderr
    assert (copy / "pins.lock").read_bytes() == first


def test_closure_selection_locks_only_what_the_lane_needs(proj: Project) -> None:
    proj.write_pins(files={"other": {"url": "files/chat.jinja", "sha256": "b" * 64}})
    r = proj.run("lock", "demo")
    assert r.rc == 0, r.err
    data = json.loads(proj.lock.read_text())
    assert "other" not in data["files"] and "template" in data["files"]
    assert proj.run("lock", "--check", "demo").rc == 0
    full = proj.run("lock", "--check")
    assert full.rc == 1 and "files.other: not in the lock" in full.err


# ---------------------------------------------------------------------------------------
# staleness


def test_check_names_an_edited_patch(locked: Project) -> None:
    (locked.root / "patches" / "0001-fix.patch").write_text("--- a/README\n+++ b/README\n@@ changed\n")
    r = locked.run("lock", "--check")
    assert r.rc == 1 and "Traceback" not in r.err
    assert "sources.engine.patches[0]: patches/0001-fix.patch changed since the lock" in r.err


def test_check_names_an_edited_pin(locked: Project) -> None:
    locked.write_pins(patch_reason="a better reason")
    r = locked.run("lock", "--check")
    assert r.rc == 1
    assert "sources.engine: pins changed since the lock was written" in r.err
    assert "models.tiny" not in r.err
    # relocking makes it current again
    assert locked.run("lock").rc == 0
    assert locked.run("lock", "--check").rc == 0


def test_check_names_a_changed_recipe_and_a_missing_lock(proj: Project) -> None:
    r = proj.run("lock", "--check")
    one_line_error(r, 2, "pins.lock", "no lock file")
    assert proj.run("lock").rc == 0
    (proj.root / "images" / "demo" / "Dockerfile").write_text("FROM scratch\nCOPY . /\n")
    r = proj.run("lock", "--check")
    assert r.rc == 1 and "images.demo: recipe file images/demo/Dockerfile changed since the lock" in r.err


def test_check_json(locked: Project) -> None:
    r = locked.run("lock", "--check", "--json")
    assert r.rc == 0 and json.loads(r.out) == {"ok": True, "problems": [], "unknown": []}


def test_check_names_each_unknown_input_what_it_lacks_and_what_to_do(proj: Project) -> None:
    """An input whose pin gives no hash (sha256 UNKNOWN) cannot be locked from here: --check names it apart
    from the merely missing, says what UNKNOWN means and what resolves it, and exits 1 as for any gap."""
    proj.write_pins(files={"unpublished": {"url": "https://example.invalid/f.py", "sha256": "UNKNOWN"},
                           "other": {"url": "files/chat.jinja", "sha256": "b" * 64}})
    assert proj.run("lock", "demo").rc == 0
    r = proj.run("lock", "--check")
    assert r.rc == 1 and "Traceback" not in r.err
    assert "files.unpublished: its sha256: from https://example.invalid/f.py" in r.err
    assert "their hashes are UNKNOWN: their pins give none" in r.err
    assert "stale: files.other: not in the lock" in r.err and "stale: files.unpublished" not in r.err
    last = r.err_lines[-1]
    assert last.startswith("error:") and "1 input(s) UNKNOWN" in last and "`builder lock NAME`" in last, last
    assert "`builder lock --check demo`" in last
    data = json.loads(proj.run("lock", "--check", "--json").out)
    assert data["ok"] is False and "files.unpublished: not in the lock" in data["problems"]
    assert data["unknown"] == [{"input": "files.unpublished", "what": "its sha256: from https://example.invalid/f.py"}]
    assert proj.run("lock", "--check", "demo").rc == 0


KIT_FILES = {"kit/rope.json": '{"theta": 10000}\n', "kit/aot.json": '{"kernels": []}\n'}


def kit_manifest(files: dict[str, str]) -> str:
    """A kit MANIFEST (sha256, bytes, origin, two-node, path) listing files of the kit/ folder."""
    return "".join(f"{sha(t.encode())} {len(t.encode())} git - {rel.removeprefix('kit/')}\n"
                   for rel, t in sorted(files.items()))


def verdicts(proj: Project) -> tuple[set[str], set[str], set[str]]:
    """What `lock --check` calls stale, then what `lock` resolves and keeps, by input; and,
    once lock has run, --check finds nothing stale. (The functions behind the two commands, in this process:
    the CLI's start, paid a dozen times, would be most of the test's time.)"""
    # an input's problems name it first (kind.name, or kind.name.patches[i]); the rest name files or sections
    stale = {".".join(p.split(":", 1)[0].split(".")[:2]) for p in check_lock(proj.pins, proj.lock).problems
             if p.split(".", 1)[0] in INPUT_KINDS}
    rep = resolve(proj.pins, proj.lock, ResolveOptions())
    assert not rep.failed, rep.failed
    after = check_lock(proj.pins, proj.lock)
    assert after.ok, after.problems  # nothing lock kept (or wrote) is stale by --check's rule
    return stale, set(rep.resolved), set(rep.kept)


def test_lock_keeps_exactly_what_check_calls_current(proj: Project) -> None:
    """`builder lock` re-resolves what `lock --check` calls stale and keeps the rest, for each way an
    entry goes stale: a patch edited, a kit's commit left behind by its source's, a source's URL changed."""
    proj.up.commit({**KIT_FILES, "kit/MANIFEST": kit_manifest(KIT_FILES)})
    proj.up.push()
    kit = {"engine-kit": {"source": "engine", "path": "kit"}}
    proj.write_pins(kits=kit)
    assert not resolve(proj.pins, proj.lock, ResolveOptions()).failed
    every = {"sources.engine", "toolchains.zig", "files.template", "models.tiny", "kits.engine-kit"}

    # nothing changed: nothing stale, everything kept
    assert verdicts(proj) == (set(), set(), every)

    # a patch edited: its source is stale and resolved again; the kit, at the same commit, is kept
    (proj.root / "patches" / "0001-fix.patch").write_text("--- a/README\n+++ b/README\n@@ edited\n")
    stale, resolved, kept = verdicts(proj)
    assert stale == resolved == {"sources.engine"} and kept == every - resolved

    # the source moved on alone (the kit not selected): the kit, read at the old commit, is stale
    moved = {"kit/rope.json": '{"theta": 500000}\n', "kit/aot.json": KIT_FILES["kit/aot.json"]}
    c3 = proj.up.commit({**moved, "kit/MANIFEST": kit_manifest(moved)})
    proj.up.push()
    assert not resolve(proj.pins, proj.lock, ResolveOptions(names=["engine"], update={"engine"})).failed
    data = json.loads(proj.lock.read_text())
    assert data["sources"]["engine"]["commit"] == c3 != data["kits"]["engine-kit"]["commit"]
    stale, resolved, kept = verdicts(proj)
    assert stale == resolved == {"kits.engine-kit"} and kept == every - resolved
    assert json.loads(proj.lock.read_text())["kits"]["engine-kit"]["commit"] == c3

    # the source's URL changed, to a mirror at the same commit: the source is resolved again from it,
    # and the kit, whose commit did not move, is kept
    mirror = proj.tmp / "mirror.git"
    run_git("clone", "-q", "--bare", str(proj.up.bare), str(mirror), cwd=proj.tmp)
    doc = proj.doc(kits=kit)
    doc["sources"]["engine"]["url"] = f"file://{mirror}"
    factory.write_pins(proj.root, doc)
    stale, resolved, kept = verdicts(proj)
    assert stale == resolved == {"sources.engine"} and kept == every - resolved
    assert json.loads(proj.lock.read_text())["sources"]["engine"]["url"] == f"file://{mirror}"

    # the URL changed again, to a repository a commit further on: --check (no network) can only name the
    # source; lock moves the source, and then the kit with it, and keeps nothing --check called stale
    c4 = proj.up.commit({"README": "engine, mirrored\n"})
    run_git("push", "-q", str(mirror), "HEAD:refs/heads/main", cwd=proj.up.work)
    doc["sources"]["engine"]["url"] = str(mirror)
    factory.write_pins(proj.root, doc)
    stale, resolved, kept = verdicts(proj)
    assert stale == {"sources.engine"} and resolved == {"sources.engine", "kits.engine-kit"}
    assert kept == every - resolved
    assert json.loads(proj.lock.read_text())["kits"]["engine-kit"]["commit"] == c4


# ---------------------------------------------------------------------------------------
# bad input: one line, exit 2 (config) or 1 (resolution), the lock's bytes untouched


def test_malformed_toml(locked: Project) -> None:
    before = locked.lock.read_bytes()
    locked.pins.write_text(locked.pins.read_text() + "\n[sources.engine\n")
    for args in (("lock",), ("lock", "--check")):
        one_line_error(locked.run(*args), 2, "pins.toml", "malformed TOML")
    assert locked.lock.read_bytes() == before


def test_unknown_key(locked: Project) -> None:
    before = locked.lock.read_bytes()
    locked.pins.write_text(locked.pins.read_text().replace('ref = "main"', 'ref = "main"\nbranch = "x"'))
    one_line_error(locked.run("lock"), 2, "pins.toml", "sources.engine.branch", "unknown key")
    assert locked.lock.read_bytes() == before


def test_missing_patch_file(locked: Project) -> None:
    before = locked.lock.read_bytes()
    (locked.root / "patches" / "0001-fix.patch").unlink()
    one_line_error(
        locked.run("lock"), 2, "pins.toml", "sources.engine.patches[0].file", "patches/0001-fix.patch"
    )
    assert locked.lock.read_bytes() == before


def test_unreachable_remote(locked: Project) -> None:
    before = locked.lock.read_bytes()
    locked.up.bare.rename(locked.tmp / "gone.git")
    line = one_line_error(
        locked.run("lock", "--update", "engine"), 1, "sources.engine", "cannot fetch", locked.up.url
    )
    assert len(line) < 300
    assert locked.lock.read_bytes() == before


def test_pinned_rev_no_longer_on_ref(tmp_path: Path) -> None:
    proj = Project(tmp_path, rev=True)
    assert proj.run("lock").rc == 0
    before = proj.lock.read_bytes()
    new_head = proj.up.rewrite({"README": "rewritten history\n"})
    one_line_error(
        proj.run("lock", "--update", "engine"),
        1,
        f"sources.engine: pinned commit {proj.c1[:12]} is no longer on ref main (ref now at {new_head[:12]})",
        "refusing to move it",
    )
    assert proj.lock.read_bytes() == before


def test_unpinned_rewrite_moves_only_with_update(locked: Project) -> None:
    new_head = locked.up.rewrite({"README": "rewritten\n"})
    # the pin changed (a new reason), so the source is re-resolved, and the rewrite is refused
    locked.write_pins(patch_reason="reason two")
    r = locked.run("lock")
    one_line_error(
        r, 1, f"sources.engine: locked commit {locked.c1[:12]} is no longer on ref main", "--update engine"
    )
    data = json.loads(locked.lock.read_text())
    assert data["sources"]["engine"]["commit"] == locked.c1  # never moved silently; kept, and stale
    assert locked.run("lock", "--check").rc == 1
    r = locked.run("lock", "--update", "engine")
    assert r.rc == 0, r.err
    assert f"sources.engine: {locked.c1} -> {new_head}" in r.err
    assert json.loads(locked.lock.read_text())["sources"]["engine"]["commit"] == new_head
    assert locked.run("lock", "--check").rc == 0


def test_a_failed_lock_leaves_the_lock_untouched(locked: Project) -> None:
    """A lock with one input that fails writes nothing: not the inputs that did resolve, not the pins'
    hash (``inputs_hash``), so `--check` keeps saying the lock does not match the pins."""
    before = locked.lock.read_bytes()
    # the plain file changes (it resolves again, alone), while the engine's ref names no branch upstream
    template = b"{{ messages | tojson }}\n"
    (locked.root / "files" / "chat.jinja").write_bytes(template)
    doc = locked.doc(files={"template": {"url": "files/chat.jinja", "sha256": sha(template)}})
    doc["sources"]["engine"]["ref"] = "no-such-branch"
    factory.write_pins(locked.root, doc)
    pins = locked.pins.read_bytes()
    r = locked.run("lock")
    one_line_error(r, 1, "sources.engine", "no-such-branch")
    assert "(unchanged)" in r.err and "files.template:" not in r.err  # nothing said to have moved
    assert locked.lock.read_bytes() == before and locked.pins.read_bytes() == pins
    check = locked.run("lock", "--check")
    assert check.rc == 1 and "pins changed" in check.err, check.err
    # the ref put right: the same command writes every input, the template's new hash with them
    doc["sources"]["engine"]["ref"] = "main"
    factory.write_pins(locked.root, doc)
    assert locked.run("lock").rc == 0
    assert json.loads(locked.lock.read_text())["files"]["template"]["sha256"] == sha(template)
    assert locked.run("lock", "--check").rc == 0


def test_model_file_vanished(locked: Project) -> None:
    before = locked.lock.read_bytes()
    (locked.root / "models" / "tiny" / "model-00002-of-00002.safetensors").unlink()
    one_line_error(
        locked.run("lock", "--update", "tiny"),
        1,
        "models.tiny",
        "file vanished",
        "model-00002-of-00002.safetensors",
    )
    assert locked.lock.read_bytes() == before


def test_lock_edited_by_hand(locked: Project) -> None:
    text = locked.lock.read_text()
    data = json.loads(text)
    # a new key: refused by the schema, naming file and key
    data["sources"]["engine"]["comit"] = "x"
    locked.lock.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    one_line_error(locked.run("lock", "--check"), 2, "pins.lock", "sources.engine.comit", "unknown key")
    # a bad value
    locked.lock.write_text(text.replace(locked.c1, locked.c1[:12]))
    one_line_error(locked.run("lock", "--check"), 2, "pins.lock", "sources.engine.commit")
    # not JSON
    locked.lock.write_text(text[:-20])
    one_line_error(locked.run("lock", "--check"), 2, "pins.lock", "malformed JSON")
    # valid, but not what builder writes (re-indented by an editor)
    locked.lock.write_text(json.dumps(json.loads(text), indent=4, sort_keys=True) + "\n")
    r = locked.run("lock", "--check")
    assert r.rc == 1 and "edited by hand" in r.err


def test_unknown_update_name(locked: Project) -> None:
    one_line_error(locked.run("lock", "--update", "nope"), 2, "--update nope")


# ---------------------------------------------------------------------------------------
# offline


def test_offline_names_every_unreachable_input(proj: Project, monkeypatch: pytest.MonkeyPatch) -> None:
    proj.write_pins(
        sources={"remote": {"url": "https://git.example.invalid/engine.git", "ref": "main"}},
        files={"kit": {"url": "https://example.invalid/kit.tar.gz", "sha256": "c" * 64}},
        models={"big": factory.model("org/big")},
    )
    monkeypatch.setenv("HF_HUB_CACHE", str(proj.tmp / "empty-hub"))
    r = proj.run("lock", "--offline")
    assert r.rc == 1 and "Traceback" not in r.err
    errors = sorted(ln for ln in r.err_lines if ln.startswith("error:"))
    assert errors == [
        "error: files.kit: not reachable offline (https://example.invalid/kit.tar.gz)",
        "error: models.big: not in the cache and --offline was given (org/big@main)",
        "error: sources.remote: not in the cache and --offline was given (https://git.example.invalid/engine.git)",
    ]
    # a lock that fails writes nothing, not even what did resolve
    assert not proj.lock.exists()
    # the demo lane (a local git remote, local files and models) is complete offline
    assert proj.run("lock", "--offline", "demo").rc == 0
    data = json.loads(proj.lock.read_text())
    assert set(data["files"]) == {"template"} and set(data["models"]) == {"tiny"}
    assert set(data["sources"]) == {"engine"}
    assert proj.run("lock", "--check", "demo").rc == 0
    assert proj.run("lock", "--check").rc == 1


def test_shipped_lock_lacks_only_unknown_inputs() -> None:
    """On a fresh clone every input missing from the shipped lock is one whose hash its pin does not give,
    and the demo lanes are whole."""
    root = Path(__file__).resolve().parent.parent
    res = unknown.check(root / "pins.toml", root / "pins.lock")
    missing = {p.split(":", 1)[0] for p in res.problems if p.endswith(": not in the lock")}
    assert missing and missing == set(res.unknown) and len(res.problems) == len(missing), res.problems
    assert {"demo", "demo-tp3"} <= set(res.complete_lanes) and "vllm-mia-tp2" not in res.complete_lanes
    assert res.unknown["files.dsv41-1017-chat-template"] == "its sha256 and its URL: nobody has published its content"
