"""Every image recipe under images/ against the build context `builder image` lays out for it (no Docker, no network).

For each recipe and each image of pins.toml built from it: every FROM is `${BASE}` (builder passes the image's
locked base by digest, so the image must pin a base; `ARG BASE` comes before the first FROM), `scratch` or an
earlier stage; every COPY/ADD source is something the context has, as `tests.lib.contextlayout` says (the
recipe folder's files, `src/` and `src-<name>/` per source, the toolchains, `files/<name>`): a name the pins do not
provide fails here rather than on a Spark, an hour into a build. What is inside a source tree only the lock and the
store know; a path under `src/` is taken as the tree's. A recipe no image uses fails too.

`context_layout` itself is checked against a real `assemble_context` of a small project (two git sources, a Zig
tarball toolchain, a plain file), so the layout the recipe checks use is the one builds get.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from builder.image import build as core
from builder.image.plan import make_plan
from builder.inputs.pins import ImageRecipe, Pins, load_pins
from builder.lock import resolve
from builder.lock.lockfile import load_lock
from builder.store.content import Store
from tests.lib import factory, journeylib, vllmlane
from tests.lib.contextlayout import context_layout

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(p.name for p in (ROOT / "images").iterdir() if (p / "Dockerfile").is_file())
#: a shell heredoc ending a RUN line: the classic builder would read its body as instructions
HEREDOC = re.compile(r"<<-?\s*['\"]?[A-Za-z_][A-Za-z0-9_]*['\"]?\s*$")


# ------------------------------------------------------------------- a Dockerfile, as the classic builder reads it


@dataclass(frozen=True)
class Instruction:
    line: int
    cmd: str
    args: str


def instructions(text: str) -> list[Instruction]:
    """Instructions with their first line number: continuations joined, comments and blank lines dropped."""
    out: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # also inside a continuation, where the builder drops them too
        if not buf:
            start = n
        line = raw.rstrip()
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        cmd, _, args = " ".join(buf).strip().partition(" ")
        out.append(Instruction(start, cmd.upper(), args.strip()))
        buf = []
    if buf:
        out.append(Instruction(start, "<unterminated>", " ".join(buf)))
    return out


def copy_parts(args: str) -> tuple[dict[str, str], list[str], str]:
    """COPY/ADD arguments: (flags, sources, destination)."""
    flags: dict[str, str] = {}
    rest = args.strip()
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        k, _, v = flag[2:].partition("=")
        flags[k] = v
        rest = rest.strip()
    words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
    return flags, words[:-1], (words[-1] if words else "")


def source_problem(src: str, layout: dict[str, str]) -> str | None:
    """Why a COPY source is not in the context, or None when it is."""
    if "$" in src:
        return "names a variable: the context's names are fixed, write them out"
    if "://" in src:
        return "is a URL: the build has no network and nothing unpinned goes in"
    norm = os.path.normpath(src.lstrip("/")).replace(os.sep, "/")
    if norm == ".":
        return None
    if norm.startswith(".."):
        return "is outside the context"
    if any(c in norm for c in "*?["):
        if any(fnmatch.fnmatchcase(k, norm) for k in layout):
            return None
    elif norm in layout:
        return None
    for key, kind in layout.items():
        if kind == "tree" and norm.startswith(key + "/"):
            return None  # inside a source tree: its content is the locked commit's
    return "is not in the context"


def images_of(pins: Pins, recipe: str) -> dict[str, ImageRecipe]:
    return {n: img for n, img in sorted(pins.recipes().items()) if img.recipe == f"images/{recipe}"}


def recipe_problems(root: Path, pins: Pins, recipe: str) -> list[str]:
    """Every way the recipe's Dockerfile does not fit the context of an image the pins build from it."""
    where = f"images/{recipe}/Dockerfile"
    steps = instructions((root / where).read_text(encoding="utf-8"))
    images = images_of(pins, recipe)
    if not images:
        return [f"images/{recipe}: no image in pins.toml is built from this recipe"]
    problems: list[str] = []
    global_args: set[str] = set()  # the ARGs before the first FROM: the only ones a FROM can use
    for s in steps:
        if s.cmd == "FROM":
            break
        if s.cmd == "ARG":
            global_args.add(s.args.split("=", 1)[0].strip())
    stages: list[str] = []
    for s in steps:
        at = f"{where}:{s.line}"
        if s.cmd == "<unterminated>":
            problems.append(f"{at}: the last instruction ends in a line continuation")
        elif s.cmd == "FROM":
            words = s.args.split()
            if any(w.startswith("--") for w in words):
                problems.append(f"{at}: FROM {s.args}: no flags (builder builds for the image's platform)")
                continue
            ref = words[0] if words else ""
            earlier = list(stages)
            if len(words) == 3 and words[1].lower() == "as":
                stages.append(words[2].lower())
            if ref in ("${BASE}", "$BASE"):
                if "BASE" not in global_args:
                    problems.append(f"{at}: FROM {ref} without an `ARG BASE` before the first FROM")
                for name, img in images.items():
                    if not img.base:
                        problems.append(f"{at}: FROM {ref}, but images.{name} pins no base (BASE would be empty)")
            elif ref != "scratch" and ref.lower() not in earlier:
                problems.append(f"{at}: FROM {ref}: want ${{BASE}} (the locked base, by digest) or scratch")
        elif s.cmd in ("COPY", "ADD"):
            if "<<" in s.args:
                problems.append(f"{at}: {s.cmd} with a heredoc: the classic builder has none")
                continue
            flags, sources, _ = copy_parts(s.args)
            if "from" in flags:
                if flags["from"].lower() not in stages:
                    problems.append(f"{at}: {s.cmd} --from={flags['from']}: no earlier stage of that name")
                continue
            if not sources:
                problems.append(f"{at}: {s.cmd} {s.args}: no source")
            for name in images:
                layout = context_layout(pins, name, root)
                for src in sources:
                    why = source_problem(src, layout)
                    if why:
                        problems.append(f"{at}: {s.cmd} {src} {why} of images.{name}")
        elif s.cmd == "RUN" and HEREDOC.search(s.args):
            problems.append(f"{at}: RUN with a heredoc: the classic builder has none (put the script in the recipe)")
    return problems


