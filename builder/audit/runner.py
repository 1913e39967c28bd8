"""Running the checks on one host: reach it, then one pytest process over the check modules with
testinfra's backend for that host, then read what the checks reported.

A host's pytest is ``python -m pytest`` in a process of its own, with public options only: the check
modules, testinfra's plugin, the host (``--hosts``, and for ssh ``--ssh-extra-args`` with the host's
connection) and the files checks/conftest.py reads the expectations from and writes the results to.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from builder.audit.findings import CheckOutcome, HostResult
from builder.audit.selection import AuditOptions
from builder.foundation.canon import atomic_write, pretty_json
from builder.foundation.ssh import Connection, ControlSockets, why_not
from builder.inputs.hosts import FleetHost

#: pytest's plugins the checks do not use; each one adds hook calls around every check (a name this
#: pytest does not have is blocked all the same: no error)
NOT_PLUGINS = ("cacheprovider", "logging", "warnings", "faulthandler", "junitxml", "doctest", "pastebin",
               "stepwise", "unraisableexception", "threadexception", "legacypath", "debugging", "unittest",
               "subtests", "tmpdir", "monkeypatch", "recwarn", "setuponly", "setupplan", "reports", "python_path")


def connection(t: FleetHost, opts: AuditOptions, sockets: ControlSockets) -> Connection | None:
    """The host's ssh connection for this audit (None: not reached over ssh)."""
    if t.host.connection != "ssh":
        return None
    return Connection.to(t.host.ssh, t.ssh_config(), sockets, opts.connect_timeout)


def probe(t: FleetHost, opts: AuditOptions, conn: Connection | None) -> str | None:
    """None when the host answers within the bounded time; otherwise why not (one line). Over ssh
    this opens the host's one connection, which every check's command then shares."""
    if conn is not None:
        return conn.open()
    if t.host.connection == "local":
        return None
    return why_not(["docker", "exec", t.host.ssh, "true"], opts.connect_timeout + 5)


def host_options(t: FleetHost, opts: AuditOptions, conn: Connection | None) -> list[str]:
    """The pytest options that name the host: its testinfra backend (ssh, docker, local or ansible)
    and its connection settings."""
    h = t.host
    if opts.backend == "ansible":
        assert opts.inventory is not None
        return [f"--hosts=ansible://{h.name}", f"--ansible-inventory={opts.inventory}"]
    if conn is None:
        return ["--hosts=local://" if h.connection == "local" else f"--hosts=docker://{h.ssh}"]
    # testinfra's ssh backend runs, through /bin/sh,
    #   ssh <ssh_extra_args> [-F cfg] [-o User=u] [-o Port=p] [-i key] [-o ConnectTimeout=...]
    #       [-o ControlMaster=auto -o ControlPersist=...] [-o ControlPath=...] HOST COMMAND
    # with no `--` before HOST. So the audit gives it the host alone (no user, port or ssh_config:
    # those go into ssh_extra_args, with ConnectTimeout and ControlMaster, so testinfra adds none of
    # its own options) and ends ssh_extra_args with `--`: testinfra's command is then
    # `ssh <ours> -- HOST COMMAND`. The inventory's validation of Host.ssh (builder.foundation.ssh.parse_target:
    # no leading '-', no whitespace, no URL or shell characters) protects it as well, and is what
    # protects the Ansible backend, whose ssh command line Ansible builds.
    extra = conn.options() + conn.target.destination()[:-1]  # ... -l USER -p PORT --
    # (the = form: argparse would take a value starting with '-' for an option)
    return [f"--hosts=ssh://{conn.target.url_host()}", "--ssh-extra-args=" + " ".join(map(shlex.quote, extra))]


def pytest_args(checks_dir: Path, concerns: list[str], options: list[str]) -> list[str]:
    """pytest's arguments for the selected check modules, with the host's `options`."""
    return [
        *[str(checks_dir / f"test_{c}.py") for c in concerns],
        "-c",
        str(checks_dir / "pytest.ini"),
        "--rootdir",
        str(checks_dir),
        "-q",
        "-rN",
        "--no-header",
        # the results go to JSON (checks/conftest.py); the log needs only a plain traceback
        "--tb=native",
        # Each check's message says expected and found by itself: no assertion rewriting. The
        # output goes to this host's log as it comes: no capturing.
        "--assert=plain",
        "--capture=no",
        *[x for p in NOT_PLUGINS for x in ("-p", f"no:{p}")],
        "-p",
        "testinfra.plugin",
        *options,
    ]


def pytest_env() -> dict[str, str]:
    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    # only testinfra's plugin (-p): the others installed here (hypothesis's among them) would each
    # be imported by every host's pytest
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    # checks/conftest.py ends the host's pytest, and the ssh commands it runs, once this process is gone
    env["BUILDER_AUDIT_PARENT"] = str(os.getpid())
    return env


