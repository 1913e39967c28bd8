"""`builder audit`: run the testinfra checks in checks/ against hosts, in parallel, and report.

Flow:
1. Select the hosts (names or a fleet) and validate everything local first: the inventory,
   the pins (the fleet's lane exists), the lock (it has the lane and its models), the
   image plan. Any problem is one ConfigError line (exit 2) before a host is contacted.
2. Write one expectations file per host, built only from the lock, the inventory and the
   image record in the store (never from the host). checks/conftest.py reads it.
3. Per host, in parallel threads: a reachability probe with a bounded timeout (it reuses the
   ssh ControlMaster an earlier audit kept open, or opens one; the checks share it, and it is
   kept for --ssh-persist seconds afterwards), then one pytest process over the check
   modules with testinfra's backend for that host (ssh, docker, local, or ansible), forked
   from one process that imported pytest and testinfra once for the whole fleet. An
   unreachable host gives one `unreachable` result; the rest of the fleet is audited.
4. Merge the per-host results into a fleet matrix (stderr), JSON and JUnit.
Exit: 0 all pass, 1 drift (or a check errored), 3 a host unreachable (wins over 1).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder.canon import atomic_write, pretty_json
from builder.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, ConfigError
from builder.sshtarget import parse_target, ssh_argv_tail, ssh_config_file

if TYPE_CHECKING:  # builder.hosts brings pydantic: run_audit imports it after starting the zygote
    from builder.hosts import Fleet, Host
    from builder.pins import Lane

CONCERNS: tuple[str, ...] = (
    "image",
    "release",
    "models",
    "engram",
    "gpu",
    "memory",
    "fabric",
    "storage",
    "runtime",
    "serving",
)
PRE_CONCERNS = tuple(c for c in CONCERNS if c != "serving")
MODES = ("fast", "full")
PHASES = ("preflight", "serving", "all")
BACKENDS = ("native", "ansible")
EXPECT_FORMAT = 1
APPLIED_RELPATH = "state/applied.json"
#: default seconds a host's ssh connection outlives the audit (Ansible's ControlPersist default)
SSH_PERSIST = 60.0


# ----------------------------------------------------------------------------- options


@dataclass
class AuditOptions:
    root: Path
    pins: Path
    lock: Path
    store: Path
    hosts_dir: Path | None = None
    names: list[str] = field(default_factory=list)
    fleet: str | None = None
    mode: str = "fast"
    phase: str = "preflight"
    only: list[str] | None = None
    backend: str = "native"
    inventory: Path | None = None
    checks_dir: Path | None = None
    connect_timeout: float = 8.0
    host_timeout: float = 900.0
    hash_jobs: int = 4
    workdir: Path | None = None  # keep expectations/results here (default: a temp folder)
    #: seconds each host's ssh connection stays open after the audit, for the next one to reuse
    #: (0: close them when the audit ends)
    ssh_persist: float = SSH_PERSIST
    #: where the connections' control sockets live (default: control_folder())
    control_dir: Path | None = None

    def concerns(self) -> list[str]:
        base = {"preflight": PRE_CONCERNS, "serving": ("serving",), "all": CONCERNS}[self.phase]
        if self.only is None:
            return list(base)
        return [c for c in CONCERNS if c in self.only]


@dataclass(frozen=True)
class Target:
    path: Path
    fleet: Fleet
    host: Host

    @property
    def name(self) -> str:
        return self.host.name


@dataclass
class CheckResult:
    check: str  # "<concern>::<name>"
    concern: str
    status: str  # pass | fail | skip | error
    message: str = ""


@dataclass
class HostResult:
    name: str
    fleet: str
    status: str  # pass | drift | unreachable | error
    message: str = ""
    checks: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    def first_problem(self) -> str:
        if self.status in ("unreachable", "error"):
            return self.message
        for c in self.checks:
            if c.status in ("fail", "error"):
                return f"{c.check}: {c.message}"
        return ""


@dataclass
class AuditReport:
    hosts: list[HostResult]
    mode: str
    phase: str
    concerns: list[str]
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        if any(h.status == "unreachable" for h in self.hosts):
            return EXIT_UNREACHABLE
        if any(h.status in ("drift", "error") for h in self.hosts):
            return EXIT_FAILED
        return EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "phase": self.phase,
            "concerns": self.concerns,
            "exit": self.exit_code,
            "seconds": round(self.seconds, 3),
            "hosts": {
                h.name: {
                    "fleet": h.fleet,
                    "status": h.status,
                    "message": h.message or h.first_problem(),
                    "seconds": round(h.seconds, 3),
                    "checks": {c.check: {"status": c.status, "message": c.message} for c in h.checks},
                }
                for h in self.hosts
            },
        }


# ----------------------------------------------------------------------------- selection


def parse_only(value: str | None) -> list[str] | None:
    if value is None or value.strip() == "":
        return None
    out: list[str] = []
    for part in value.split(","):
        c = part.strip()
        if c not in CONCERNS:
            raise ConfigError(f"--only: unknown concern {c!r} (have: {', '.join(CONCERNS)})")
        if c not in out:
            out.append(c)
    return out


def fleet_targets(hosts_dir: Path, fleet: str | None) -> list[Target]:
    """Every host of one fleet, or of every fleet (by fleet name), in rank order."""
    from builder.hosts import find_fleet, load_fleets

    if fleet:
        path, f = find_fleet(hosts_dir, fleet)
        fleets = {f.fleet.name: (path, f)}
    else:
        fleets = load_fleets(hosts_dir)
    return [Target(p, f, h) for _, (p, f) in sorted(fleets.items()) for h in f.by_rank()]


def select_targets(hosts_dir: Path, names: list[str], fleet: str | None) -> list[Target]:
    from builder.hosts import find_host, load_fleets

    if fleet and names:
        raise ConfigError("give host names or --fleet, not both")
    if fleet:
        return fleet_targets(hosts_dir, fleet)
    if not names:
        fleets = load_fleets(hosts_dir)
        have = ", ".join(sorted(fleets)) or "none"
        raise ConfigError(f"say which hosts to audit: HOST... or --fleet NAME (fleets: {have})")
    out: list[Target] = []
    for n in names:
        path, f, h = find_host(hosts_dir, n)
        if any(t.fleet.fleet.name == f.fleet.name and t.name == h.name for t in out):
            continue
        out.append(Target(path, f, h))
    return out


def ssh_config_path(t: Target) -> Path | None:
    """The fleet's ssh_config (a relative path: from the fleet file's folder, as ship takes it)."""
    return ssh_config_file(t.path, t.fleet.fleet.ssh_config)


# ----------------------------------------------------------------------------- expectations


@dataclass
class LaneContext:
    """What the pins and lock say, loaded once (None + a reason when absent)."""

    pins: Any = None
    pins_reason: str = ""
    lock: Any = None
    lock_reason: str = ""
    lock_hash: str | None = None


def load_context(opts: AuditOptions, targets: list[Target]) -> LaneContext:
    from builder.hosts import check_against_pins
    from builder.lock import load_lock
    from builder.pins import load_pins

    ctx = LaneContext()
    if opts.pins.exists():
        ctx.pins = load_pins(opts.pins)
    else:
        ctx.pins_reason = f"no pins file at {opts.pins}"
    if opts.lock.exists():
        ctx.lock = load_lock(opts.lock)
        ctx.lock_hash = ctx.lock.lock_hash()
    else:
        ctx.lock_reason = f"no lock file at {opts.lock} (run `builder lock`)"
    if ctx.pins is None and ctx.lock is not None:
        raise ConfigError(f"{opts.lock}: a lock without its pins file {opts.pins}")
    seen: set[str] = set()
    for t in targets:
        if t.fleet.fleet.name in seen:
            continue
        seen.add(t.fleet.fleet.name)
        if ctx.pins is not None:
            lock_lanes = set(ctx.lock.lanes) if ctx.lock is not None else None
            check_against_pins(t.path, t.fleet, set(ctx.pins.lanes), lock_lanes)
        if ctx.lock is not None and ctx.pins is not None:
            lane = ctx.pins.lanes[t.fleet.fleet.lane]
            for m in lane.models:
                if m not in ctx.lock.models:
                    raise ConfigError(
                        f"{opts.lock}: models.{m}: lane {t.fleet.fleet.lane!r} needs it but the "
                        f"lock has no entry (run `builder lock`)"
                    )
        ssh_config_path(t)
    return ctx


def _image_expectation(
    opts: AuditOptions, ctx: LaneContext, lane_name: str
) -> tuple[dict[str, Any] | None, str]:
    from builder.imagerecord import read_record
    from builder.plan import make_plan

    if ctx.pins is None:
        return None, ctx.pins_reason
    if ctx.lock is None:
        return None, ctx.lock_reason
    lane = ctx.pins.lanes[lane_name]
    plan = make_plan(ctx.pins, ctx.lock, lane.image, opts.root)
    rec = read_record(opts.store, plan.address)
    if rec is None:
        # (with a lock, the image checks fail with this: checklib.expected_image)
        return None, (
            f"image {lane.image}: expected a build record for input address {plan.address[:16]} in "
            f"{opts.store} (run `builder image {lane.image}`), found none"
        )
    return {
        "name": lane.image,
        "input_address": rec.input_address,
        "image_id": rec.image_id,
        "diff_ids": list(rec.diff_ids),
        "labels": dict(rec.labels),
        "tag": rec.tag,
    }, ""


def _launch_expectation(fleet: Fleet, host: Host, lane_name: str, lane: Lane) -> tuple[dict[str, Any] | None, str]:
    """How start.sh runs this rank (builder.launch, from the pins and inventory): the container's
    name, its environment and its arguments."""
    from builder.launch import container_name, rank_env, render_args

    try:
        env = rank_env(fleet, host, lane_name, lane)
        args = render_args(fleet, host, lane_name, lane)
    except ConfigError as e:
        return None, str(e)
    return {"container": container_name(lane_name, host.rank), "env": env, "args": args}, ""


def build_expectations(
    t: Target, opts: AuditOptions, ctx: LaneContext, concerns: list[str]
) -> dict[str, Any]:
    h, f = t.host, t.fleet
    lane_name = f.fleet.lane
    exp: dict[str, Any] = {
        "format": EXPECT_FORMAT,
        "host": {
            "name": h.name,
            "rank": h.rank,
            "role": h.role,
            "connection": h.connection,
            "address": h.address,
        },
        "fleet": f.fleet.name,
        "lane": lane_name,
        "world_size": len(f.hosts),
        "mode": opts.mode,
        "phase": opts.phase,
        "concerns": concerns,
        "hash_jobs": opts.hash_jobs,
        "paths": h.paths.model_dump(mode="json"),
        "applied_path": f"{h.paths.bundles.rstrip('/')}/{APPLIED_RELPATH}",
        "current_path": f"{h.paths.bundles.rstrip('/')}/current",
        "fabric": h.fabric.model_dump(mode="json"),
        "expect": h.expect.model_dump(mode="json"),
        "serve": None,
        "serve_reason": ctx.pins_reason,
        "launch": None,
        "launch_reason": ctx.pins_reason,
        "lock_hash": ctx.lock_hash,
        "lock_reason": ctx.lock_reason,
        "image": None,
        "image_reason": "",
        "models": None,
        "models_reason": ctx.lock_reason or ctx.pins_reason,
    }
    if ctx.pins is not None:
        lane = ctx.pins.lanes[lane_name]
        exp["serve"] = lane.serve.model_dump(mode="json")
        exp["serve_reason"] = ""
        exp["launch"], exp["launch_reason"] = _launch_expectation(f, h, lane_name, lane)
        if ctx.lock is not None:
            from builder.placement import place_models

            models = [m.to_json() for m in place_models(ctx.pins, ctx.lock, lane_name, h)]
            exp["models"] = models
            exp["models_reason"] = "" if models else f"lane {lane_name!r} has no models"
    if "image" in concerns or "release" in concerns:
        img, why = _image_expectation(opts, ctx, lane_name)
        exp["image"], exp["image_reason"] = img, why
    return exp


# ----------------------------------------------------------------------------- connections


def control_folder() -> Path:
    """Where the audit's ssh control sockets live across runs: $BUILDER_SSH_DIR, else
    $XDG_RUNTIME_DIR/builder-ssh, else /tmp/builder-ssh-UID (unix socket paths are short)."""
    if os.environ.get("BUILDER_SSH_DIR"):
        return Path(os.environ["BUILDER_SSH_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "builder-ssh"
    return Path(f"/tmp/builder-ssh-{os.geteuid()}")


def private_folder(path: Path) -> bool:
    """Make `path` (mode 0700) or accept it as it is: a real folder, ours, closed to others.
    Anyone who can reach a control socket can run commands on its host as the audit's user."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


