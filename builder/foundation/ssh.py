"""One way to reach a host over ssh, for audit and ship alike: the target, the argv, the connection.

A target (the inventory's ``Host.ssh``) is ``[user@]host[:port]``, ``[user@][v6addr]:port`` (or
``[v6addr]``, or a bare IPv6 address without a port), or an ssh_config alias. Its characters are kept
narrow on purpose: the target goes into ssh's argv, into testinfra's ``ssh://`` host URL (where
``? # / % ,`` and a ``:`` in the user would change its meaning: query options, a second host, a
password for sshpass) and into the Ansible inventory; a leading ``-`` would be read by ssh as an
option wherever a tool puts the host after its own options without ``--``. Every argv built here
ends ssh's options with ``--`` before the host.

Every command to a host within one run goes through one connection (an OpenSSH ControlMaster):
one key exchange and login per host per run. Keeping connections open across runs, so the next
run skips that too, is opt-in (``persist`` > 0: the audit's ``--ssh-persist``); their control
sockets then live in a folder only the user can reach (see SECURITY.md). Otherwise each run's
sockets live in a folder of that run's own, removed at its end. Host keys are checked as the
fleet's ssh_config says; nothing here switches that off.
"""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from builder.foundation.answer import Answer
from builder.foundation.canon import remove_dead_runs

# ----------------------------------------------------------------------------- targets

#: a user, a host name or an ssh_config alias: letters, digits, '.', '_' and '-', not '-' or '.' first
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}")
_BRACKETED = re.compile(r"\[([^\[\]]*)\](?::(.*))?")


class SshTarget(NamedTuple):
    user: str | None
    #: a host name, an ssh_config alias, or an IP address (IPv6 without its brackets)
    host: str
    port: int | None

    def url_host(self) -> str:
        """The host as it goes into a URL (testinfra's ``ssh://``): IPv6 in brackets."""
        return f"[{self.host}]" if ":" in self.host else self.host

    def destination(self) -> list[str]:
        """What goes after ssh's other options: user and port as options, then ``--`` and the
        host, so nothing after the options is ever read as one."""
        out: list[str] = []
        if self.user:
            out += ["-l", self.user]
        if self.port is not None:
            out += ["-p", str(self.port)]
        return [*out, "--", self.host]


def _port(target: str, text: str) -> int:
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{target!r}: bad port {text!r} (a number 1-65535)")
    return int(text)


def _ipv6(target: str, text: str) -> str:
    if "%" in text:
        raise ValueError(f"{target!r}: an IPv6 zone (%...) is not supported; name the host in ssh_config")
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        raise ValueError(f"{target!r}: not an IPv6 address: {text!r}") from None
    return text


def parse_target(target: str) -> SshTarget:
    """'[user@]host[:port]', '[user@][v6]:port', a bare IPv6 address or an alias -> (user, host, port).
    ValueError (one line) for anything else: a leading '-', whitespace, control characters, an empty
    user or host, a bad port, characters outside [A-Za-z0-9._-] in a user or host name."""
    if not target:
        raise ValueError("empty ssh target")
    if target.startswith("-"):
        raise ValueError(f"{target!r}: must not start with '-' (ssh would take it for an option)")
    for c in target:
        if c.isspace():
            raise ValueError(f"{target!r}: whitespace in an ssh target")
        if not c.isprintable():
            raise ValueError(f"{target!r}: control character {c!r} in an ssh target")
    user: str | None
    user, at, rest = target.rpartition("@")
    if not at:
        user = None
    elif not user:
        raise ValueError(f"{target!r}: empty user before '@'")
    elif not _NAME.fullmatch(user):
        raise ValueError(f"{target!r}: user {user!r}: only letters, digits, '.', '_' and '-' (not first)")
    if not rest:
        raise ValueError(f"{target!r}: empty host")
    port: int | None = None
    if rest.startswith("["):
        m = _BRACKETED.fullmatch(rest)
        if m is None:
            raise ValueError(f"{target!r}: an IPv6 address is written [ADDRESS] or [ADDRESS]:PORT")
        host = _ipv6(target, m.group(1))
        if m.group(2) is not None:
            port = _port(target, m.group(2))
        return SshTarget(user, host, port)
    if rest.count(":") > 1:  # a bare IPv6 address (no port: that needs the brackets)
        try:
            return SshTarget(user, _ipv6(target, rest), None)
        except ValueError:
            raise ValueError(f"{target!r}: not an IPv6 address; with a port write [ADDRESS]:PORT") from None
    host, colon, port_text = rest.partition(":")
    if colon:
        port = _port(target, port_text)
    if not host:
        raise ValueError(f"{target!r}: empty host")
    if not _NAME.fullmatch(host):
        raise ValueError(
            f"{target!r}: host {host!r}: a host name, IP address or ssh_config alias of letters, digits, "
            "'.', '_' and '-' (not first)"
        )
    return SshTarget(user, host, port)


