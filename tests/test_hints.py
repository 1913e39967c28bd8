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
from builder.deploy.options import DeployOptions, command

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
    inv = DeployOptions(root=pins.parent, pins=pins, lock=pins.parent / "pins.lock",
                        store=pins.parent / ".cache" / "builder", fleet="f1", hosts_dir=tmp_path / "inv")
    hint = command(inv, "start")
    assert hint.endswith(f" start --fleet f1 --hosts-dir {tmp_path / 'inv'}")  # (the inventory it read)
    assert help_exit(hint.split()[1:])[0] == 0


def command_calls() -> dict[tuple[str, ...], str]:
    """(verb, its constant arguments…, "mode" when mode=True) -> where: each `command(opts, VERB, …)` in
    builder/ (its hints are f-strings of that call, so the collector above sees only `{}`)."""
    found: dict[tuple[str, ...], str] = {}
    for path in sorted((ROOT / "builder").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "command"):
                continue
            words = [a.value for a in node.args[1:] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            assert len(words) == len(node.args) - 1, f"{path}:{node.lineno}: a command() with a computed argument"
            mode = any(k.arg == "mode" and isinstance(k.value, ast.Constant) and k.value.value for k in node.keywords)
            found.setdefault((*words, *(["mode"] if mode else [])), f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


CALLS = command_calls()


def test_the_source_renders_commands() -> None:
    assert {c[0] for c in CALLS} >= {"deploy", "start"}, CALLS  # (the collector works)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_each_rendered_command_runs_as_typed(call: tuple[str, ...], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("BUILDER_PINS", "BUILDER_LOCK", "BUILDER_STORE"):
        monkeypatch.delenv(var, raising=False)
    pins = tmp_path / "p" / "pins.toml"  # (every option rendered: pins, lock and store not the defaults)
    opts = DeployOptions(root=pins.parent, pins=pins, lock=tmp_path / "other.lock", store=tmp_path / "s",
                         fleet="f1", audit_mode="full")
    words = [w for w in call if w != "mode"]
    hint = command(opts, words[0], *words[1:], mode="mode" in call)
    assert hint.split()[1:7] == ["--pins", str(pins), "--lock", str(tmp_path / "other.lock"), "--store",
                                 str(tmp_path / "s")]
    code, out = help_exit(hint.split()[1:])
    assert code == 0, f"{CALLS[call]}: `{hint}`: {out.strip().splitlines()[-1:]}"
