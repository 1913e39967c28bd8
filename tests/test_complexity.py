"""No function in builder/ ranks worse than C in radon's cyclomatic complexity (D and worse: more than 20
paths through it), and no module outside builder/installer/ runs over LIMIT lines. A function that does
too much is split into parts named for what each does; one that stays whole (a flat dispatch, a host
script read as one unit) says why in a comment that starts with MARK, on the line directly above its
``def`` (above its decorators, where it has some). The installer is the exception to the length rule:
it ships as one zipapp that a host runs alone, and its modules follow its steps."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from radon.complexity import cc_rank, cc_visit
from radon.visitors import Function

PACKAGE = Path(__file__).resolve().parents[1] / "builder"
#: ranks a function may have without saying why
FINE = "ABC"
MARK = "# radon:"
#: lines a module may have, outside EXEMPT
LIMIT = 500
EXEMPT = ("installer/",)


def _functions(blocks: list[Any]) -> Iterator[Function]:
    """radon's functions and methods, and the functions nested in them, whose complexity radon does not
    add to the function that holds them. (A class's rank is its methods' average: its methods are judged.)"""
    for b in blocks:
        if isinstance(b, Function):
            yield b
            yield from _functions(list(b.closures))


def _tops(tree: ast.AST) -> dict[int, int]:
    """Each def's line -> the line it starts on (its first decorator's, where it has some)."""
    return {node.lineno: min([node.lineno, *(d.lineno for d in node.decorator_list)])
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def ranked(package: Path) -> dict[tuple[str, int, str], tuple[str, bool]]:
    """(path under package, line, name) -> (radon's rank, whether a MARK comment stands directly above it),
    for every function, method and nested function."""
    found: dict[tuple[str, int, str], tuple[str, bool]] = {}
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        tops = _tops(ast.parse(text, filename=str(path)))
        for b in _functions(cc_visit(text)):
            top = tops.get(b.lineno, b.lineno)
            marked = top >= 2 and lines[top - 2].strip().startswith(MARK)
            found[(path.relative_to(package).as_posix(), b.lineno, b.fullname)] = (cc_rank(b.complexity), marked)
    return found


def long_modules(package: Path, limit: int) -> dict[str, int]:
    """path under package -> lines, for every module over ``limit`` lines outside EXEMPT."""
    found: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > limit and not rel.startswith(EXEMPT):
            found[rel] = n
    return found


def _named(keys: list[tuple[str, int, str]], found: dict[tuple[str, int, str], tuple[str, bool]]) -> str:
    return ", ".join(f"builder/{p}:{line} {name} ({found[(p, line, name)][0]})" for p, line, name in sorted(keys))


def test_no_function_ranks_worse_than_c_without_saying_why() -> None:
    found = ranked(PACKAGE)
    over = [k for k, (rank, marked) in found.items() if rank not in FINE and not marked]
    assert not over, (f"ranked worse than C (split it, or say why it stays whole in a `{MARK}` comment "
                      f"directly above its def): {_named(over, found)}")


def test_every_marked_function_still_ranks_worse_than_c() -> None:
    """A MARK comment above a function that now ranks C or better goes."""
    found = ranked(PACKAGE)
    stale = [k for k, (rank, marked) in found.items() if marked and rank in FINE]
    assert not stale, f"a `{MARK}` comment above a function ranked C or better: {_named(stale, found)}"


def test_each_mark_says_why() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip().startswith(MARK):
                why = line.strip().removeprefix(MARK)
                assert len(why.split()) >= 5, f"builder/{path.relative_to(PACKAGE)}:{i}: say why it stays whole"


def test_no_module_outside_the_installer_is_longer_than_the_limit() -> None:
    over = long_modules(PACKAGE, LIMIT)
    named = ", ".join(f"builder/{p} ({n})" for p, n in sorted(over.items()))
    assert not over, f"longer than {LIMIT} lines (move a coherent part into a module of its own): {named}"


def test_the_rank_covers_methods_nested_functions_and_the_mark(tmp_path: Path) -> None:
    def branches(indent: int) -> str:
        return "\n".join(f"{' ' * indent}if x == {i}:\n{' ' * (indent + 4)}return {i}" for i in range(25))

    (tmp_path / "m.py").write_text(
        "class K:\n"
        f"    {MARK} one flat dispatch reads best whole\n"
        "    @staticmethod\n"
        "    def flat(x):\n"
        f"{branches(8)}\n"
        "\n"
        "def outer(x):\n"
        "    def inner(x):\n"
        f"{branches(8)}\n"
        "    return inner(x)\n"
    )
    by_name = {name: rank for (_, _, name), rank in ranked(tmp_path).items()}
    assert by_name == {"K.flat": ("D", True), "outer": ("A", False), "inner": ("D", False)}


def test_the_length_rule_leaves_the_installer_out(tmp_path: Path) -> None:
    (tmp_path / "installer").mkdir()
    for rel in ("installer/big.py", "big.py", "small.py"):
        (tmp_path / rel).write_text("x = 1\n" * (3 if rel == "small.py" else 4))
    assert long_modules(tmp_path, 3) == {"big.py": 4}
