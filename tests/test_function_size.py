"""No function in builder/ runs longer than LIMIT lines (from its `def` to its last line, nested functions
counted in the function that holds them): a longer one is split into parts named for what each does.
ALLOWED names the exceptions, each with why it stays whole."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "builder"
LIMIT = 80

#: (path under builder/, function name) -> why it stays longer than LIMIT
ALLOWED: dict[tuple[str, str], str] = {
    ("foundation/dockerbuild.py", "build"): "one call to the engine's build API: its keyword arguments, and the "
    "log stream read line by line into the step, the intermediate images and the image ID it reports",
}


def long_functions(package: Path, limit: int) -> dict[tuple[str, str], int]:
    """(path under package, name) -> lines, for every function and method longer than ``limit``."""
    found: dict[tuple[str, str], int] = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found[(path.relative_to(package).as_posix(), node.name)] = lines
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    over = {k: n for k, n in long_functions(PACKAGE, LIMIT).items() if k not in ALLOWED}
    named = ", ".join(f"builder/{p}:{name} ({n})" for (p, name), n in sorted(over.items()))
    assert not over, f"longer than {LIMIT} lines (split them, or name them in ALLOWED with why): {named}"


def test_every_allowed_function_is_still_long() -> None:
    """An entry of ALLOWED whose function is gone or fits the limit goes from the list."""
    found = long_functions(PACKAGE, LIMIT)
    stale = [f"builder/{p}:{name}" for p, name in ALLOWED if (p, name) not in found]
    assert not stale, f"in ALLOWED but not longer than {LIMIT} lines: {', '.join(stale)}"


def test_the_count_covers_nested_and_async_functions(tmp_path: Path) -> None:
    def body(indent: int) -> str:
        return "\n".join(f"{' ' * indent}x{i} = {i}" for i in range(6))

    (tmp_path / "m.py").write_text(
        f"def short():\n    return 1\n\n\nasync def outer():\n{body(4)}\n\n    def inner():\n{body(8)}\n{body(8)}\n"
    )
    assert long_functions(tmp_path, 10) == {("m.py", "outer"): 21, ("m.py", "inner"): 13}


@pytest.mark.parametrize("why", list(ALLOWED.values()))
def test_each_exception_says_why(why: str) -> None:
    assert len(why.split()) >= 5