def run_pytest(args: list[str], log_path: Path, cwd: Path, timeout: float) -> int | None:
    """Run one host's pytest (``python -m pytest ARGS``, its output to the host's log, in a session of
    its own); its exit status, or None when it ran past `timeout` (then its process group is killed:
    pytest and whatever it started)."""
    with open(log_path, "wb") as log:
        p = subprocess.Popen([sys.executable, "-m", "pytest", *args], cwd=cwd, env=pytest_env(),
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        _end_group(p)
        return None
    except BaseException:  # (Ctrl-C, SIGTERM: the checks and their steps on the host end with the audit)
        _end_group(p)
        raise


def _end_group(p: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    p.kill()
    p.wait()


def read_results(path: Path) -> tuple[str | None, list[CheckOutcome], list[str]]:
    """What checks/conftest.py wrote: the lost connection (if any), each check's outcome, and one
    line per check module that did not collect ("checks/test_x.py: ImportError: ...")."""
    data = json.loads(path.read_text())
    checks = [CheckOutcome(c["id"], c["concern"], c["status"], c.get("message", ""), dict(c.get("facts") or {}))
              for c in data["checks"]]
    return data.get("unreachable"), checks, [str(e) for e in data.get("collect_errors") or []]


def log_hint(log_path: Path) -> str:
    """The first line of a host's pytest log that mentions an error (else its last line)."""
    lines = log_path.read_text(errors="replace").strip().splitlines() if log_path.exists() else []
    tail = [ln.strip() for ln in lines if "error" in ln.lower()][:1] or lines[-1:]
    return tail[0].strip() if tail else ""


def results_problem(
    code: int, checks: list[CheckOutcome], collect_errors: list[str], concerns: list[str], checks_dir: Path,
    log_path: Path,
) -> str:
    """Why a host's results cannot stand for its checks (its status is then `error`), or "": a check
    module did not collect, a selected concern ran no check (a module with no checks, or a run
    that stopped first), or pytest ended otherwise than with passed or failed checks."""
    if collect_errors:
        more = f" (+{len(collect_errors) - 1} more)" if len(collect_errors) > 1 else ""
        return collect_errors[0] + more
    ran = {c.concern for c in checks}
    missing = [f"{checks_dir.name}/test_{c}.py" for c in concerns if c not in ran]
    if missing:
        hint = log_hint(log_path) if code not in (0, 1, 5) else ""
        return f"no check ran from {', '.join(missing)} (pytest exit {code})" + (f": {hint}" if hint else "")
    if code not in (0, 1):  # 0: all passed or skipped, 1: some failed
        hint = log_hint(log_path)
        return f"the checks stopped (pytest exit {code})" + (f": {hint}" if hint else "")
    return ""


def run_host(
    t: FleetHost,
    opts: AuditOptions,
    expectations: dict[str, Any],
    work: Path,
    sockets: ControlSockets,
    checks_dir: Path,
    concerns: list[str],
) -> HostResult:
    """Audit one host: reach it, run its checks, judge what they reported. Its ssh connection is
    closed at the end unless connections are kept (`--ssh-persist`)."""
    conn = connection(t, opts, sockets)
    try:
        return _run_host(t, opts, expectations, work, conn, checks_dir, concerns)
    finally:
        if conn is not None:
            conn.close()


def _run_host(
    t: FleetHost,
    opts: AuditOptions,
    expectations: dict[str, Any],
    work: Path,
    conn: Connection | None,
    checks_dir: Path,
    concerns: list[str],
) -> HostResult:
    start = time.monotonic()
    res = HostResult(name=t.name, fleet=t.fleet.fleet.name, status="pass")

    def done(status: str | None = None, message: str = "") -> HostResult:
        if status is not None:
            res.status, res.message = status, message
        res.seconds = time.monotonic() - start
        return res

    why = probe(t, opts, conn)
    if why is not None:
        return done("unreachable", why)
    hdir = work / t.fleet.fleet.name / t.name
    hdir.mkdir(parents=True, exist_ok=True)
    exp_path, res_path, log_path = hdir / "expect.json", hdir / "results.json", hdir / "pytest.log"
    atomic_write(exp_path, pretty_json(expectations))
    res_path.unlink(missing_ok=True)  # (a kept workdir's last results must not stand for this run's)
    files = [f"--builder-expect={exp_path}", f"--builder-results={res_path}"]
    args = pytest_args(checks_dir, concerns, host_options(t, opts, conn) + files)
    code = run_pytest(args, log_path, checks_dir, opts.host_timeout)
    if code is None:
        return done("unreachable", f"checks did not finish within {opts.host_timeout:g} s")
    try:
        lost, checks, collect_errors = read_results(res_path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return done("error", f"the checks did not report (pytest exit {code}): " + (log_hint(log_path) or
                                                                                   type(e).__name__))
    res.checks = checks
    problem = results_problem(code, checks, collect_errors, concerns, checks_dir, log_path)
    if lost:
        return done("unreachable", lost)
    if problem:
        return done("error", problem)
    if any(c.status == "fail" and c.facts.get("kind") == "hardware" for c in checks):
        return done("unhealthy")  # the GPU itself: no deploy fixes it (the check's message says what does)
    if any(c.status == "fail" for c in checks):
        return done("drift")
    if any(c.status == "error" for c in checks):
        return done("error")
    return done()