#: room left in a unix socket path (108 bytes) for the control socket's name, with ssh's own
#: temporary suffix while it binds (about 20 characters)
_SOCKET_NAME = 48


@dataclass
class Connections:
    """Where this audit's ssh connections (ControlMaster sockets) live, and whether they are
    shared with later audits (a private folder of the user's) or this run's own (a temp folder)."""

    folder: Path
    shared: bool
    persist: float

    def path(self, t: Target) -> str:
        """The host's ControlPath: a hash of the fleet's ssh_config and the host's ssh target, so a
        fleet with other keys or options gets a connection of its own, and the audit can tell
        from the file alone whether a connection may be open (no ssh process to ask)."""
        key = f"{ssh_config_path(t) or ''}\0{t.host.ssh}"
        return f"{self.folder}/{hashlib.sha256(key.encode()).hexdigest()[:24]}"

    def keep(self) -> bool:
        """Whether connections stay open after the audit (for the next one to reuse)."""
        return self.shared and self.persist > 0


def open_connections(opts: AuditOptions) -> Connections:
    """The shared folder when it is usable (see private_folder) and its path leaves room for the
    socket names; otherwise (or for --backend ansible) a temp folder of this run's own, whose
    connections close at the end."""
    folder = opts.control_dir or control_folder()
    # (the Ansible backend runs the checks over Ansible's own connections: nothing here to keep)
    if opts.backend == "native" and len(str(folder)) + 1 + _SOCKET_NAME < 104 and private_folder(folder):
        return Connections(folder, True, opts.ssh_persist)
    return Connections(Path(tempfile.mkdtemp(prefix="bA-", dir="/tmp")), False, 0)


