"""No dead code: vulture, configured in pyproject.toml's [tool.vulture], finds nothing in builder or checks
that nothing there uses (what only the tests or the benchmarks call counts as dead); tests/vulture_allow.py
names what is used from outside, and each of its names is one vulture would report without it (an entry
whose code is gone is refused too)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOW = ROOT / "tests" / "vulture_allow.py"
PATHS = ["builder", "checks"]


def vulture(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "vulture", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def allowed_names() -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(ALLOW.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_":
            names.add(node.attr)
        elif isinstance(node, ast.Name) and node.id != "_":
            names.add(node.id)
    return names


def test_nothing_is_dead() -> None:
    p = vulture()  # the paths and the allowlist from pyproject.toml
    assert (p.returncode, p.stdout, p.stderr) == (0, "", ""), p.stdout + p.stderr


def test_only_the_product_counts_as_a_user() -> None:
    """A test or a benchmark that calls a function does not keep it alive: vulture reads builder and checks
    (and the allowlist) only."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["vulture"]
    assert conf["paths"] == [*PATHS, ALLOW.relative_to(ROOT).as_posix()]


def test_each_allowed_name_is_one_vulture_would_report() -> None:
    p = vulture(*PATHS)
    assert p.returncode == 3, p.stderr  # vulture's exit status for "dead code found"
    reported = set(re.findall(r"^\S+:\d+: unused \w+ '([^']+)'", p.stdout, re.M))
    stale = allowed_names() - reported
    assert not stale, f"{ALLOW.name}: {sorted(stale)} no longer reported by vulture; drop them"


def test_a_function_nothing_calls_is_reported(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text("def used() -> int:\n    return 1\n\n\ndef orphan() -> int:\n"
                                     "    return used()\n")
    p = vulture("mod.py", cwd=tmp_path)
    assert p.returncode == 3 and "mod.py:5: unused function 'orphan'" in p.stdout, p.stdout + p.stderr
