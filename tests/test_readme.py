"""The README's layout table names what the tree holds: every top-level entry, a row per package
of builder/ naming each of its modules, and each top-level module of builder/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def layout_rows() -> dict[str, str]:
    """The layout table's rows: the path cell (backticks kept) to the row's text."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Layout", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = line.split(" | ")
        if line.startswith("| `") and len(cells) >= 2:
            rows[cells[0].removeprefix("| ")] = line
    return rows


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def names(row: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", row))


def test_each_top_level_entry_has_a_row() -> None:
    rows = " ".join(layout_rows())
    tops = {p.split("/", 1)[0] + ("/" if "/" in p else "") for p in tracked()} - {"README.md", ".gitignore"}
    missing = [t for t in sorted(tops) if f"`{t}" not in rows]
    assert not missing, f"README layout table lacks rows for {missing}"


def test_each_package_row_names_its_modules() -> None:
    rows = layout_rows()
    packages: dict[str, set[str]] = {}
    for p in tracked():
        path = Path(p)
        if path.parts[0] == "builder" and path.suffix == ".py" and len(path.parts) > 2:
            packages.setdefault("/".join(path.parts[:-1]) + "/", set()).add(path.stem)
    assert "builder/installer/" in packages
    missing = []
    for pkg, modules in sorted(packages.items()):
        row = rows.get(f"`{pkg}`")
        assert row is not None, f"README layout table has no row for {pkg}"
        said = names(row) | {n.removesuffix(".py") for n in names(row)}
        # builder/cli/ is one module per command group, which the commands' reference lists
        missing += [f"{pkg}{m}" for m in sorted(modules - {"__init__"}) if m not in said and pkg != "builder/cli/"]
    assert not missing, f"README layout rows do not name {missing}"


def test_each_top_level_module_of_builder_is_named() -> None:
    rows = layout_rows()
    said = set().union(*(names(r) for k, r in rows.items() if k.startswith("`builder/*.py`")))
    modules = {Path(p).stem for p in tracked() if re.fullmatch(r"builder/[^/]+\.py", p)} - {"__init__"}
    assert modules and not modules - said, f"README layout table does not name builder/{sorted(modules - said)}"
