"""Image plans: the closure and its input address, through the real CLI on a copy of the shipped project.

One changed input (a patch byte, a build arg, a recipe file, the source commit, the toolchain sha,
the lock's timestamp) changes the address; an unrelated change (another input's lock entry, a new
pin elsewhere) does not; the address does not depend on the folder the project sits in. `--plan`
and `why` need no Docker engine. Bad input (missing, stale or hand-edited lock; a ZIG_TARGET for
another CPU than the image platform) is one line and exit 2.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from builder.foundation.canon import address, canonical_json
from builder.lock.lockfile import load_lock
from tests.lib import factory
from tests.lib.shipped import (
    NO_DOCKER,
    PATCH_REL,
    builder,
    copy_project,
    edit_lock,
    plan_of,
    relock,
)


@pytest.fixture
def proj(tmp_path: Path) -> Path:
    return copy_project(tmp_path / "proj")


# --------------------------------------------------------------------------- the plan


def test_plan_and_why_print_closure_and_address_without_docker(proj: Path) -> None:
    plain = builder(proj, "image", "demo", "--plan", env=NO_DOCKER)
    assert plain.rc == 0, plain.err
    name, addr = plain.out.splitlines()[0].split()
    assert name == "demo" and re.fullmatch(r"[0-9a-f]{64}", addr)
    assert '"sources"' in plain.out and '"sources"' not in plain.err  # the closure is data: stdout

    as_json = builder(proj, "image", "demo", "--plan", "--json", env=NO_DOCKER)
    why = builder(proj, "why", "demo", "--json", env=NO_DOCKER)
    assert as_json.rc == why.rc == 0
    d = as_json.json()
    assert d == why.json()
    assert d["input_address"] == addr == address(d["closure"])
    lock = load_lock(proj / "pins.lock")
    c = d["closure"]
    src = lock.sources["demo-engine"]
    assert c["sources"]["demo-engine"]["commit"] == src.commit
    assert c["sources"]["demo-engine"]["tree_sha256"] == src.tree_sha256
    assert [p["sha256"] for p in c["sources"]["demo-engine"]["patches"]] == [p.sha256 for p in src.patches]
    wheel = lock.toolchains["zig-wheel"].platforms["linux/amd64"].sha256
    assert c["toolchains"]["zig-wheel"]["artifacts"]["linux/amd64"] == wheel
    assert c["files"]["demo-chat-template"] == lock.files["demo-chat-template"].sha256
    assert c["platform"] == "linux/amd64" and c["base"] is None
    assert c["build_args"]["ZIG_TARGET"] == "x86_64-linux-musl"
    assert c["source_date_epoch"] == lock.images["demo"].source_date_epoch
    assert set(c["recipe"]) == {Path(p).relative_to("images/demo").as_posix() for p in lock.images["demo"].recipe_files}
    assert "Dockerfile" in c["recipe"]
    assert isinstance(c["assembly_format"], int)
    # nothing about where the project sits, and nothing was written to the store
    assert str(proj) not in canonical_json(d).decode()
    assert not (proj / ".cache" / "builder" / "images").exists()


def test_address_is_the_same_from_another_folder(tmp_path: Path) -> None:
    a = plan_of(copy_project(tmp_path / "a"))
    b = plan_of(copy_project(tmp_path / "deeper" / "elsewhere" / "b"))
    assert a == b


def _patch_byte(root: Path) -> None:
    p = root / PATCH_REL
    text = p.read_text()
    assert "Subject: [PATCH] " in text
    p.write_text(text.replace("Subject: [PATCH] ", "Subject: [PATCH]  ", 1))  # one byte, still applies
    relock(root)


def _build_arg(root: Path) -> None:
    factory.edit_pins(root, lambda d: d["images"]["demo"]["build_args"].update(ZIG_OPTIMIZE="ReleaseFast"))
    relock(root)


def _recipe_file(root: Path) -> None:
    with open(root / "images" / "demo" / "Dockerfile", "a") as f:
        f.write("# one more line\n")
    relock(root)


def _source_commit(root: Path) -> None:
    edit_lock(root, lambda d: d["sources"]["demo-engine"].update(commit="f" * 40))


def _toolchain_sha(root: Path) -> None:
    edit_lock(root, lambda d: d["toolchains"]["zig-wheel"]["platforms"]["linux/amd64"].update(sha256="0" * 64))


def _epoch(root: Path) -> None:
    edit_lock(root, lambda d: d["images"]["demo"].update(source_date_epoch=1735776001))


@pytest.mark.parametrize("change", [_patch_byte, _build_arg, _recipe_file, _source_commit, _toolchain_sha, _epoch],
                         ids=["patch-byte", "build-arg", "recipe-file", "source-commit", "toolchain-sha", "epoch"])
def test_one_changed_input_changes_the_address(proj: Path, change: Callable[[Path], None]) -> None:
    before = plan_of(proj)
    change(proj)
    after = plan_of(proj)
    assert after["input_address"] != before["input_address"]
    assert after["lock_hash"] != before["lock_hash"]  # the lock entries that went in moved too
    # exactly one part of the closure moved
    moved = [k for k in before["closure"] if before["closure"][k] != after["closure"][k]]
    assert len(moved) == 1, moved


def test_unrelated_changes_keep_the_address(proj: Path) -> None:
    before = plan_of(proj)
    # another input's lock entry moves (a model: not part of any image)
    edit_lock(proj, lambda d: d["models"]["demo-engram"].update(commit="1" * 40))
    # and a new, unrelated pin is added and locked
    (proj / "files" / "unrelated.txt").write_text("not in the demo image\n")
    h = hashlib.sha256(b"not in the demo image\n").hexdigest()
    factory.edit_pins(proj, lambda d: d["files"].update(unrelated={"url": "files/unrelated.txt", "sha256": h}))
    relock(proj, "unrelated")
    assert "unrelated" in load_lock(proj / "pins.lock").files
    after = plan_of(proj)
    assert after == before


# --------------------------------------------------------------------------- bad input: one line, exit 2


def test_missing_lock(proj: Path) -> None:
    (proj / "pins.lock").unlink()
    for args in (("image", "demo", "--plan"), ("image", "demo"), ("why", "demo")):
        r = builder(proj, *args, env=NO_DOCKER)
        assert r.rc == 2, r.err
        assert len(r.err_lines) == 1 and "pins.lock" in r.err and "builder lock" in r.err
        assert "Traceback" not in r.err


def test_stale_lock_recipe_changed(proj: Path) -> None:
    with open(proj / "images" / "demo" / "Dockerfile", "a") as f:
        f.write("LABEL x=y\n")
    r = builder(proj, "image", "demo", env=NO_DOCKER)
    assert r.rc == 2
    assert len(r.err_lines) == 1 and "images/demo/Dockerfile changed since the lock" in r.err
    assert not (proj / ".cache").exists()  # refused before anything was written


def test_stale_lock_patch_edited_after_locking(proj: Path) -> None:
    p = proj / PATCH_REL
    p.write_text(p.read_text().replace("+patched", "+patched2"))
    r = builder(proj, "image", "demo", env=NO_DOCKER)
    assert r.rc == 2
    assert len(r.err_lines) == 1 and f"{PATCH_REL} changed since the lock" in r.err


def test_lock_edited_by_hand(proj: Path) -> None:
    p = proj / "pins.lock"
    p.write_text(p.read_text().replace('"source_date_epoch": 1735776000', '"source_date_epoch": 1735776001'))
    r = builder(proj, "why", "demo", env=NO_DOCKER)
    assert r.rc == 2 and len(r.err_lines) == 1 and "edited by hand" in r.err


def test_unknown_image(proj: Path) -> None:
    r = builder(proj, "image", "nope", "--plan", env=NO_DOCKER)
    assert r.rc == 2 and len(r.err_lines) == 1 and "'nope'" in r.err and "demo" in r.err


def test_zig_target_must_match_the_platform(proj: Path) -> None:
    factory.edit_pins(proj, lambda d: d["images"]["demo"].update(platform="linux/arm64"))
    relock(proj)  # the lock itself is fine: the recipe's build args disagree with its platform
    r = builder(proj, "image", "demo", "--plan", env=NO_DOCKER)
    assert r.rc == 2 and len(r.err_lines) == 1
    assert "images.demo.build_args.ZIG_TARGET: x86_64-linux-musl builds for amd64" in r.err
    assert "linux/arm64" in r.err