# --------------------------------------------------------------------------- the shipped recipes


def test_the_recipes_are_found() -> None:
    assert {"demo", "tensorfold", "tensorfold-python", "vllm"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_fits_the_context_of_its_images(recipe: str, tmp_path: Path) -> None:
    pins = load_pins(ROOT / "pins.toml")
    if recipe == vllmlane.IMAGE:  # (its lane lives in the serving tier's copy of the pins: vllmlane says why)
        root = journeylib.project_copy(tmp_path / "project")
        vllmlane.add_lane(root, tmp_path / "bookworm-python.tar", "0" * 64)
        pins = load_pins(root / "pins.toml")
    problems = recipe_problems(ROOT, pins, recipe)
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- the checks themselves


def test_parser_joins_continuations_and_reads_copy_forms() -> None:
    steps = instructions('ARG BASE\n# c\nFROM ${BASE} AS b\nRUN a \\\n  # dropped\n  b\n'
                         'COPY --chown=0:0 ["x y", "z/"]\nCOPY a b /d/\n')
    assert [(s.line, s.cmd) for s in steps] == [(1, "ARG"), (3, "FROM"), (4, "RUN"), (7, "COPY"), (8, "COPY")]
    assert steps[2].args.split() == ["a", "b"]
    assert copy_parts(steps[3].args) == ({"chown": "0:0"}, ["x y"], "z/")
    assert copy_parts(steps[4].args) == ({}, ["a", "b"], "/d/")


def test_a_name_the_pins_do_not_provide_is_named() -> None:
    layout = {"Dockerfile": "file", "src": "tree", "files": "dir", "files/a": "file", "zig": "dir"}
    assert source_problem("src/vllm/", layout) is None
    assert source_problem("./files/a", layout) is None
    assert source_problem("files/*", layout) is None
    assert source_problem(".", layout) is None
    assert source_problem("src-flashinfer/", layout) == "is not in the context"
    assert source_problem("toolchains/", layout) == "is not in the context"
    assert source_problem("${TF_SRC}", layout) == "names a variable: the context's names are fixed, write them out"
    assert source_problem("https://example.invalid/x", layout) is not None
    assert source_problem("../x", layout) == "is outside the context"


def test_problems_are_reported_per_image_and_line(tmp_path: Path) -> None:
    (tmp_path / "images" / "r").mkdir(parents=True)
    (tmp_path / "images" / "r" / "Dockerfile").write_text(
        "FROM ${BASE}\nCOPY files/ /f/\nFROM ubuntu:24.04\nRUN python - <<'EOF'\n")
    (tmp_path / "images" / "unused").mkdir()
    (tmp_path / "images" / "unused" / "Dockerfile").write_text("FROM scratch\n")
    factory.write_pins(tmp_path, factory.pins(images={"x": factory.image("images/r", platform="linux/amd64")}))
    pins = load_pins(tmp_path / "pins.toml")
    assert recipe_problems(tmp_path, pins, "r") == [
        "images/r/Dockerfile:1: FROM ${BASE} without an `ARG BASE` before the first FROM",
        "images/r/Dockerfile:1: FROM ${BASE}, but images.x pins no base (BASE would be empty)",
        "images/r/Dockerfile:2: COPY files/ is not in the context of images.x",
        "images/r/Dockerfile:3: FROM ubuntu:24.04: want ${BASE} (the locked base, by digest) or scratch",
        "images/r/Dockerfile:4: RUN with a heredoc: the classic builder has none (put the script in the recipe)",
    ]
    assert recipe_problems(tmp_path, pins, "unused") == [
        "images/unused: no image in pins.toml is built from this recipe"]


# --------------------------------------------------------------------------- the layout is the assembly's


def _git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.invalid", "GIT_AUTHOR_DATE": "@1700000000 +0000",
           "GIT_COMMITTER_DATE": "@1700000000 +0000", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, check=True, text=True).stdout.strip()


