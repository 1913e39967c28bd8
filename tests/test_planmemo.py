"""builder.planmemo on a copy of the project (the shipped pins and lock, no engine): the remembered input
address is given back only while every file the plan read is byte for byte the same; each kind of
change (a recipe file edited, a file added to the recipe folder, a patch, the pins, the lock) misses,
and then the full plan decides (and says the lock is stale)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import journeylib  # noqa: E402

from builder.errors import ConfigError  # noqa: E402
from builder.plan import load_inputs, make_plan, planned_address  # noqa: E402
from builder.planmemo import recall  # noqa: E402
from builder.store import Store  # noqa: E402


def _planned(root: Path, store: Path) -> str:
    """The full plan of demo, remembered as `builder push` does; the same address as the plan alone."""
    address = planned_address(store, root / "pins.toml", root / "pins.lock", "demo")
    pins, lock, _ = load_inputs(root / "pins.toml", root / "pins.lock", "demo")
    assert make_plan(pins, lock, "demo", root).address == address
    return address


def _append(rel: str) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        with open(root / rel, "a") as f:
            f.write("\n# changed\n")
    return change


def _new_file(root: Path) -> None:
    (root / "images" / "demo" / "NOTES").write_text("a file the recipe folder did not hold\n")


@pytest.mark.parametrize(("change", "stale"), [
    (_append("images/demo/Dockerfile"), True),
    (_new_file, True),
    (_append("patches/demo/0001-version-suffix-patched.patch"), True),
    (_append("pins.lock"), True),  # not in the form `builder lock` writes
    (_append("pins.toml"), False),  # a comment: the full plan gives the same address again
], ids=["recipe-file", "recipe-new-file", "patch", "lock", "pins-comment"])
def test_a_changed_input_misses_and_the_full_plan_decides(tmp_path: Path, change: Callable[[Path], None],
                                                          stale: bool) -> None:
    root = journeylib.project_copy(tmp_path / "project")
    store = tmp_path / "store"
    address = _planned(root, store)
    assert recall(store, root / "pins.toml", root / "pins.lock", "demo") == address
    assert recall(store, root / "pins.toml", root / "pins.lock", "tensorfold") is None  # never planned

    change(root)
    assert recall(store, root / "pins.toml", root / "pins.lock", "demo") is None
    if stale:
        with pytest.raises(ConfigError, match="changed|stale"):
            _planned(root, store)
        assert recall(store, root / "pins.toml", root / "pins.lock", "demo") is None
    else:
        assert _planned(root, store) == address
        assert recall(store, root / "pins.toml", root / "pins.lock", "demo") == address


def test_a_damaged_memo_misses(tmp_path: Path) -> None:
    root = journeylib.project_copy(tmp_path / "project")
    store = tmp_path / "store"
    _planned(root, store)
    (memo,) = (store / "plans").iterdir()
    memo.write_text("{not json")
    assert recall(store, root / "pins.toml", root / "pins.lock", "demo") is None
    memo.write_text('{"address": "0" }')
    assert recall(store, root / "pins.toml", root / "pins.lock", "demo") is None


def test_gc_keeps_a_memo_with_the_record_of_its_address(tmp_path: Path) -> None:
    root = journeylib.project_copy(tmp_path / "project")
    store = tmp_path / "store"
    address = _planned(root, store)
    (memo,) = (store / "plans").iterdir()
    kept = Store(store).gc(set(), set(), {address})
    assert memo.is_file() and f"plans/{memo.name}" not in kept.removed
    gone = Store(store).gc(set(), set(), set())
    assert not memo.exists() and f"plans/{memo.name}" in gone.removed
