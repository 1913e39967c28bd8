"""Every `builder …` command a message names exists and takes the options it is given there: each
single-backquoted `builder …` in the source of builder/ and checks/ (messages, hints, help), with the
f-string's values standing in as words, runs as `builder ARGS --help` (click parses every option before
it prints the help, so an unknown command or option fails)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from builder.cli import cli
from builder.deploy.fleetwork import DeployOptions, command

ROOT = Path(__file__).resolve().parents[1]
HINT = re.compile(r"(?<!`)`(builder(?: [^`]*)?)`(?!`)")


def strings(path: Path) -> list[str]:
    """Every string of a module, an f-string with each value as `{}`, adjacent literals joined."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            out.append("".join(str(v.value) if isinstance(v, ast.Constant) else "{}" for v in node.values))
    return out


def hints() -> dict[str, str]:
    """hint -> where it was found (the first place)."""
    found: dict[str, str] = {}
    for folder in ("builder", "checks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for s in strings(path):
                for m in HINT.finditer(s):
                    if m.group(1).split()[1:2] != ["{}"]:  # (a verb given by a value names no command)
                        found.setdefault(m.group(1), str(path.relative_to(ROOT)))
    return found


def argv(hint: str) -> list[str]:
    """The hint's words after `builder`, a value shown as a placeholder as a word of its own."""
    words = hint.split()[1:]
    return [w.replace("{}", "x").strip(".,;:") or "x" for w in words]


def help_exit(args: list[str]) -> tuple[int, str]:
    r = CliRunner().invoke(cli, [*args, "--help"], catch_exceptions=False)
    return r.exit_code, r.output


FOUND = hints()


def test_the_source_names_commands() -> None:
    assert len(FOUND) >= 20, FOUND  # (the collector works: the messages name many commands)


@pytest.mark.parametrize("hint", sorted(FOUND))
def test_each_named_command_runs_as_typed(hint: str) -> None:
    code, out = help_exit(argv(hint))
    assert code == 0, f"{FOUND[hint]}: `{hint}`: {out.strip().splitlines()[-1:]}"


def test_no_message_names_a_verb_that_does_not_exist() -> None:
    code, out = help_exit(["derive"])
    assert code != 0 and "No such command" in out  # (what the check above catches)
    assert not [h for h in FOUND if h.split()[1:2] == ["derive"]]


def test_a_repair_hint_carries_the_fleet_lock_store_and_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("BUILDER_PINS", "BUILDER_LOCK", "BUILDER_STORE"):
        monkeypatch.delenv(var, raising=False)
    pins = tmp_path / "p" / "pins.toml"
    opts = DeployOptions(root=pins.parent, pins=pins, lock=tmp_path / "other.lock", store=tmp_path / "s",
                         fleet="f1", audit_mode="full")
    hint = command(opts, "deploy", "--repair", mode=True)
    assert hint == (f"builder --pins {pins} --lock {tmp_path / 'other.lock'} --store {tmp_path / 's'} deploy "
                    "--fleet f1 --repair --mode full")
    assert help_exit(hint.split()[1:])[0] == 0
    fast = DeployOptions(root=pins.parent, pins=pins, lock=pins.parent / "pins.lock",
                         store=pins.parent / ".cache" / "builder", fleet="f1")
    assert command(fast, "deploy", "--repair", mode=True).endswith(" deploy --fleet f1 --repair")
    monkeypatch.setenv("BUILDER_STORE", str(tmp_path / "s"))  # (the shell the operator types in has it)
    assert " --store " not in command(opts, "deploy", "--repair", mode=True)