def ssh_options(connect_timeout: float, control_path: str, persist: float) -> list[str]:
    """The options of every ssh builder runs: no prompts, a bounded connect, keep-alives, and the
    host's one connection (ControlMaster) at `control_path`, open `persist` seconds after its last
    use (0: closed by the run itself; ControlPersist then still ends it if the run is killed)."""
    return [
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={max(1, int(connect_timeout))}",
        "-o",
        "ControlMaster=auto",
        "-o",
        f"ControlPath={control_path}",
        "-o",
        f"ControlPersist={max(1, int(persist)) if persist > 0 else 120}s",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
    ]


# ----------------------------------------------------------------------------- where connections live


def control_folder() -> Path:
    """Where kept connections' control sockets live: $BUILDER_SSH_DIR, else
    $XDG_RUNTIME_DIR/builder-ssh, else /tmp/builder-ssh-UID (unix socket paths are short)."""
    if os.environ.get("BUILDER_SSH_DIR"):
        return Path(os.environ["BUILDER_SSH_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "builder-ssh"
    return Path(f"/tmp/builder-ssh-{os.geteuid()}")


def private_folder(path: Path) -> bool:
    """Make `path` (mode 0700) or accept it as it is: a real folder, ours, closed to others.
    Anyone who can reach a control socket can run commands on its host as the ssh user."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


#: room a control socket's name needs in a unix socket path (108 bytes, 104 on some systems): its
#: hash name and ssh's own temporary suffix while it binds
_SOCKET_NAME = 48
_SOCKET_PATH_MAX = 104


#: a run's own socket folder: in the shared one, else (a path too long for a socket) in /tmp
_RUN_PREFIX, _SHORT_PREFIX = "run-", "bA-"


def _room(folder: Path) -> bool:
    return len(str(folder)) + 1 + _SOCKET_NAME < _SOCKET_PATH_MAX


@dataclass
class ControlSockets:
    """The folder of one run's control sockets: the user's shared folder when connections are kept
    for later runs, else a folder of the run's own (inside the shared one when that is usable, so
    the sockets stay where the user looks for them), removed by `cleanup`."""

    folder: Path
    #: whether the sockets are shared with later runs (kept)
    shared: bool
    persist: float

    @classmethod
    def for_run(cls, persist: float, control_dir: Path | None = None) -> ControlSockets:
        base = control_dir or control_folder()
        usable = _room(base) and private_folder(base)
        if persist > 0 and usable:
            return cls(base, True, persist)
        # (named with the pid: the folders a killed run left are removed by the next run, canon.run_folder)
        if usable:
            remove_dead_runs(_RUN_PREFIX, base)
            own = Path(tempfile.mkdtemp(prefix=f"{_RUN_PREFIX}{os.getpid()}-", dir=base))
            if _room(own):
                return cls(own, False, 0)
            own.rmdir()
        remove_dead_runs(_SHORT_PREFIX, Path("/tmp"))
        return cls(Path(tempfile.mkdtemp(prefix=f"{_SHORT_PREFIX}{os.getpid()}-", dir="/tmp")), False, 0)

    def path(self, config: Path | None, target: str) -> str:
        """A host's ControlPath: a hash of the fleet's ssh_config and the host's ssh target, so a
        fleet with other keys or options gets a connection of its own, and whether a connection may
        be open shows in the file alone (no ssh process to ask)."""
        key = f"{config or ''}\0{target}"
        return f"{self.folder}/{hashlib.sha256(key.encode()).hexdigest()[:24]}"

    def cleanup(self) -> None:
        """Remove a run's own folder (its connections are closed by then)."""
        if not self.shared:
            shutil.rmtree(self.folder, ignore_errors=True)


# ----------------------------------------------------------------------------- children end with the command
#
# A command's steps on a host must not outlive it (a `builder deploy` killed alone, SIGKILL, its process
# group left alone). Two halves: here, every child that runs a remote step gets the parent-death signal
# (`with_parent`: SIGKILL once the thread that started it is gone); on the host, the step runs under
# `tied` (builder.hostscripts.tied, builder/hostscripts/watchdog.py): a watchdog that ends the step's
# process group once its stdout or stderr has no reader left (the ssh channel closed: its client died;
# sshd signals a command only when it has a pty, and ssh -tt is not wanted here). What a step already did
# stays done (a `docker run` that returned started its container); what it had not begun never begins.

#: the local half: set the parent-death signal, check the parent did not die before it was set, then
#: become the command (the signal survives exec). A small program of its own rather than a preexec_fn:
#: code run between fork and exec in a program with threads may deadlock (a lock another thread held at
#: the fork, dlopen's among them), and this program has none.
_WITH_PARENT = (
    "import os,sys\n"
    "try:\n import ctypes;ctypes.CDLL(None).prctl(1,9,0,0,0)\n"  # PR_SET_PDEATHSIG, SIGKILL
    "except Exception:pass\n"
    "if os.getppid()!=int(sys.argv[1]):os._exit(137)\n"  # (the parent is gone already: as if killed with it)
    "os.execvp(sys.argv[2],sys.argv[2:])\n"
)


def with_parent(argv: list[str]) -> list[str]:
    """argv run so that it gets SIGKILL when the thread that started it ends (Linux; elsewhere argv as it
    is). Its own children do not inherit that: a ControlMaster that ssh forks keeps living, as it should
    (it ends by itself once unused). A program that is not there is left for the caller's run to find
    (FileNotFoundError, as without this)."""
    if not sys.platform.startswith("linux") or shutil.which(argv[0]) is None:
        return argv
    return [sys.executable, "-I", "-S", "-c", _WITH_PARENT, str(os.getpid()), *argv]


def run_bounded(argv: list[str], limit: float) -> subprocess.CompletedProcess[str] | None:
    """Run argv (its own session, no stdin, ended with this process); None when it ran past `limit`
    seconds."""
    try:
        return subprocess.run(
            with_parent(argv), capture_output=True, text=True, timeout=limit, stdin=subprocess.DEVNULL,
            check=False, start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return None


def why_not(argv: list[str], limit: float) -> str | None:
    """Run argv bounded (as run_bounded): None when it exits 0 in time; otherwise why not, one line (the
    last line it printed, else its exit status)."""
    tool = argv[0]
    try:
        p = run_bounded(argv, limit)
    except FileNotFoundError:
        return f"{tool}: not found on this machine"
    if p is None:
        return f"no answer within {limit:g} s"
    if p.returncode == 0:
        return None
    a = Answer.of(p)
    return a.error(()) if (a.stderr + a.stdout).strip() else f"{tool} exit status {p.returncode}"


# ----------------------------------------------------------------------------- one host's connection


@dataclass
class Connection:
    """One host's ssh within a run: every argv shares its ControlMaster."""

    target: SshTarget
    #: the ssh target as the inventory wrote it (part of the socket's name)
    spec: str
    config: Path | None
    sockets: ControlSockets
    connect_timeout: float

    @classmethod
    def to(cls, spec: str, config: Path | None, sockets: ControlSockets, connect_timeout: float) -> Connection:
        return cls(parse_target(spec), spec, config, sockets, connect_timeout)

    @property
    def control_path(self) -> str:
        return self.sockets.path(self.config, self.spec)

    def options(self) -> list[str]:
        """Every option before the destination: the fleet's ssh_config and ssh_options."""
        cfg = ["-F", str(self.config)] if self.config else []
        return cfg + ssh_options(self.connect_timeout, self.control_path, self.sockets.persist)

    def argv(self, *command: str, extra: tuple[str, ...] = ()) -> list[str]:
        """``ssh OPTIONS EXTRA [-l USER] [-p PORT] -- HOST [COMMAND]``."""
        dest = self.target.destination()
        return ["ssh", *self.options(), *dest[:-2], *extra, *dest[-2:], *command]

    def open(self) -> str | None:
        """Make sure the host's connection is open: reuse a kept one the host still answers on, or
        open one (-f -N: authenticated, then in the background with no remote command). None when
        it is open; otherwise why not (one line). Bounded by the connect timeout."""
        if self.reuse():
            return None
        with self._opening():
            # another run may have opened it while this one waited for the lock
            return None if self.reuse() else self._open()

    def reuse(self) -> bool:
        """Whether a kept connection to the host is open and the host still answers on it: one
        `true` through it, within the connect timeout, as a new connection must answer within it
        (ConnectTimeout). The `true` is two round trips and no key exchange, so the bound leaves it
        no more room than a new connection's first answer. A connection that is open but gets no
        answer in time (the host went away without closing it, or the link got slow) is closed
        here, so a new one is tried and says why the host is unreachable."""
        if not self.sockets.shared or not os.path.exists(self.control_path):
            return False
        try:
            alive = run_bounded(self.argv("true"), max(1.0, self.connect_timeout))
        except OSError:  # no ssh here: opening says so
            return False
        if alive is not None and alive.returncode == 0:
            return True
        self.close(force=True)
        return False

    @contextmanager
    def _opening(self) -> Iterator[None]:
        """Hold the host's lock in a shared folder while its connection is opened: two runs that
        open the same host at once would otherwise both connect, and the one whose control socket
        lost the race would stay in the background as a connection nobody uses or closes. The
        holder is bounded (reuse, then open), so a waiter that waited that long goes on without it."""
        if not self.sockets.shared:
            yield
            return
        fd = os.open(self.control_path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            deadline = time.monotonic() + 2 * (self.connect_timeout + 5) + 10
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

    def _open(self) -> str | None:
        return why_not(self.argv(extra=("-f", "-N")), self.connect_timeout + 5)

    def close(self, force: bool = False) -> None:
        """Close the host's connection, unless it is kept for later runs (force: close it anyway)."""
        if (self.sockets.shared and not force) or not os.path.exists(self.control_path):
            return
        try:
            subprocess.run(self.argv(extra=("-O", "exit")), capture_output=True, timeout=10,
                           stdin=subprocess.DEVNULL, check=False)
        except (subprocess.TimeoutExpired, OSError):
            pass
