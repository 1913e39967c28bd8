"""One parser for ssh targets and one rule for a relative fleet.ssh_config (builder/sshtarget.py),
used by audit and ship alike; every ssh argv ends its options with `--` before the host."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import auditlib  # noqa: E402

from builder import audit as core  # noqa: E402
from builder.errors import ConfigError  # noqa: E402
from builder.hosts import load_fleet  # noqa: E402
from builder.ship import Remote  # noqa: E402

TARGETS = [
    ("spark-a", ["--", "spark-a"]),
    ("ops@192.0.2.7:2222", ["-l", "ops", "-p", "2222", "--", "192.0.2.7"]),
    ("root@[2001:db8::1]:22", ["-l", "root", "-p", "22", "--", "2001:db8::1"]),
    ("[2001:db8::2]", ["--", "2001:db8::2"]),
]


def _project(tmp_path: Path, ssh_config: str | None = "cfg/ssh_config") -> tuple[Path, list[Any]]:
    """hosts/f.toml with the TARGETS, its ssh_config named relative to hosts/ (where it is)."""
    hosts = tmp_path / "proj" / "hosts"
    (hosts / "cfg").mkdir(parents=True)
    (hosts / "cfg" / "ssh_config").write_text("")
    rows: list[dict[str, object]] = [
        {"name": f"h{i}", "ssh": t, "rank": i, "role": "head" if i == 0 else "worker"}
        for i, (t, _) in enumerate(TARGETS)
    ]
    (hosts / "f.toml").write_text(auditlib.fleet_toml("f", rows, ssh_config=ssh_config))
    return hosts / "f.toml", core.fleet_targets(hosts, "f")


def _opts(tmp_path: Path) -> core.AuditOptions:
    return core.AuditOptions(root=tmp_path, pins=tmp_path / "p", lock=tmp_path / "l", store=tmp_path / "s")


def _ends_with_dashdash(
    argv: list[str], tail: list[str], after: list[str], last: tuple[str, ...] | list[str] = ()
) -> None:
    """argv = ssh OPTIONS (the user and port ones of `tail` among them) `last` -- HOST `after`."""
    assert argv[0] == "ssh" and argv.count("--") == 1, argv
    i = argv.index("--")
    assert argv[i:] == [*tail[-2:], *after], argv
    assert argv[i - len(last) : i] == list(last), argv
    opts = tail[:-2]
    assert not opts or any(argv[j : j + len(opts)] == opts for j in range(1, i)), argv


def test_audit_ssh_argvs_end_options_with_dashdash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, targets = _project(tmp_path)
    opts = _opts(tmp_path)
    conns = core.Connections(tmp_path, True, 60)
    ran: list[list[str]] = []

    def fake_run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        ran.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(core.subprocess, "run", fake_run)
    for t, (_, tail) in zip(targets, TARGETS, strict=True):
        probe = core.probe_argv(t, opts, conns)
        assert probe is not None
        _ends_with_dashdash(probe, tail, [], ["-f", "-N"])
        # the kept connection's `true`, and closing it
        Path(conns.path(t)).touch()
        assert core.reuse(t, opts, conns)
        core.close_master(t, opts, conns, force=True)
        reused, closed = ran[-2:]
        _ends_with_dashdash(reused, tail, ["true"])
        _ends_with_dashdash(closed, tail, [], ["-O", "exit"])
        assert ["-F", str(tmp_path / "proj" / "hosts" / "cfg" / "ssh_config")] == probe[1:3]


def test_testinfra_runs_ssh_with_dashdash_before_the_host(tmp_path: Path) -> None:
    """What testinfra's ssh backend really runs with the audit's options: `ssh OURS -- HOST CMD`,
    testinfra adding no option of its own after ours (it puts the host after its options without
    `--`; the audit gives it the host alone and ends ssh_extra_args with `--`)."""
    import testinfra

    _, targets = _project(tmp_path)
    conns = core.Connections(tmp_path, True, 60)
    for t, (_, tail) in zip(targets, TARGETS, strict=True):
        o = core.pytest_host_options(t, _opts(tmp_path), conns)
        assert set(o) == {"hosts", "ssh_extra_args"}
        host = testinfra.get_host(o["hosts"], ssh_extra_args=o["ssh_extra_args"])
        cmd, args = host.backend._build_ssh_command("echo hi")
        argv = shlex.split(host.backend.quote(" ".join(cmd), *args))
        _ends_with_dashdash(argv, tail, ["echo hi"])
        assert f"ControlPath={conns.path(t)}" in argv and "ConnectTimeout=8" in argv[: argv.index("--")]


def test_ship_ssh_argv_ends_options_with_dashdash(tmp_path: Path) -> None:
    fleet_file, _ = _project(tmp_path)
    fleet = load_fleet(fleet_file)
    for h, (_, tail) in zip(fleet.hosts, TARGETS, strict=True):
        _ends_with_dashdash(Remote(fleet_file, fleet, h).argv("true"), tail, ["true"])


def test_ship_and_audit_take_a_relative_ssh_config_from_the_fleet_files_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet_file, targets = _project(tmp_path)
    fleet = load_fleet(fleet_file)
    want = str(fleet_file.parent / "cfg" / "ssh_config")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # (the working folder has no say)
    conns = core.Connections(tmp_path, True, 60)
    for h, t in zip(fleet.hosts, targets, strict=True):
        ship_argv = Remote(fleet_file, fleet, h).argv("true")
        audit_argv = core.probe_argv(t, _opts(tmp_path), conns)
        assert audit_argv is not None
        assert ship_argv[1:3] == audit_argv[1:3] == ["-F", want]
        assert str(core.ssh_config_path(t)) == want
    # the same file missing: both refuse it, naming the fleet file and key
    (fleet_file.parent / "cfg" / "ssh_config").unlink()
    for call in (lambda: Remote(fleet_file, fleet, fleet.hosts[0]), lambda: core.ssh_config_path(targets[0])):
        with pytest.raises(ConfigError, match=rf"^{fleet_file}: fleet\.ssh_config: no such file: {want}$"):
            call()


def test_ship_cli_uses_the_fleet_relative_ssh_config(tmp_path: Path) -> None:
    """`builder ship` end to end: the relative ssh_config beside the inventory is the one ssh reads
    (its ProxyCommand leaves a marker), where ship used to look for it under the project root."""
    import bundlelib as bl

    p = bl.make_project(tmp_path, ssh_config="ssh/config")
    marker = tmp_path / "contacted"
    (p.root / "hosts" / "ssh").mkdir()
    (p.root / "hosts" / "ssh" / "config").write_text(
        f"Host *\n  ProxyCommand sh -c 'touch {marker}; exit 1'\n")
    host = p.hosts[1]["name"] if p.hosts else "spark-b"
    r = p.cli("bundle", host, "--key", str(p.key))
    assert r.returncode == 0, r.stderr
    r = p.cli("ship", host, "--key", str(p.pub))
    assert r.returncode == 3 and marker.exists(), r.stderr
