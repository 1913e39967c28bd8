"""SIGTERM and SIGHUP end a command as Ctrl-C does: the same cleanup (its `finally` blocks run), one
line, exit 143 or 129. A real `python3 -m builder audit` is signalled while it waits on a host (an
ssh_config whose ProxyCommand never answers) and holds its temporary folder; the folder is gone after.
Also: the audit's temporary folders carry their run's pid, and one a killed run left is removed by the
next audit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.lib import auditlib, clirun, factory

HOSTS = [factory.host("a", 0, ssh="node-a"), factory.host("b", 1, ssh="node-b")]


def hanging_project(tmp_path: Path) -> tuple[Path, Path]:
    """A project whose hosts are reached through a ProxyCommand that writes a marker and then waits."""
    paths = auditlib.make_project(tmp_path / "proj")
    marker = tmp_path / "contacted"
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host *\n  ProxyCommand sh -c 'touch {marker}; exec sleep 30'\n")
    (paths["hosts"] / "f.toml").write_text(auditlib.fleet_toml("f", HOSTS, ssh_config=str(cfg)))
    return paths["pins"].parent, marker


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def audit_folders(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("builder-audit-"))


@pytest.mark.parametrize("sig, code, line", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                             (signal.SIGHUP, 129, "hung up (SIGHUP)")])
def test_a_signal_mid_audit_runs_the_cleanup_and_exits_with_its_code(
        tmp_path: Path, sig: signal.Signals, code: int, line: str) -> None:
    root, marker = hanging_project(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    left = tmp / f"builder-audit-{dead_pid()}-killed"  # what a killed audit left: removed by the next
    (left / "f").mkdir(parents=True)
    ours = tmp / f"builder-audit-{os.getpid()}-live"  # a live run's: left alone
    ours.mkdir()
    env = clirun.environment({"TMPDIR": str(tmp)})
    p = subprocess.Popen([*clirun.ARGV, "--pins", str(root / "pins.toml"), "audit", "--fleet", "f", "--only",
                          "memory", "--connect-timeout", "5"], cwd=root, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the audit never reached a host"
            time.sleep(0.05)
        running = [n for n in audit_folders(tmp) if n.startswith(f"builder-audit-{p.pid}-")]
        assert len(running) == 1 and not left.exists() and ours.is_dir()
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == code, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == line and "Traceback" not in err, err
    assert audit_folders(tmp) == [ours.name]  # the run's folder went with it