def ssh_options(opts: AuditOptions, control_path: str, persist: float) -> list[str]:
    t = max(1, int(opts.connect_timeout))
    return [
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={t}",
        "-o",
        "ControlMaster=auto",
        "-o",
        f"ControlPath={control_path}",
        "-o",
        # a connection the audit closes itself still ends on its own if the audit is killed
        f"ControlPersist={max(1, int(persist)) if persist > 0 else 120}s",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
    ]


def probe_argv(t: Target, opts: AuditOptions, conns: Connections) -> list[str] | None:
    """The command that proves a host answers (None for local). Over ssh it opens the host's one
    connection, the master every later command shares, and returns once that connection is
    authenticated (-f -N: no remote command, no session on the host)."""
    h = t.host
    if h.connection == "local":
        return None
    if h.connection == "docker":
        return ["docker", "exec", h.ssh, "true"]
    return _ssh_argv(t, opts, conns, ["-f", "-N"])


def _ssh_argv(t: Target, opts: AuditOptions, conns: Connections, extra: list[str]) -> list[str]:
    """ssh with the audit's options, then `extra` (options), then `--` and the host; a remote
    command, if any, goes after that."""
    cfg = ssh_config_path(t)
    argv = ["ssh"] + (["-F", str(cfg)] if cfg else []) + ssh_options(opts, conns.path(t), conns.persist)
    tail = ssh_argv_tail(parse_target(t.host.ssh))
    return argv + tail[:-2] + extra + tail[-2:]


def _run_bounded(argv: list[str], limit: float) -> subprocess.CompletedProcess[str] | None:
    """Run argv (its own session, no stdin); None when it ran past `limit` seconds."""
    try:
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=limit,
            stdin=subprocess.DEVNULL,
            check=False,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return None


def reuse(t: Target, opts: AuditOptions, conns: Connections) -> bool:
    """Whether an earlier audit's connection to the host is open and the host still answers on it:
    one `true` through it, within --connect-timeout, as a new connection must answer within it
    (ConnectTimeout). The `true` is two round trips (channel open, exec) and no key exchange, so
    the bound leaves it no more room than a new connection's first answer: a host that became
    too slow to reach afresh is not audited through an old connection either. A connection that
    is open but gets no answer in time (the host went away without closing it, or the link got
    slow) is closed here, so the probe starts afresh and says why the host is unreachable."""
    if t.host.connection != "ssh" or not conns.shared or not os.path.exists(conns.path(t)):
        return False
    try:
        alive = _run_bounded(_ssh_argv(t, opts, conns, []) + ["true"], max(1.0, opts.connect_timeout))
    except OSError:  # no ssh here: the probe says so
        return False
    if alive is not None and alive.returncode == 0:
        return True
    close_master(t, opts, conns, force=True)
    return False


