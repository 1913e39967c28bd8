"""Running commands on a host over its one connection (ssh, `docker exec`, or locally), running the
installer there (install.pyz, kept on the host by its sha256), and reading its answers."""

from __future__ import annotations

import hashlib
import shlex
import subprocess
from pathlib import Path
from typing import IO, Any

from builder.errors import BuilderError, ConfigError, UnreachableError
from builder.foundation.answer import Answer
from builder.foundation.ssh import Connection, ControlSockets, with_parent
from builder.hostscripts import tied
from builder.inputs.hosts import Fleet, Host, ssh_config_file
from builder.installer.errors import EXIT_CONFIG
from builder.store.placement import kept_installer

#: the exit status of an installer command when the copy it kept does not match the sha256 sent
BAD_INSTALLER = 199


def installer_command(bundles: str, script: bytes, args: list[str]) -> str:
    """The shell command that runs ``python3 install.pyz ARGS`` on a host from this machine's copy,
    ``script``, which it reads from the head of its stdin: kept as ``kept_installer`` (written only
    when the host's copy is missing or differs, else skipped) and run only once its sha256 is the
    one sent (exit BAD_INSTALLER otherwise). ``head -c N`` reads exactly N bytes of a pipe (GNU
    coreutils and busybox both do), leaving the rest of stdin for the installer."""
    digest = hashlib.sha256(script).hexdigest()
    prog = kept_installer(bundles, digest)
    q = shlex.quote
    same = f'test "$(sha256sum < {q(prog)} 2>/dev/null | cut -c1-64)" = {digest}'
    return (
        f"umask 022 && mkdir -p {q(prog.rsplit('/', 1)[0])} || exit {BAD_INSTALLER}; "
        f"if {same}; then head -c {len(script)} > /dev/null; "
        f"else head -c {len(script)} > {q(prog + '.tmp')} && mv -f {q(prog + '.tmp')} {q(prog)}; fi; "
        f"{same} || exit {BAD_INSTALLER}; exec python3 {q(prog)} " + " ".join(q(a) for a in args)
    )


class Remote:
    """Runs shell commands on a host: over ssh, with `docker exec`, or locally (connection = local).

    Over ssh every command of one ship goes through one connection (builder.foundation.ssh), opened by the
    first command and closed by `close`: one key exchange per host, however many files are sent."""

    def __init__(
        self,
        fleet_file: Path,
        fleet: Fleet,
        host: Host,
        connect_timeout: int = 10,
        sockets: ControlSockets | None = None,
    ) -> None:
        """`fleet_file`: the inventory file `fleet` was read from (a relative ssh_config is taken
        from its folder, as the audit takes it). `sockets`: a run's control sockets shared with other
        commands of that run (``builder deploy``: its steps and audits use one connection per host);
        by default the Remote's own, removed by `close`."""
        self.host = host
        self.sockets = sockets
        self.kind = host.connection
        self.ssh_config = ssh_config_file(fleet_file, fleet.fleet.ssh_config)
        self.connect_timeout = connect_timeout
        self._ssh: Connection | None = None
        self._open = False

    def _connection(self) -> Connection:
        if self._ssh is None:
            sockets = self.sockets or ControlSockets.for_run(persist=0)
            self._ssh = Connection.to(self.host.ssh, self.ssh_config, sockets, self.connect_timeout)
        return self._ssh

    def argv(self, command: str) -> list[str]:
        """The argv of one step on the host: run through `with_parent`, it ends with this process, and the
        step on the host ends with it (builder.hostscripts.tied)."""
        command = tied(command)
        if self.kind == "local":
            return ["sh", "-c", command]
        if self.kind == "docker":
            return ["docker", "exec", "-i", self.host.ssh, "sh", "-c", command]
        return self._connection().argv(command)  # (ssh ... -- HOST COMMAND)

    def connect(self) -> None:
        """Open the host's ssh connection, if not yet open; UnreachableError when it cannot be."""
        if self.kind != "ssh" or self._open:
            return
        why = self._connection().open()
        if why is not None:
            raise UnreachableError(f"{self.host.name}: unreachable over ssh ({self.host.ssh}): {why}")
        self._open = True

    def close(self) -> None:
        """Close the host's connection (idempotent)."""
        if self._ssh is not None:
            self._ssh.close()
            if self.sockets is None:  # (shared sockets are their run's to remove)
                self._ssh.sockets.cleanup()
            self._ssh, self._open = None, False

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self, command: str, *, timeout: float, stdin: bytes | IO[bytes] | None = None, what: str = ""
    ) -> subprocess.CompletedProcess[bytes]:
        self.connect()
        argv = self.argv(command)
        kw: dict[str, Any] = (
            {"input": stdin}
            if isinstance(stdin, bytes)
            else {"stdin": stdin if stdin is not None else subprocess.DEVNULL}
        )
        try:
            proc = subprocess.run(with_parent(argv), capture_output=True, timeout=timeout, check=False, **kw)
        except subprocess.TimeoutExpired:
            raise UnreachableError(
                f"{self.host.name}: no answer within {timeout:.0f} s"
                f"{' (' + what + ')' if what else ''} over {self.kind} to {self.host.ssh}"
            ) from None
        except FileNotFoundError:
            raise ConfigError(f"{argv[0]}: not found (needed to reach {self.host.name})") from None
        if self.kind == "ssh" and proc.returncode == 255:
            last = Answer.of(proc).last_line() or "connection failed"
            raise UnreachableError(f"{self.host.name}: unreachable over ssh ({self.host.ssh}): {last}")
        return proc

    def run_installer(self, script: bytes, args: list[str], *, timeout: float, what: str) -> dict[str, Any]:
        """Run the installer ``script`` (install.pyz) on the host, kept there by its sha256 (see
        installer_command); its JSON answer, or the error it printed."""
        bundles = self.host.paths.bundles
        proc = self.run(installer_command(bundles, script, args), timeout=timeout, stdin=script, what=what)
        if proc.returncode == BAD_INSTALLER:
            raise BuilderError(bad_installer(self.host, proc.stderr))
        return installer_answer(self, proc.returncode, proc.stdout, proc.stderr, what)


def bad_installer(host: Host, stderr: bytes) -> str:
    why = Answer.from_parts(BAD_INSTALLER, b"", stderr).last_line() or "no reason given"
    return (f"{host.name}: cannot keep the installer under {host.paths.bundles}/incoming "
            f"(or the copy there does not match the one sent): {why}")


def installer_answer(remote: Remote, proc_rc: int, stdout: bytes, stderr: bytes, what: str) -> dict[str, Any]:
    """The installer's JSON answer (its last stdout line), or the error it printed (one
    reading for run_installer and ship's receive stream)."""
    name = remote.host.name
    a = Answer.from_parts(proc_rc, stdout, stderr)
    if remote.kind == "ssh" and proc_rc == 255:
        why = a.last_line() or "connection failed"
        raise UnreachableError(f"{name}: unreachable over ssh ({remote.host.ssh}): {why}")
    if proc_rc != 0:
        msg = Answer.from_parts(proc_rc, b"", stderr).error()
        if proc_rc == 127 or "python3: not found" in msg or "command not found" in msg:
            raise BuilderError(f"{name}: python3 not found on the host")
        cls = ConfigError if proc_rc == EXIT_CONFIG else BuilderError
        raise cls(f"{name}: {what}: {msg}")
    out = a.json_object()
    if out is None:
        raise BuilderError(f"{name}: {what}: unreadable answer from the installer")
    return out
