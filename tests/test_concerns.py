"""The check concerns as the check modules declare them (builder/audit/concerns.py): read from the
source by `builder audit`, imported by each host's pytest; the phases' selections, the prefetch plans
and the lists the README and docs/audit.md give."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from builder.audit.concerns import Concern, declared, read_declaration
from builder.audit.selection import AuditOptions
from builder.errors import ConfigError
from tests.lib import prefetchplans
from tests.lib.checkmods import CHECKS, check_module

ROOT = Path(__file__).resolve().parent.parent
NAMES = prefetchplans.NAMES  # the concerns the check modules declare, in their order


def test_every_check_module_declares_its_concern_readably() -> None:
    """What `builder audit` reads from each module's source is what the module itself holds, and each
    declares what its checks prefetch."""
    mods = sorted(CHECKS.glob("test_*.py"))
    assert mods
    for path in mods:
        static = read_declaration(path)
        assert static is not None, f"{path.name}: no CONCERN = Concern(...) with literal keywords"
        imported = check_module(path.stem.removeprefix("test_")).CONCERN
        assert imported == static and imported.prefetch is not None and static.prefetch is None


def test_the_phases_select_what_they_did() -> None:
    have = declared(CHECKS)
    assert tuple(c.name for c in have) == NAMES

    def selected(phase: str, only: list[str] | None = None) -> list[str]:
        opts = AuditOptions(root=ROOT, pins=ROOT / "pins.toml", lock=ROOT / "pins.lock", store=ROOT, phase=phase,
                            only=only, checks_dir=CHECKS)
        return [c.name for c in opts.validate()[0]]

    assert selected("preflight") == [n for n in NAMES if n not in ("serving", "gates")]
    assert selected("serving") == ["serving", "gates"]
    assert selected("all") == list(NAMES)
    assert selected("serving", ["storage", "gpu"]) == ["gpu", "storage"]  # (--only: in the concerns' order)
    with pytest.raises(ConfigError, match=r"--only: unknown concern 'bogus' \(have: image, release, "):
        selected("preflight", ["gpu", "bogus"])
    assert {c.name for c in have if c.containers} == {"runtime", "serving", "gpu", "burn", "memory"}


def test_the_prefetch_plans_are_what_their_generator_writes(tmp_path: Path) -> None:
    """tests/data/prefetch_plans.json is, byte for byte, what `python3 -m tests.lib.prefetchplans --write`
    writes: each host variant's and selection's commands, in the order checklib.planned gives them."""
    out = tmp_path / prefetchplans.GOLDEN.name
    p = subprocess.run([sys.executable, "-m", "tests.lib.prefetchplans", "--write", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "", p.stdout + p.stderr
    if out.read_bytes() != prefetchplans.GOLDEN.read_bytes():
        have, want = json.loads(out.read_text()), json.loads(prefetchplans.GOLDEN.read_text())
        changed = sorted(c for c in have.keys() | want.keys() if have.get(c) != want.get(c)) or "its layout"
        pytest.fail(f"{prefetchplans.GOLDEN}: the generator gives other plans for {changed}; "
                    "`python3 -m tests.lib.prefetchplans --write` writes them")


def test_the_generator_covers_every_concern_and_variant() -> None:
    golden = json.loads(prefetchplans.GOLDEN.read_text())
    assert list(golden) == prefetchplans.cases()
    assert all(golden[f"{v}/all"] for v in prefetchplans.VARIANTS)


def test_the_readme_and_the_docs_list_the_declared_concerns() -> None:
    have = declared(CHECKS)
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"\| `checks/` \| the testinfra check modules by concern \(([^)]*)\)", readme)
    assert listed is not None and listed.group(1).split(", ") == [c.name for c in have]
    doc = (ROOT / "docs" / "audit.md").read_text()
    rows = re.findall(r"^\| `([a-z]+)` \| (preflight|serving) \| (yes|) \|$", doc, re.M)
    assert rows == [(c.name, c.phase, "yes" if c.containers else "") for c in have]


def write(d: Path, name: str, src: str) -> Path:
    p = d / f"test_{name}.py"
    p.write_text(src)
    return p


def test_a_declaration_is_read_from_the_source_without_running_it(tmp_path: Path) -> None:
    p = write(tmp_path, "disk", "import no_such_module\n\ndef planned(e): return []\n\n"
              "CONCERN = Concern(name='disk', order=5, phase='serving', containers=True, prefetch=planned)\n")
    assert read_declaration(p) == Concern(name="disk", order=5, phase="serving", containers=True)
    for src, needle in [
        ("CONCERN = Concern(name='other', order=5)\n", "name 'other', but the module is test_disk.py"),
        ("N = 5\nCONCERN = Concern(name='disk', order=N)\n", "order must be a literal"),
        ("CONCERN = Concern(name='disk', order=5, phase='later')\n", "expected phase one of preflight, serving"),
        ("CONCERN = Concern(name='disk', order=5, prefetched=None)\n", "unknown keyword 'prefetched'"),
        ("CONCERN = Concern('disk', 5)\n", "keywords only"),
        ("CONCERN = Concern(name='disk')\n", "expected a name and an order"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            read_declaration(write(tmp_path, "disk", src))


def test_a_module_that_declares_nothing_still_runs_last(tmp_path: Path) -> None:
    write(tmp_path, "b", "CONCERN = Concern(name='b', order=20)\n")
    write(tmp_path, "a", "CONCERN = Concern(name='a', order=30)\n")
    write(tmp_path, "broken", "def f(:\n")
    write(tmp_path, "bare", "import os\n")
    assert [(c.name, c.phase) for c in declared(tmp_path)] == [
        ("b", "preflight"), ("a", "preflight"), ("bare", "preflight"), ("broken", "preflight")]


def test_the_operator_reads_the_concerns_without_importing_pytest() -> None:
    code = ("import sys; from builder.cli.audit import audit; from builder.audit.selection import PACKAGE_CHECKS; "
            "from builder.audit.concerns import declared; assert declared(PACKAGE_CHECKS); "
            "print('pytest' in sys.modules, 'testinfra' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