@contextmanager
def _opening(t: Target, opts: AuditOptions, conns: Connections) -> Iterator[None]:
    """Hold the host's lock in a shared folder while its connection is opened: two audits that
    open the same host at once would otherwise both connect, and the one whose control socket
    lost the race would stay in the background as a connection nobody uses or closes. The holder
    is bounded (reuse, then a probe), so a waiter that waited that long goes on without it."""
    if not conns.shared:
        yield
        return
    import fcntl

    fd = os.open(conns.path(t) + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + 2 * (opts.connect_timeout + 5) + 10
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def probe(t: Target, opts: AuditOptions, conns: Connections) -> str | None:
    """None when the host answers within the bounded time; otherwise why not (one line)."""
    argv = probe_argv(t, opts, conns)
    if argv is None or reuse(t, opts, conns):
        return None
    with _opening(t, opts, conns):
        # another audit may have opened it while this one waited for the lock
        return None if reuse(t, opts, conns) else _open(argv, opts)


def _open(argv: list[str], opts: AuditOptions) -> str | None:
    limit = opts.connect_timeout + 5
    try:
        p = _run_bounded(argv, limit)
    except FileNotFoundError:
        return f"{argv[0]}: not found on this machine"
    if p is None:
        return f"no answer within {limit:g} s"
    if p.returncode == 0:
        return None
    lines = [ln.strip() for ln in (p.stderr or p.stdout).splitlines() if ln.strip()]
    return lines[-1] if lines else f"{argv[0]} exit status {p.returncode}"


def close_master(t: Target, opts: AuditOptions, conns: Connections, force: bool = False) -> None:
    """Close the host's connection, unless it is kept for the next audit (force: close it anyway)."""
    if t.host.connection != "ssh" or (conns.keep() and not force):
        return
    argv = _ssh_argv(t, opts, conns, ["-O", "exit"])
    try:
        subprocess.run(argv, capture_output=True, timeout=10, stdin=subprocess.DEVNULL, check=False)
    except (subprocess.TimeoutExpired, OSError):
        pass


#: pytest's plugins a host's checks do not use; each one costs hook calls around every check
NOT_PLUGINS = ("cacheprovider", "logging", "warnings", "faulthandler", "junitxml", "doctest", "pastebin",
               "stepwise", "unraisableexception", "threadexception", "legacypath", "debugging", "unittest")


def pytest_host_options(t: Target, opts: AuditOptions, conns: Connections) -> dict[str, str]:
    """The pytest options that differ from host to host, by option name (dest): the host's
    testinfra backend (ssh, docker, local or ansible) and its connection settings."""
    h = t.host
    if opts.backend == "ansible":
        assert opts.inventory is not None
        return {"hosts": f"ansible://{h.name}", "ansible_inventory": str(opts.inventory)}
    if h.connection == "local":
        return {"hosts": "local://"}
    if h.connection == "docker":
        return {"hosts": f"docker://{h.ssh}"}
    # testinfra's ssh backend (testinfra/backend/ssh.py, 10.x) runs, through /bin/sh,
    #   ssh <ssh_extra_args> [-F cfg] [-o User=u] [-o Port=p] [-i key] [-o ConnectTimeout=...]
    #       [-o ControlMaster=auto -o ControlPersist=...] [-o ControlPath=...] HOST COMMAND
    # with no `--` before HOST. So the audit gives it the host alone (no user, port or ssh_config:
    # those go into ssh_extra_args, with ConnectTimeout and ControlMaster, so testinfra adds none of
    # its own options) and ends ssh_extra_args with `--`: testinfra's command is then
    # `ssh <ours> -- HOST COMMAND`. The inventory's validation of Host.ssh (builder.sshtarget:
    # no leading '-', no whitespace, no URL or shell characters) protects it as well, and is
    # what protects the Ansible backend, whose ssh command line Ansible builds.
    cfg = ssh_config_path(t)
    target = parse_target(h.ssh)
    extra = (["-F", str(cfg)] if cfg else []) + ssh_options(opts, conns.path(t), conns.persist)
    extra += ssh_argv_tail(target)[:-1]  # -l USER -p PORT --
    # (a shell command line: testinfra puts it into the ssh command it runs through /bin/sh)
    return {"hosts": f"ssh://{target.url_host()}", "ssh_extra_args": " ".join(shlex.quote(x) for x in extra)}


def option_args(options: dict[str, str]) -> list[str]:
    """The command-line form of pytest options by name: {"ssh_config": V} -> ["--ssh-config=V"]
    (the = form: argparse would take a value starting with '-' for an option)."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]


def common_pytest_args(checks_dir: Path, concerns: list[str]) -> list[str]:
    """The pytest arguments every host's checks share (the per-host ones: pytest_host_options)."""
    return [
        *[str(checks_dir / f"test_{c}.py") for c in concerns],
        "-c",
        str(checks_dir / "pytest.ini"),
        "--rootdir",
        str(checks_dir),
        "-q",
        "-rN",
        # the results go to JSON (checks/conftest.py); the log only needs a plain traceback, and
        # pytest's default long form parses each failing check's source (~10 ms per failure)
        "--tb=native",
        "--no-header",
        # Per-host CPU is what an audit of many hosts costs on a small operator machine: no
        # assertion rewriting (each check's message says expected and found by itself, and the
        # zygote's pre-imported modules are used as they are), no output capture (the output
        # goes to this host's log file), and none of the per-test plugins the checks do not use.
        "--assert=plain",
        "--capture=no",
        *[x for p in NOT_PLUGINS for x in ("-p", f"no:{p}")],
        "-p",
        "testinfra.plugin",
    ]


# ----------------------------------------------------------------------------- running


def default_checks_dir(root: Path) -> Path:
    for cand in (root / "checks", Path(__file__).resolve().parent.parent / "checks"):
        if (cand / "conftest.py").is_file():
            return cand
    raise ConfigError(f"{root / 'checks'}: no checks folder (conftest.py not found)")


def _python_env() -> dict[str, str]:
    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    # One pytest runs per host: load only testinfra (passed with -p). Autoloaded plugins such as
    # hypothesis's cost ~0.5 s of CPU each start, which on a small operator machine adds up per host.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def read_results(path: Path) -> tuple[str | None, list[CheckResult], list[str]]:
    """What checks/conftest.py wrote: the lost connection (if any), each check's result, and one
    line per check module that did not collect ("checks/test_x.py: ImportError: ...")."""
    data = json.loads(path.read_text())
    checks = [CheckResult(c["id"], c["concern"], c["status"], c.get("message", "")) for c in data["checks"]]
    return data.get("unreachable"), checks, [str(e) for e in data.get("collect_errors") or []]


def _log_hint(log_path: Path) -> str:
    """The first line of a host's pytest log that mentions an error (else its last line)."""
    lines = log_path.read_text(errors="replace").strip().splitlines() if log_path.exists() else []
    tail = [ln.strip() for ln in lines if "error" in ln.lower()][:1] or lines[-1:]
    return tail[0].strip() if tail else ""


def results_problem(
    code: int, checks: list[CheckResult], collect_errors: list[str], concerns: list[str], checks_dir: Path,
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
        hint = _log_hint(log_path) if code not in (0, 1, 5) else ""
        return f"no check ran from {', '.join(missing)} (pytest exit {code})" + (f": {hint}" if hint else "")
    if code not in (0, 1):  # 0: all passed or skipped, 1: some failed
        hint = _log_hint(log_path)
        return f"the checks stopped (pytest exit {code})" + (f": {hint}" if hint else "")
    return ""


#: A small process that imports pytest and testinfra once and forks one pytest per host from
#: there, so a fleet pays the interpreter start and those imports (about 0.2 s of CPU) once
#: instead of once per host. It is single-threaded, so forking it is safe. Protocol, one line
#: each: in `{"prepare": COMMON}` (optional, once) or `{"id", "args", "common", "options", "log",
#: "cwd"}`; out `pid ID PID` after the fork, `exit ID CODE` when that child ends. EOF on stdin:
#: wait for the children, then exit.
#:
#: `prepare` does, once in the zygote, what every host's pytest would otherwise do the same way:
#: parse the configuration for the arguments every host shares (loading the plugins and
#: conftest.py, building the option parser), configure the plugins, start the session and collect
#: the checks (about 60 ms of CPU per host, most of a host's pytest). The checks can be collected
#: once because nothing in them depends on the host: the host is a session fixture
#: (checks/conftest.py), not a collection parameter as in testinfra's plugin. A host's fork whose
#: `common` equals the prepared one sets its own `options` (the host and where its expectations
#: and results live, by option name) and runs the collected checks, then finishes the session, as
#: pytest's own wrap_session does. That uses pytest internals (`_prepareconfig`, the Session
#: steps): if any of it is missing or fails, the forks parse (or, failing that, run
#: `pytest.main(args)`) as before, and a check module that does not import is reported by each
#: host's own collection. The zygote's fd 1 goes to /dev/null (the protocol has its own copy), so
#: what pytest writes while preparing is dropped, and a fork's output goes to its host's log.
ZYGOTE = r"""
import json, os, select, signal, sys
import pytest
import testinfra.plugin
try:  # what the checks import (builder.gpu brings pydantic): once here, not once per host
    import builder.gpu, builder.hostcheck
except ImportError:
    pass
# The check modules themselves, imported here from the checks folder (argv[1]) under the names
# pytest's prepend import mode gives them, so each fork finds them in sys.modules instead of
# compiling them again (run_host passes --assert=plain: no assertion rewriting to redo). Their
# module-level state is still empty in every fork. A module that fails here is left for pytest,
# whose own import then reports the error for that host.
import glob
sys.path.insert(0, sys.argv[1])
for _f in ["conftest.py"] + sorted(glob.glob(os.path.join(sys.argv[1], "test_*.py"))):
    try:
        __import__(os.path.basename(_f)[:-3])
    except Exception:
        sys.modules.pop(os.path.basename(_f)[:-3], None)
# everything imported so far lives as long as the forks: keep the garbage collector off it, so a
# fork's collections neither scan it nor touch (and so copy) its pages
import gc
gc.freeze()
PREPARED = []  # [common args, pytest Config, collected Session or None] once prepared
def collect(config):
    from _pytest.main import Session
    session = Session.from_config(config)
    session.exitstatus = 0
    config._do_configure()
    try:
        config.hook.pytest_sessionstart(session=session)
        config.hook.pytest_collection(session=session)
        if session.testsfailed or not session.items:
            raise RuntimeError("collection errors")
        # checks that take testinfra's own `host` fixture are parametrized by the host at collection
        # (here: by no host, which testinfra makes the local machine): those collect in each fork
        if any("_testinfra_host" in getattr(i, "fixturenames", ()) for i in session.items):
            raise RuntimeError("checks parametrized by host")
    except BaseException:
        config._ensure_unconfigure()
        raise
    return session
def prepare(common):
    try:
        from _pytest.config import _prepareconfig
        os.environ["PYTEST_VERSION"] = pytest.__version__
        config = _prepareconfig(list(common), None)
        session = None
        if config.option.capture == "no":  # (capturing would take over fds 1 and 2 here, in the zygote)
            try:
                session = collect(config)
            except BaseException:
                config = _prepareconfig(list(common), None)  # a fresh one: each fork collects
        PREPARED[:] = [common, config, session]
        sys.stdout.flush()
        gc.freeze()
    except BaseException:
        PREPARED[:] = []
def run_prepared(config, options):
    from _pytest.config import UsageError
    for k, v in options.items():
        setattr(config.option, k, v)
    try:
        try:
            return int(config.hook.pytest_cmdline_main(config=config))
        finally:
            config._ensure_unconfigure()
    except UsageError as e:
        sys.stderr.write(f"ERROR: {e}\n")
        return 4
def run_collected(config, session, options):
    # the rest of pytest's wrap_session and _main, after collection
    from _pytest.main import ExitCode
    from _pytest.outcomes import Exit, Failed
    for k, v in options.items():
        setattr(config.option, k, v)
    try:
        try:
            config.hook.pytest_runtestloop(session=session)
            if session.testsfailed:
                session.exitstatus = ExitCode.TESTS_FAILED
            elif session.testscollected == 0:
                session.exitstatus = ExitCode.NO_TESTS_COLLECTED
        except Failed:
            session.exitstatus = ExitCode.TESTS_FAILED
        except (KeyboardInterrupt, Exit) as e:
            code = getattr(e, "returncode", None)
            session.exitstatus = code if code is not None else ExitCode.INTERRUPTED
            sys.stderr.write(f"{type(e).__name__}: {getattr(e, 'msg', e)}\n")
        except BaseException:
            import traceback
            traceback.print_exc()
            session.exitstatus = ExitCode.INTERNAL_ERROR
    finally:
        try:
            config.hook.pytest_sessionfinish(session=session, exitstatus=session.exitstatus)
        finally:
            config._ensure_unconfigure()
    return int(session.exitstatus)
# the protocol gets its own copy of stdout; fd 1 (pytest's terminal output) goes nowhere here
out = os.fdopen(os.dup(1), "w")
_nul = os.open(os.devnull, os.O_WRONLY)
os.dup2(_nul, 1)
os.close(_nul)
r, w = os.pipe()
os.set_blocking(w, False)
signal.signal(signal.SIGCHLD, lambda *a: None)
signal.set_wakeup_fd(w)
ids, stdin_open = {}, True
def say(line):
    out.write(line + "\n")
    out.flush()
def reap():
    while ids:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        say(f"exit {ids.pop(pid)} {os.waitstatus_to_exitcode(st)}")
buf = b""
while stdin_open or ids:
    fds = [r] + ([0] if stdin_open else [])
    try:
        ready, _, _ = select.select(fds, [], [], 1.0)
    except InterruptedError:
        ready = []
    if r in ready:
        os.read(r, 4096)
    reap()
    if 0 not in ready:
        continue
    chunk = os.read(0, 65536)
    if not chunk:
        stdin_open = False
        continue
    buf += chunk
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        req = json.loads(line)
        if "prepare" in req:
            prepare(req["prepare"])
            continue
        pid = os.fork()
        if pid == 0:
            code = 4
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(r)
                os.close(w)
                os.close(out.fileno())
                os.setsid()
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                nul = os.open(os.devnull, os.O_RDONLY)
                os.dup2(nul, 0)
                os.close(nul)
                os.chdir(req["cwd"])
                if PREPARED and req.get("common") == PREPARED[0] and req.get("options") is not None:
                    if PREPARED[2] is not None:
                        code = run_collected(PREPARED[1], PREPARED[2], req["options"])
                    else:
                        code = run_prepared(PREPARED[1], req["options"])
                else:
                    code = int(pytest.main(req["args"]))
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        ids[pid] = req["id"]
        say(f"pid {req['id']} {pid}")
"""


class PytestRunner:
    """Runs each host's pytest as a fork of one pre-imported zygote process (see ZYGOTE)."""

    def __init__(self, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(cwd)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=_python_env(),
            cwd=str(cwd),
            start_new_session=True,
        )
        self.cond = threading.Condition()
        self.pids: dict[str, int] = {}
        self.codes: dict[str, int] = {}
        self.dead = False
        self.next_id = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            parts = raw.decode(errors="replace").split()
            if len(parts) != 3:
                continue
            with self.cond:
                if parts[0] == "pid":
                    self.pids[parts[1]] = int(parts[2])
                elif parts[0] == "exit":
                    self.codes[parts[1]] = int(parts[2])
                self.cond.notify_all()
        with self.cond:
            self.dead = True
            self.cond.notify_all()

    def prepare(self, common: list[str]) -> None:
        """Have the zygote parse pytest's configuration for `common` and collect the checks, once
        for every host (see ZYGOTE)."""
        with self.cond:
            self._send({"prepare": common})

    def run(
        self, common: list[str], options: dict[str, str], log: Path, cwd: Path, timeout: float
    ) -> int | None:
        """pytest's exit code for `common` plus `options` (pytest options by name); None when it
        ran past `timeout` (then its process group is killed)."""
        args = common + option_args(options)
        if not self.dead:
            req = {"args": args, "common": common, "options": options, "log": str(log), "cwd": str(cwd)}
            code = self._run_forked(req, timeout)
            if not (code == -1 and self.dead):
                return code
        # the zygote is gone (it could not start, or died): run this host's pytest as its own
        # process rather than report a failure that is not the host's
        return _run_pytest_process(args, log, cwd, timeout)

    def _send(self, req: dict[str, Any]) -> bool:
        """Write one request line (hold self.cond); False with self.dead set when the zygote is gone."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            self.dead = True
            return False

    def _run_forked(self, req: dict[str, Any], timeout: float) -> int | None:
        """As run, through a fork of the zygote; -1 with self.dead set when the zygote is gone."""
        with self.cond:
            rid = str(self.next_id)
            self.next_id += 1
            if not self._send({"id": rid, **req}):
                return -1
            deadline = time.monotonic() + timeout
            while rid not in self.codes and not self.dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(min(left, 1.0))
            if rid in self.codes:
                return self.codes.pop(rid)
            if self.dead:
                return -1
            pid = self.pids.get(rid)
        if pid is not None:
            _kill_group(pid)
        with self.cond:
            end = time.monotonic() + 10
            while rid not in self.codes and not self.dead and time.monotonic() < end:
                self.cond.wait(0.5)
            self.codes.pop(rid, None)
        return None

    def kill(self) -> None:
        """Stop the zygote now (nothing was sent to it yet, or nothing it runs is wanted)."""
        _kill_group(self.proc.pid)
        self.close()

    def close(self) -> None:
        """Let the zygote's children finish, then wait for it to exit (idempotent)."""
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            _kill_group(self.proc.pid)
            self.proc.wait()


def run_host(
    t: Target,
    opts: AuditOptions,
    exp: dict[str, Any],
    work: Path,
    conns: Connections,
    checks_dir: Path,
    concerns: list[str],
    runner: PytestRunner | None = None,
) -> HostResult:
    start = time.monotonic()
    res = HostResult(name=t.name, fleet=t.fleet.fleet.name, status="pass")
    why = probe(t, opts, conns)
    if why is not None:
        res.status, res.message = "unreachable", why
        res.seconds = time.monotonic() - start
        return res
    hdir = work / t.fleet.fleet.name / t.name
    hdir.mkdir(parents=True, exist_ok=True)
    exp_path, res_path, log_path = hdir / "expect.json", hdir / "results.json", hdir / "pytest.log"
    atomic_write(exp_path, pretty_json(exp))
    res_path.unlink(missing_ok=True)  # (a kept workdir's last results must not stand for this run's)
    common = common_pytest_args(checks_dir, concerns)
    options = {
        **pytest_host_options(t, opts, conns),
        "builder_expect": str(exp_path),
        "builder_results": str(res_path),
    }
    if runner is not None:
        code = runner.run(common, options, log_path, checks_dir, opts.host_timeout)
    else:
        code = _run_pytest_process(common + option_args(options), log_path, checks_dir, opts.host_timeout)
    if code is None:
        res.status = "unreachable"
        res.message = f"checks did not finish within {opts.host_timeout:g} s"
        res.seconds = time.monotonic() - start
        return res
    try:
        lost, checks, collect_errors = read_results(res_path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        res.status = "error"
        res.message = f"the checks did not report (pytest exit {code}): " + (_log_hint(log_path) or type(e).__name__)
        res.seconds = time.monotonic() - start
        return res
    res.checks = checks
    problem = results_problem(code, checks, collect_errors, concerns, checks_dir, log_path)
    if lost:
        res.status, res.message = "unreachable", lost
    elif problem:
        res.status, res.message = "error", problem
    elif any(c.status == "fail" for c in checks):
        res.status = "drift"
    elif any(c.status == "error" for c in checks):
        res.status = "error"
    res.seconds = time.monotonic() - start
    return res


def _run_pytest_process(args: list[str], log_path: Path, cwd: Path, timeout: float) -> int | None:
    """One pytest process (no zygote); None when it ran past `timeout`."""
    with open(log_path, "wb") as log:
        p = subprocess.Popen(
            [sys.executable, "-m", "pytest", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_python_env(),
            cwd=str(cwd),
            start_new_session=True,
        )
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(p.pid)
            p.wait()
            return None


def run_audit(opts: AuditOptions, on_host: Callable[[HostResult], None] | None = None) -> AuditReport:
    """Validate, then audit every selected host in parallel. Raises ConfigError (exit 2) before contact."""
    if opts.mode not in MODES:
        raise ConfigError(f"--mode: expected one of {', '.join(MODES)}, got {opts.mode!r}")
    if opts.phase not in PHASES:
        raise ConfigError(f"--phase: expected one of {', '.join(PHASES)}, got {opts.phase!r}")
    if opts.backend not in BACKENDS:
        raise ConfigError(f"--backend: expected one of {', '.join(BACKENDS)}, got {opts.backend!r}")
    concerns = opts.concerns()
    if not concerns:
        raise ConfigError(f"--only selects no check for --phase {opts.phase}")
    checks_dir = (opts.checks_dir or default_checks_dir(opts.root)).resolve()
    for c in concerns:
        if not (checks_dir / f"test_{c}.py").is_file():
            raise ConfigError(f"{checks_dir}: no check module test_{c}.py")
    # The zygote's imports (~0.3 s of CPU) overlap with reading the inventory, pins and lock here
    # rather than delaying the first host's checks. It contacts no host; on a config error it is
    # killed before the error is raised.
    runner = PytestRunner(checks_dir)
    runner.prepare(common_pytest_args(checks_dir, concerns))
    try:
        return _audit(opts, concerns, checks_dir, runner, on_host)
    finally:
        runner.close()


def _audit(
    opts: AuditOptions,
    concerns: list[str],
    checks_dir: Path,
    runner: PytestRunner,
    on_host: Callable[[HostResult], None] | None,
) -> AuditReport:
    hosts_dir = opts.hosts_dir or opts.root / "hosts"
    try:
        targets = select_targets(hosts_dir, opts.names, opts.fleet)
        _check_backend(opts)
        ctx = load_context(opts, targets)
        expectations = {
            (t.fleet.fleet.name, t.name): build_expectations(t, opts, ctx, concerns) for t in targets
        }
    except BaseException:
        runner.kill()
        raise
    return _run_hosts(opts, concerns, checks_dir, runner, on_host, targets, expectations)


def _check_backend(opts: AuditOptions) -> None:
    if opts.backend == "ansible":
        if opts.inventory is None or not opts.inventory.is_file():
            raise ConfigError(
                f"--inventory: no Ansible inventory file at {opts.inventory} "
                f"(write one with `builder hosts --ansible FILE`)"
            )
        if shutil.which("ansible-inventory") is None:
            raise ConfigError(
                "--backend ansible: ansible-inventory is not installed (pip install ansible-core)"
            )


def _run_hosts(
    opts: AuditOptions,
    concerns: list[str],
    checks_dir: Path,
    runner: PytestRunner,
    on_host: Callable[[HostResult], None] | None,
    targets: list[Target],
    expectations: dict[tuple[str, str], dict[str, Any]],
) -> AuditReport:
    start = time.monotonic()
    tmp_root = opts.workdir
    cleanup: list[Path] = []
    if tmp_root is None:
        tmp_root = Path(tempfile.mkdtemp(prefix="builder-audit-"))
        cleanup.append(tmp_root)
    conns = open_connections(opts)
    if not conns.shared:
        cleanup.append(conns.folder)
    lock = threading.Lock()

    open_masters = set(range(len(targets)))

    def one(i: int) -> HostResult:
        t = targets[i]
        try:
            r = run_host(
                t,
                opts,
                expectations[(t.fleet.fleet.name, t.name)],
                tmp_root,
                conns,
                checks_dir,
                concerns,
                runner,
            )
        finally:  # the host's connection is done with: close it now (unless kept), in this host's thread
            close_master(t, opts, conns)
            open_masters.discard(i)
        if on_host is not None:
            with lock:
                on_host(r)
        return r

    try:
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(targets)))) as ex:
            results = list(ex.map(one, range(len(targets))))
    finally:  # (run_audit closes the runner)
        for i in sorted(open_masters):
            close_master(targets[i], opts, conns)
        for d in cleanup:
            shutil.rmtree(d, ignore_errors=True)
    return AuditReport(
        hosts=results, mode=opts.mode, phase=opts.phase, concerns=concerns, seconds=time.monotonic() - start
    )


# ----------------------------------------------------------------------------- reports

CELL = {"pass": "pass", "fail": "FAIL", "skip": "skip", "error": "ERROR"}


def matrix_rows(report: AuditReport) -> tuple[list[str], list[list[str]]]:
    """Checks x hosts: pass / FAIL / skip / ERROR / unreachable."""
    cols = ["check"] + [h.name for h in report.hosts]
    order: list[str] = []
    for h in report.hosts:
        for c in h.checks:
            if c.check not in order:
                order.append(c.check)
    order.sort(key=lambda cid: CONCERNS.index(cid.split("::")[0]) if cid.split("::")[0] in CONCERNS else 99)
    rows: list[list[str]] = []
    for cid in order:
        row = [cid]
        for h in report.hosts:
            if h.status == "unreachable" and not h.checks:
                row.append("unreachable")
                continue
            found = next((c for c in h.checks if c.check == cid), None)
            row.append(CELL.get(found.status, found.status) if found else "-")
        rows.append(row)
    if not order:
        rows.append(
            ["reachable"] + [("unreachable" if h.status == "unreachable" else h.status) for h in report.hosts]
        )
    return cols, rows


def junit_xml(report: AuditReport) -> bytes:
    suites = ET.Element("testsuites", name="builder audit", time=f"{report.seconds:.3f}")
    for h in report.hosts:
        s = ET.SubElement(suites, "testsuite", name=h.name, hostname=h.name, time=f"{h.seconds:.3f}")
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        cases = h.checks if h.checks else []
        if h.status in ("unreachable", "error") and not cases:
            tc = ET.SubElement(s, "testcase", classname=h.name, name="reachable")
            ET.SubElement(tc, "error", message=f"{h.status}: {h.message}", type=h.status)
            counts["tests"] += 1
            counts["errors"] += 1
        for c in cases:
            tc = ET.SubElement(s, "testcase", classname=f"{h.fleet}.{h.name}", name=c.check)
            counts["tests"] += 1
            if c.status == "fail":
                ET.SubElement(tc, "failure", message=c.message, type="drift")
                counts["failures"] += 1
            elif c.status == "error":
                ET.SubElement(tc, "error", message=c.message, type="error")
                counts["errors"] += 1
            elif c.status == "skip":
                ET.SubElement(tc, "skipped", message=c.message)
                counts["skipped"] += 1
        for k, v in counts.items():
            s.set(k, str(v))
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True) + b"\n"


