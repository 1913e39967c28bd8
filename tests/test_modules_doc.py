"""docs/modules.md is true to the tree: a row per package of builder/, in the order of the import
contract's layers, and no two modules of different packages share a name (outside cli/)."""

from __future__ import annotations

import re
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "modules.md"


def packages() -> set[str]:
    return {p.parent.relative_to(ROOT / "builder").parts[0] for p in (ROOT / "builder").glob("*/__init__.py")}


def rows() -> list[str]:
    return re.findall(r"^\| `builder/([a-z_]+)/` \|", DOC.read_text(), re.M)


def test_a_row_per_package_and_none_for_a_package_that_is_gone() -> None:
    listed = rows()
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == packages(), f"modules.md rows {sorted(set(listed) ^ packages())} differ from builder/"


def test_the_layers_said_are_the_contract() -> None:
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    said = DOC.read_text().split("The layers, top to bottom:", 1)[1].split("\n\n", 1)[0]
    named = re.findall(r"`([^`]+)`", said)
    layers = [layer.replace("(", "").replace(")", "") for layer in contract["layers"]]
    flat = [" | ".join(part.strip() for part in re.split(r"[|:]", layer)) for layer in layers]
    assert [n for n in named if n != "a | b"] == flat


def test_no_two_packages_share_a_module_name() -> None:
    where: dict[str, set[str]] = defaultdict(set)
    for p in (ROOT / "builder").rglob("*.py"):
        rel = p.relative_to(ROOT / "builder")
        if len(rel.parts) > 1 and rel.parts[0] != "cli" and p.stem not in ("__init__", "__main__"):
            where[p.stem].add(rel.parts[0])
    shared = {name: sorted(pkgs) for name, pkgs in where.items() if len(pkgs) > 1}
    assert shared == {}, shared
