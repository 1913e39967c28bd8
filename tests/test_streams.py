"""Which stream carries what, for every command that prints a report: the data (a table, the plan, the
launch, JSON) on stdout, progress and status on stderr. Each command runs in process through click's
runner, whose stdout and stderr are kept apart."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from builder import output
from builder.cli import cli
from tests.lib import auditlib, factory
from tests.lib.shipped import NO_DOCKER, copy_project, edit_lock

# a host nothing can reach: ssh's ProxyCommand fails at once, so the commands below contact no one
UNREACHABLE = [factory.host("a", 0, ssh="node-a"), factory.host("b", 1, ssh="node-b")]


@pytest.fixture(autouse=True)
def plain(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "250")
    for k, v in NO_DOCKER.items():
        monkeypatch.setenv(k, v)
    output.reset()
    yield
    output.reset()


def run(root: Path, *args: str) -> Result:
    """`builder --pins ROOT/pins.toml ARGS` in this process; stdout and stderr apart."""
    r = CliRunner().invoke(cli, ["--pins", str(root / "pins.toml"), *args], standalone_mode=False,
                           catch_exceptions=False)
    output.reset()
    return r


@pytest.fixture
def shipped(tmp_path: Path) -> Path:
    return copy_project(tmp_path / "proj")


@pytest.fixture
def unreachable_fleet(tmp_path: Path) -> Path:
    paths = auditlib.make_project(tmp_path / "fleetproj")
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host *\n  ProxyCommand false\n")
    (paths["hosts"] / "f.toml").write_text(auditlib.fleet_toml("f", UNREACHABLE, ssh_config=str(cfg)))
    return paths["pins"].parent


@pytest.mark.parametrize("argv", [["why", "demo"], ["image", "demo", "--plan"]])
def test_why_and_plan_print_address_and_closure_on_stdout(shipped: Path, argv: list[str]) -> None:
    r = run(shipped, *argv)
    assert r.return_value == 0, r.stderr
    first, closure = r.stdout.split("\n", 1)
    assert first.split()[0] == "demo" and len(first.split()[1]) == 64
    assert "sources" in json.loads(closure)
    assert r.stderr == ""


def test_diff_table_on_stdout_json_alone(shipped: Path, tmp_path: Path) -> None:
    old = tmp_path / "old.lock"
    old.write_bytes((shipped / "pins.lock").read_bytes())
    edit_lock(shipped, lambda d: d["images"]["demo"].update(source_date_epoch=1))
    r = run(shipped, "diff", str(old), str(shipped / "pins.lock"))
    assert r.return_value == 0
    assert "images.demo" in r.stdout and "source date" in r.stdout, r.stdout
    assert r.stderr == ""
    r = run(shipped, "diff", str(old), str(shipped / "pins.lock"), "--json")
    assert [c["input"] for c in json.loads(r.stdout)["changes"]] == ["images.demo"]
    r = run(shipped, "diff", str(old), str(old))
    assert r.stdout == "" and "no changes" in r.stderr


def test_audit_matrix_and_reasons_on_stdout_progress_on_stderr(unreachable_fleet: Path) -> None:
    r = run(unreachable_fleet, "audit", "--fleet", "f", "--only", "memory", "--connect-timeout", "2")
    assert r.return_value == 3
    assert "audit (fast, preflight)" in r.stdout and "not passing" in r.stdout
    for name in ("a", "b"):
        assert any(ln.split()[:2] == ["│", name] and "unreachable" in ln for ln in r.stdout.splitlines()), r.stdout
        assert f"{name}: unreachable (" in r.stderr  # each host's progress as it finishes
    assert "2 host(s), 2 not passing" in r.stderr and "│" not in r.stderr
    r = run(unreachable_fleet, "audit", "--fleet", "f", "--only", "memory", "--connect-timeout", "2", "--json")
    data = json.loads(r.stdout)  # JSON alone on stdout: no table before it
    assert data["hosts"]["a"]["status"] == "unreachable" and data["exit"] == 3


def test_status_table_on_stdout_json_alone(unreachable_fleet: Path) -> None:
    r = run(unreachable_fleet, "status", "--fleet", "f", "--connect-timeout", "2")
    assert r.return_value == 3
    assert "fleet f (lane demo" in r.stdout and "│" not in r.stderr
    assert [ln.split()[1] for ln in r.stdout.splitlines() if ln.split()[:1] == ["│"] and
            ln.split()[1] in ("a", "b")] == ["a", "b"]
    r = run(unreachable_fleet, "status", "--fleet", "f", "--connect-timeout", "2", "--json")
    assert sorted(json.loads(r.stdout)["hosts"]) == ["a", "b"]


def test_status_names_each_unreachable_host_once(unreachable_fleet: Path) -> None:
    r = run(unreachable_fleet, "status", "--fleet", "f", "--connect-timeout", "2")
    for name in ("a", "b"):
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"{name}: ")]
        assert lines and all(not ln.startswith(f"{name}: {name}: ") for ln in lines), r.stderr
        assert any("unreachable over ssh" in ln for ln in lines), r.stderr