def write_junit(report: AuditReport, path: Path) -> None:
    atomic_write(path, junit_xml(report))


# ----------------------------------------------------------------------------- hosts / Ansible


def host_rows(hosts_dir: Path, fleet: str | None) -> list[dict[str, Any]]:
    return [
        {
            "fleet": t.fleet.fleet.name,
            "lane": t.fleet.fleet.lane,
            "name": t.name,
            "rank": t.host.rank,
            "role": t.host.role,
            "connection": t.host.connection,
            "target": t.host.ssh,
            "address": t.host.address,
            "file": str(t.path),
        }
        for t in fleet_targets(hosts_dir, fleet)
    ]


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return json.dumps(str(v))  # a JSON string is a valid YAML double-quoted scalar


def ansible_hostvars(t: Target) -> dict[str, Any]:
    h = t.host
    v: dict[str, Any] = {}
    if h.connection == "local":
        v["ansible_connection"] = "local"
        v["ansible_host"] = "localhost"
    elif h.connection == "docker":
        v["ansible_connection"] = "docker"
        v["ansible_host"] = h.ssh
    else:
        user, hostpart, port = parse_target(h.ssh)
        v["ansible_connection"] = "ssh"
        v["ansible_host"] = hostpart
        if user:
            v["ansible_user"] = user
        if port is not None:
            v["ansible_port"] = port
        cfg = ssh_config_path(t)
        if cfg:
            v["ansible_ssh_common_args"] = f"-F {shlex.quote(str(cfg))}"
    v["rank"] = h.rank
    v["role"] = h.role
    v["builder_fleet"] = t.fleet.fleet.name
    v["builder_lane"] = t.fleet.fleet.lane
    return v


