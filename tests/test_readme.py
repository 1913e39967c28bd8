"""The README's layout table names what the tree holds: every top-level entry, a row per package
of builder/ naming each of its modules, and each top-level module of builder/."""

from __future__ import annotations

import os
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


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def pages() -> list[str]:
    return ["README.md", *sorted(p for p in tracked() if p.startswith("docs/") and p.endswith(".md"))]


def test_every_relative_link_of_the_readme_and_docs_reaches_a_file_of_the_repo() -> None:
    """A reader of a clone can follow every link: to a tracked file or folder, and to a heading it has."""
    files = set(tracked())
    bad = []
    for page in pages():
        text = (ROOT / page).read_text()
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            rel = Path(page).parent.joinpath(path).as_posix() if path else page
            rel = str(Path(os.path.normpath(rel)))
            if rel not in files and not any(f.startswith(rel + "/") for f in files):
                bad.append(f"{page}: ({target}): no such file in the repo")
            elif anchor and rel.endswith(".md") and anchor not in anchors((ROOT / rel).read_text()):
                bad.append(f"{page}: ({target}): {rel} has no heading #{anchor}")
    assert not bad, "\n".join(bad)


def test_the_readme_and_docs_name_no_file_outside_the_repo() -> None:
    bad = [f"{page}: {m}" for page in pages()
           for m in re.findall(r"\S*(?:\.\./shared|/work/shared)\S*", (ROOT / page).read_text())]
    assert not bad, "\n".join(bad)
