"""Fixtures and reporting for the builder host checks (run by `builder audit`, one pytest per host).

Expectations come in a JSON file (`--builder-expect`) that `builder audit` wrote from the lock,
the inventory and the image record; nothing here reads an expectation from the host. The
results go to `--builder-results` as JSON: one entry per check with status and message, one line per check
module that did not collect (`collect_errors`: "checks/test_x.py: ImportError: ..."), and pytest's
exit status; `builder audit` reports a host whose modules did not collect, or that ran no check of
a selected concern, as `error`.

Rules every check follows: an assertion message says `expected X, found Y` (the checks run with
`--assert=plain`, so a bare `assert a == b` would report only "assertion failed"); a check whose
hardware or input is absent calls `pytest.skip(reason)` (never passes, `checklib.or_skip`), unless a
real Spark always has it: then it fails saying what was expected (`checklib.require`); every remote command is
built by a checklib function and run through `checklib.run`, so that the prefetch (one remote
call before the first check, running every command the selected checks will need: what each module's
`CONCERN` prefetches) answers it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import pytest
from checklib import Concern, prefetch, read_applied

_STATE: dict[str, Any] = {"unreachable": None, "results": {}, "order": [], "collect_errors": [], "root": "checks"}


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("builder")
    g.addoption(
        "--builder-expect", dest="builder_expect", default=None, help="expectations JSON for this host"
    )
    g.addoption("--builder-results", dest="builder_results", default=None, help="write results JSON here")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def expect(pytestconfig: pytest.Config) -> dict[str, Any]:
    path = pytestconfig.getoption("builder_expect")
    if not path:
        pytest.skip("no expectations file (run the checks through `builder audit`)")
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


@pytest.fixture(scope="session")
def host(pytestconfig: pytest.Config) -> Any:
    """The one host these checks run on (`builder audit` runs one pytest per host), from testinfra's
    own options, as testinfra's plugin builds it, with one difference: `--ssh-extra-args` reaches
    the ssh backend (the plugin drops it: pytest-testinfra issue 618). It carries the audit's ssh
    options, so every command goes through the host's one audit connection (ControlPath), with
    BatchMode and keepalives."""
    import testinfra

    o = pytestconfig.option
    names = o.hosts.split(",") if o.hosts else [None]
    extra = {"ssh_extra_args": o.ssh_extra_args} if getattr(o, "ssh_extra_args", None) else {}
    hosts = testinfra.get_hosts(
        names, connection=o.connection, ssh_config=o.ssh_config, ssh_identity_file=o.ssh_identity_file,
        sudo=o.sudo, sudo_user=o.sudo_user, ansible_inventory=o.ansible_inventory,
        force_ansible=o.force_ansible, **extra,
    )
    if len(hosts) != 1:
        pytest.exit(f"--hosts: the checks run on one host at a time, got {len(hosts)}", returncode=4)
    return hosts[0]


def declared(session: pytest.Session) -> list[Concern]:
    """The concerns of the check modules this session collected (each module's CONCERN), in order."""
    modules = dict.fromkeys(getattr(item, "module", None) for item in session.items)
    return [c for c in (getattr(m, "CONCERN", None) for m in modules) if isinstance(c, Concern)]


@pytest.fixture(scope="module", autouse=True)
def _prefetch(request: pytest.FixtureRequest, host: Any, expect: dict[str, Any]) -> None:
    """Before the first check: read most of this host's facts in one remote call (checklib.prefetch),
    the commands the collected modules' concerns plan."""
    prefetch(host, expect, declared(request.session))


@pytest.fixture(scope="module")
def applied(host: Any, expect: dict[str, Any]) -> dict[str, Any]:
    """The apply record; checks that need it skip when there is none (use `applied_record` to fail)."""
    rec, why = read_applied(host, expect)
    if rec is None:
        pytest.skip(why)
    return rec


@pytest.fixture
def finding(request: pytest.FixtureRequest) -> Any:
    """finding(key, value): a JSON value this check reports beside its outcome (the burn's TFLOPS, clock
    and power; ``kind="hardware"`` for a GPU that is unhealthy rather than drifted; a rank's exit),
    kept in the item's ``user_properties`` and written to the results as the check's ``facts``."""

    def put(key: str, value: Any) -> None:
        request.node.user_properties.append((key, value))

    return put


# ----------------------------------------------------------------------------- reporting


def _concern(item: pytest.Item) -> str:
    mod = getattr(item, "module", None)
    name = mod.__name__.rsplit(".", 1)[-1] if mod is not None else "other"
    return name[5:] if name.startswith("test_") else name


def _check_id(item: pytest.Item) -> str:
    name = getattr(item, "originalname", item.name)
    if name.startswith("test_"):
        name = name[5:]
    return f"{_concern(item)}::{name}"


def _lost_connection(exc: BaseException) -> bool:
    """testinfra's ssh backend raises RuntimeError(CommandResult) when ssh itself exits 255."""
    if not isinstance(exc, RuntimeError) or not exc.args:
        return False
    res = exc.args[0]
    return getattr(res, "rc", None) == 255 or getattr(res, "exit_status", None) == 255


def _message(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    e = excinfo.value
    if isinstance(e, pytest.fail.Exception):
        return str(e.msg).strip().splitlines()[0] if e.msg else "failed"
    if isinstance(e, AssertionError):
        text = str(e).strip()
        first = text.splitlines()[0] if text else "assertion failed"
        return first
    if _lost_connection(e):
        res = e.args[0]
        err = (getattr(res, "stderr", "") or "").strip().splitlines()
        return "connection lost: " + (err[-1] if err else "ssh exit status 255")
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".strip()


# Drift (a failed assertion, or pytest.fail in a check or its fact fixture) is reported by its
# message alone (expected X, found Y), without a traceback: the message says all there is to say,
# and formatting a traceback is most of what a failed check costs. Other exceptions keep theirs.


def _no_trace(e: BaseException) -> BaseException:
    if isinstance(e, AssertionError):
        text = str(e).strip()
        return pytest.fail.Exception(text.splitlines()[0] if text else "assertion failed", pytrace=False)
    if isinstance(e, pytest.fail.Exception):
        e.pytrace = False
    return e


class _DriftReports:
    """Reports drift (the pytest.fail(pytrace=False) that _no_trace makes of it) by its message
    alone: pytest's own report of a failure first cuts the traceback down to the check's frames,
    only for style "value" to print none of it. Every other outcome gets pytest's own report."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport | None:
        e = call.excinfo
        if e is None or call.when == "collect" or not isinstance(e.value, pytest.fail.Exception) or e.value.pytrace:
            return None
        return pytest.TestReport(
            item.nodeid, item.location, dict.fromkeys(item.keywords, 1), "failed", str(e.value.msg or "failed"),
            call.when, [], call.duration, call.start, call.stop, user_properties=item.user_properties,
        )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_DriftReports(), "builder-drift-reports")
    parent = os.environ.get(PARENT_ENV)
    if parent and parent.isdigit():
        threading.Thread(target=_end_with, args=(int(parent),), daemon=True, name="end-with-audit").start()


#: the pid of the `builder audit` (or deploy) that runs this host's checks (builder.audit.runner)
PARENT_ENV = "BUILDER_AUDIT_PARENT"


def _end_with(parent: int) -> None:
    """End this pytest and every ssh command it runs (its process group: the audit starts it in a session of
    its own) once the audit that started it is gone, a SIGKILL included: each command's ssh channel then
    closes, and on the host a tied step (checklib's burn) ends with it."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os.killpg(os.getpgrp(), signal.SIGKILL)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    if _STATE["unreachable"]:
        pytest.skip(f"unreachable: {_STATE['unreachable']}")
    try:
        return (yield)
    except pytest.fail.Exception as e:
        raise _no_trace(e) from None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    try:
        return (yield)
    except (AssertionError, pytest.fail.Exception) as e:
        raise _no_trace(e) from None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    rep = outcome.get_result()
    cid = _check_id(item)
    if cid not in _STATE["results"]:
        _STATE["order"].append(cid)
        _STATE["results"][cid] = {"id": cid, "concern": _concern(item), "status": "pass", "message": ""}
    entry = _STATE["results"][cid]
    if call.excinfo is not None and _lost_connection(call.excinfo.value) and not _STATE["unreachable"]:
        _STATE["unreachable"] = _message(call.excinfo)
    if rep.skipped and entry["status"] == "pass":
        reason = ""
        if call.excinfo is not None:
            reason = str(call.excinfo.value.msg if hasattr(call.excinfo.value, "msg") else call.excinfo.value)
        elif isinstance(rep.longrepr, tuple):
            reason = rep.longrepr[2]
        entry["status"], entry["message"] = "skip", reason.removeprefix("Skipped: ")
    elif rep.failed and entry["status"] in ("pass", "skip"):
        # drift: an assertion in the check, or pytest.fail() in a check or its fact fixture
        is_fail = call.excinfo is not None and (
            (rep.when == "call" and call.excinfo.errisinstance(AssertionError))
            or call.excinfo.errisinstance(pytest.fail.Exception)
        )
        entry["status"] = "fail" if is_fail else "error"
        entry["message"] = _message(call.excinfo) if call.excinfo is not None else str(rep.longrepr)[:300]
    if item.user_properties:  # what a check recorded for the fleet's view (item.user_properties): JSON values
        entry["facts"] = {str(k): v for k, v in item.user_properties}


def pytest_sessionstart(session: pytest.Session) -> None:
    _STATE["root"] = session.config.rootpath.name


def _collect_message(report: pytest.CollectReport) -> str:
    """The error of a module that did not collect, in one line: the exception pytest shows last
    (its `E   ` lines, or a plain traceback's last line)."""
    lines = [ln.rstrip() for ln in str(report.longrepr).splitlines() if ln.strip()]
    marked = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    return (marked or lines or ["collection failed"])[-1][:300]


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        where = f"{_STATE['root']}/{report.nodeid}" if report.nodeid else _STATE["root"]
        _STATE["collect_errors"].append(f"{where}: {_collect_message(report)}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("builder_results")
    if not path:
        return
    data = {
        "unreachable": _STATE["unreachable"],
        "checks": [_STATE["results"][c] for c in _STATE["order"]],
        "collect_errors": _STATE["collect_errors"],
        "exitstatus": int(exitstatus),
    }
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