def _repo(base: Path, name: str, files: dict[str, str]) -> str:
    work = base / name
    work.mkdir(parents=True)
    _git("init", "-q", "-b", "main", cwd=work)
    for rel, text in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    _git("add", "-A", cwd=work)
    _git("commit", "-q", "-m", "c", cwd=work)
    return f"file://{work}"


def test_context_layout_is_what_assembly_lays_out(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    (root / "images" / "two" / "sub").mkdir(parents=True)
    (root / "images" / "two" / "Dockerfile").write_text(
        "FROM scratch\nCOPY src/ /a/\nCOPY src-dep/ /b/\nCOPY toolchains/ /t/\nCOPY files/ /f/\nCOPY sub/ /s/\n")
    (root / "images" / "two" / "sub" / "helper.txt").write_text("h\n")
    (root / "dl").mkdir()
    tarball = b"not really a tarball\n"
    (root / "dl" / "zig-x-0.17.0.tar.xz").write_bytes(tarball)
    (root / "dl" / "data.txt").write_text("d\n")
    engine = _repo(tmp_path / "repos", "engine", {"main.zig": "pub fn main() void {}\n"})
    dep = _repo(tmp_path / "repos", "dep", {"include/dep.h": "#pragma once\n"})
    tarball_sha, data_sha = hashlib.sha256(tarball).hexdigest(), hashlib.sha256(b"d\n").hexdigest()
    factory.write_pins(root, factory.pins(
        sources={"engine": {"url": str(engine), "ref": "main"}, "dep": {"url": str(dep), "ref": "main"}},
        toolchains={"zig": {"kind": "zig", "version": "0.17.0", "platforms": {
                        "linux/amd64": {"url": "dl/zig-x-0.17.0.tar.xz", "sha256": tarball_sha}}},
                    "cuda": {"kind": "cuda"}},
        files={"data": {"url": "dl/data.txt", "sha256": data_sha}},
        images={"two": factory.image("images/two", sources=["engine", "dep"], toolchains=["zig", "cuda"],
                                     files=["data"], platform="linux/amd64")},
    ))
    report = resolve.resolve(root / "pins.toml", root / "pins.lock", resolve.ResolveOptions(offline=True))
    assert not report.failed, report.failed
    pins, lock = load_pins(root / "pins.toml"), load_lock(root / "pins.lock")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    core.assemble_context(pins, lock, make_plan(pins, lock, "two", root), root, Store(tmp_path / "store"), ctx,
                          offline=True, build_platform="linux/amd64", on_log=lambda s: None)
    layout = context_layout(pins, "two", root)
    assert layout == {
        "Dockerfile": "file", "sub": "dir", "sub/helper.txt": "file", "src": "tree", "src-dep": "tree",
        "toolchains": "dir", "toolchains/zig": "dir", "files": "dir", "files/data": "file",
        ".builder-closure.json": "file",
    }
    # every entry is there, as the kind it is, and nothing at the top is missing from the layout
    for rel, kind in layout.items():
        p = ctx / rel
        assert (p.is_file() if kind == "file" else p.is_dir()), rel
    assert {p.name for p in ctx.iterdir()} == {k for k in layout if "/" not in k}
    assert (ctx / "src" / "main.zig").is_file() and (ctx / "src-dep" / "include" / "dep.h").is_file()
    assert (ctx / "toolchains" / "zig" / "zig-x-0.17.0.tar.xz").read_bytes() == tarball
    assert recipe_problems(root, pins, "two") == []
