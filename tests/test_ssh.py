"""builder/foundation/ssh.py: one parser for ssh targets, one rule for a relative fleet.ssh_config, one argv (its
options end with `--` before the host) and one connection per host per run, for audit and ship alike."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import testinfra

from builder.audit import runner as audit_runner
from builder.audit.selection import AuditOptions
from builder.errors import ConfigError
from builder.foundation import ssh
from builder.hostscripts import tied
from builder.inputs.hosts import FleetHost, fleet_hosts, load_fleet
from builder.ship import Remote
from tests.lib import auditlib
from tests.lib import bundlelib as bl

TARGETS = [
    ("spark-a", ["--", "spark-a"]),
    ("ops@192.0.2.7:2222", ["-l", "ops", "-p", "2222", "--", "192.0.2.7"]),
    ("root@[2001:db8::1]:22", ["-l", "root", "-p", "22", "--", "2001:db8::1"]),
    ("[2001:db8::2]", ["--", "2001:db8::2"]),
]


def _project(tmp_path: Path, ssh_config: str | None = "cfg/ssh_config") -> tuple[Path, list[FleetHost]]:
    """hosts/f.toml with the TARGETS, its ssh_config named relative to hosts/ (where it is)."""
    hosts = tmp_path / "proj" / "hosts"
    (hosts / "cfg").mkdir(parents=True)
    (hosts / "cfg" / "ssh_config").write_text("")
    rows: list[dict[str, object]] = [
        {"name": f"h{i}", "ssh": t, "rank": i, "role": "head" if i == 0 else "worker"}
        for i, (t, _) in enumerate(TARGETS)
    ]
    (hosts / "f.toml").write_text(auditlib.fleet_toml("f", rows, ssh_config=ssh_config))
    return hosts / "f.toml", fleet_hosts(hosts, "f")


def _opts(tmp_path: Path) -> AuditOptions:
    return AuditOptions(root=tmp_path, pins=tmp_path / "p", lock=tmp_path / "l", store=tmp_path / "s")


def _conn(t: FleetHost, sockets: ssh.ControlSockets) -> ssh.Connection:
    conn = audit_runner.connection(t, _opts(Path("/nonexistent")), sockets)
    assert conn is not None
    return conn


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


def test_parse_target_and_destination() -> None:
    for target, tail in TARGETS:
        assert ssh.parse_target(target).destination() == tail
    assert ssh.parse_target("root@[2001:db8::1]:22").url_host() == "[2001:db8::1]"
    for bad in ("-oProxyCommand=x", "a b", "u@", "@h", "h:0", "[::1", "h/x", "fe80::1%eth0"):
        with pytest.raises(ValueError):
            ssh.parse_target(bad)


def test_every_ssh_argv_ends_options_with_dashdash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a connection, reusing a kept one (its `true`) and closing it."""
    _, targets = _project(tmp_path)
    sockets = ssh.ControlSockets(tmp_path, True, 60)
    ran: list[list[str]] = []

    def fake_run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        if argv[:4] == [sys.executable, "-I", "-S", "-c"]:  # (ssh.with_parent's: then the pid, then ssh's argv)
            argv = argv[6:]
        ran.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(ssh.subprocess, "run", fake_run)
    for t, (_, tail) in zip(targets, TARGETS, strict=True):
        conn = _conn(t, sockets)
        assert conn.open() is None  # no kept connection: opened (-f -N)
        _ends_with_dashdash(ran[-1], tail, [], ["-f", "-N"])
        assert ["-F", str(tmp_path / "proj" / "hosts" / "cfg" / "ssh_config")] == ran[-1][1:3]
        Path(conn.control_path).touch()  # now a kept one: reused (`true`), then closed
        assert conn.reuse()
        conn.close(force=True)
        reused, closed = ran[-2:]
        _ends_with_dashdash(reused, tail, ["true"])
        _ends_with_dashdash(closed, tail, [], ["-O", "exit"])


def test_testinfra_runs_ssh_with_dashdash_before_the_host(tmp_path: Path) -> None:
    """What testinfra's ssh backend really runs with the audit's options: `ssh OURS -- HOST CMD`,
    testinfra adding no option of its own after ours (it puts the host after its options without
    `--`; the audit gives it the host alone and ends ssh_extra_args with `--`)."""
    _, targets = _project(tmp_path)
    sockets = ssh.ControlSockets(tmp_path, True, 60)
    for t, (_, tail) in zip(targets, TARGETS, strict=True):
        conn = _conn(t, sockets)
        hosts, extra = audit_runner.host_options(t, _opts(tmp_path), conn)
        assert hosts.startswith("--hosts=ssh://") and extra.startswith("--ssh-extra-args=")
        host = testinfra.get_host(hosts.split("=", 1)[1], ssh_extra_args=extra.split("=", 1)[1])
        cmd, args = host.backend._build_ssh_command("echo hi")
        argv = shlex.split(host.backend.quote(" ".join(cmd), *args))
        _ends_with_dashdash(argv, tail, ["echo hi"])
        assert f"ControlPath={conn.control_path}" in argv and "ConnectTimeout=8" in argv[: argv.index("--")]


