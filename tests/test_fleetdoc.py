"""docs/fleet-file.md is what the fleet file's schema gives (tests/lib/fleetdoc.py), and covers all of it."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from builder.inputs import hosts
from tests.lib import fleetdoc


def _models(model: type[BaseModel]) -> set[type[BaseModel]]:
    """The model and every model its fields hold, however deep (a list of hosts, an optional burn)."""
    found = {model}
    for f in model.model_fields.values():
        todo: list[typing.Any] = [f.annotation]
        while todo:
            t = todo.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                found |= _models(t)
            todo += typing.get_args(t)
    return found


def test_the_page_in_the_tree_is_what_the_schema_gives() -> None:
    assert fleetdoc.PAGE.read_text() == fleetdoc.render(), (
        "docs/fleet-file.md is stale: run `python3 -m tests.lib.fleetdoc --write`")


def test_every_table_and_key_of_the_schema_is_on_the_page() -> None:
    assert {m for _, m in fleetdoc.TABLES} == _models(hosts.Fleet) - {hosts.Fleet}
    page = fleetdoc.render()
    for title, model in fleetdoc.TABLES:
        section = page.split(f"## `{title}`\n", 1)[1].split("\n## ", 1)[0]
        for name, f in model.model_fields.items():
            assert f"| `{name}` | " in section, f"{title} {name}"
            assert f.description, f"{model.__name__}.{name}: no description"


def test_a_key_without_a_description_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Bare(BaseModel):
        key: int = 1

    monkeypatch.setattr(fleetdoc, "TABLES", [*fleetdoc.TABLES, ("[bare]", Bare)])
    with pytest.raises(ValueError, match=r"^Bare\.key: no description"):
        fleetdoc.render()


def test_check_fails_on_a_stale_page_and_write_makes_it_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "fleet-file.md"
    monkeypatch.setattr(fleetdoc, "PAGE", page)
    assert fleetdoc.main(["--check"]) == 1
    page.write_text(fleetdoc.render().replace("required", "optional", 1))
    assert fleetdoc.main(["--check"]) == 1
    assert "not what the schema gives; run `python3 -m tests.lib.fleetdoc --write`" in capsys.readouterr().err
    assert fleetdoc.main(["--write"]) == 0 and fleetdoc.main(["--check"]) == 0
    assert page.read_text() == fleetdoc.render()


def test_the_example_is_a_fleet_file_the_schema_takes(tmp_path: Path) -> None:
    path = tmp_path / "pair.toml"
    path.write_text(fleetdoc.EXAMPLE)
    fleet = hosts.load_fleet(path)
    assert [h.role for h in fleet.by_rank()] == ["head", "worker"]
    assert fleetdoc.EXAMPLE in fleetdoc.render()