def ansible_inventory(targets: list[Target], fmt: str = "yaml") -> str:
    """An Ansible inventory (YAML or INI): one group per fleet, rank and role as host vars."""
    groups: dict[str, list[Target]] = {}
    for t in targets:
        groups.setdefault(t.fleet.fleet.name.replace("-", "_").replace(".", "_"), []).append(t)
    if fmt == "ini":
        lines = ["# generated by `builder hosts --ansible`; do not edit (edit hosts/*.toml)"]
        for g, ts in sorted(groups.items()):
            lines.append(f"[{g}]")
            for t in ts:
                kv = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in ansible_hostvars(t).items())
                lines.append(f"{t.name} {kv}")
            lines.append("")
        return "\n".join(lines)
    out = ["# generated by `builder hosts --ansible`; do not edit (edit hosts/*.toml)", "all:", "  children:"]
    for g, ts in sorted(groups.items()):
        out += [f"    {g}:", "      hosts:"]
        for t in ts:
            out.append(f"        {t.name}:")
            for k, v in ansible_hostvars(t).items():
                out.append(f"          {k}: {_yaml_scalar(v)}")
    return "\n".join(out) + "\n"


def write_ansible_inventory(hosts_dir: Path, fleet: str | None, path: Path) -> int:
    targets = fleet_targets(hosts_dir, fleet)
    if path.suffix.lower() not in (".ini", ".cfg", ".yml", ".yaml"):
        raise ConfigError(f"{path}: name the inventory *.yml, *.yaml or *.ini")
    fmt = "ini" if path.suffix.lower() in (".ini", ".cfg") else "yaml"
    atomic_write(path, ansible_inventory(targets, fmt).encode())
    return len(targets)