def test_ship_ssh_argv_ends_options_with_dashdash_and_shares_one_connection(tmp_path: Path) -> None:
    fleet_file, _ = _project(tmp_path)
    fleet = load_fleet(fleet_file)
    for h, (_, tail) in zip(fleet.hosts, TARGETS, strict=True):
        with Remote(fleet_file, fleet, h) as remote:
            first, second = remote.argv("true"), remote.argv("cat > x")
            _ends_with_dashdash(first, tail, [tied("true")])  # (each step ends with its ssh session)
            paths = {a for argv in (first, second) for a in argv if a.startswith("ControlPath=")}
            assert len(paths) == 1 and "ControlMaster=auto" in first
            folder = Path(paths.pop().split("=", 1)[1]).parent
            assert folder.is_dir()
        assert not folder.exists()  # the ship's own connection folder goes with it


def test_ship_and_audit_take_a_relative_ssh_config_from_the_fleet_files_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet_file, targets = _project(tmp_path)
    fleet = load_fleet(fleet_file)
    want = str(fleet_file.parent / "cfg" / "ssh_config")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # (the working folder has no say)
    sockets = ssh.ControlSockets(tmp_path, True, 60)
    for h, t in zip(fleet.hosts, targets, strict=True):
        with Remote(fleet_file, fleet, h) as remote:
            ship_argv = remote.argv("true")
        assert ship_argv[1:3] == _conn(t, sockets).argv()[1:3] == ["-F", want]
        assert str(t.ssh_config()) == want
    # the same file missing: both refuse it, naming the fleet file and key
    (fleet_file.parent / "cfg" / "ssh_config").unlink()
    for call in (lambda: Remote(fleet_file, fleet, fleet.hosts[0]), lambda: targets[0].ssh_config()):
        with pytest.raises(ConfigError, match=rf"^{fleet_file}: fleet\.ssh_config: no such file: {want}$"):
            call()


def test_ship_cli_uses_the_fleet_relative_ssh_config(tmp_path: Path) -> None:
    """`builder ship` end to end: the relative ssh_config beside the inventory is the one ssh reads
    (its ProxyCommand leaves a marker)."""
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
    assert "unreachable over ssh" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr


def test_connection_paths_differ_by_host_and_ssh_config(tmp_path: Path) -> None:
    sockets = ssh.ControlSockets(Path("/tmp/x"), True, 60)
    paths = {sockets.path(cfg, target) for cfg in (None, tmp_path / "cfg") for target in ("a", "u@a:2222")}
    assert len(paths) == 4 and all(p.startswith("/tmp/x/") and len(p) == len("/tmp/x/") + 24 for p in paths)
    assert sockets.path(None, "a") == ssh.ControlSockets(Path("/tmp/x"), False, 0).path(None, "a")  # stable


def test_connections_are_kept_only_when_asked_and_only_in_a_private_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = Path(os.environ["BUILDER_SSH_DIR"])  # the test's own (tests/conftest.py)
    # not kept (the default): a folder of the run's own inside the shared one, gone after cleanup
    run = ssh.ControlSockets.for_run(0)
    assert not run.shared and run.folder.parent == shared and run.folder.stat().st_mode & 0o777 == 0o700
    run.cleanup()
    assert not run.folder.exists()
    kept = ssh.ControlSockets.for_run(60)
    assert kept.shared and kept.folder == shared and kept.persist == 60
    short = shared / "k"
    kept = ssh.ControlSockets.for_run(60, short)
    assert kept.shared and short.is_dir() and short.stat().st_mode & 0o777 == 0o700
    short.chmod(0o770)  # others could reach the sockets: this run's own temp folder instead, kept nowhere
    c = ssh.ControlSockets.for_run(60, short)
    assert not c.shared and c.folder.parent == Path("/tmp")
    c.cleanup()
    long = Path("/tmp/" + "d" * 80)  # no room for a socket name within a unix socket path
    c = ssh.ControlSockets.for_run(60, long)
    assert not c.shared and not long.exists()
    c.cleanup()
    monkeypatch.delenv("BUILDER_SSH_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short))
    assert ssh.control_folder() == short / "builder-ssh"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert ssh.control_folder() == Path(f"/tmp/builder-ssh-{os.geteuid()}")


def test_ssh_options_never_weaken_host_key_checking() -> None:
    joined = " ".join(ssh.ssh_options(8, "/nonexistent/%C", 0))
    assert "BatchMode=yes" in joined and "ControlMaster=auto" in joined and "ControlPersist=120s" in joined
    assert "StrictHostKeyChecking" not in joined and "KnownHosts" not in joined


def test_a_remote_engine_is_reached_through_the_system_ssh(tmp_path: Path) -> None:
    """DOCKER_HOST=ssh://...: the docker client runs this machine's `ssh` (so ssh_config, its known-hosts
    file and its options apply), not paramiko. A fake `ssh` on PATH records how it was called."""
    log = tmp_path / "ssh.log"
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$*" >> {shlex.quote(str(log))}\necho "fake ssh: refused" >&2\nexit 255\n'
    )
    fake.chmod(0o755)
    path = f"{fake.parent}{os.pathsep}{os.environ['PATH']}"
    env = {**os.environ, "DOCKER_HOST": "ssh://op@spark-build:2222", "PATH": path}
    code = (
        "from builder.foundation import dockerio\nfrom builder.errors import BuilderError\n"
        "try:\n    dockerio.client()\nexcept BuilderError as e:\n    print(e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                       cwd=Path(__file__).resolve().parent.parent)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("no Docker engine: ssh://op@spark-build:2222"), p.stdout
    calls = log.read_text().splitlines()
    assert calls and all(c == "-l op -p 2222 -- spark-build docker system dial-stdio" for c in calls), calls
