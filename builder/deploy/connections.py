"""One connection per host for a whole fleet command: every step, ship and audit of it reuses the host's
one ssh ControlMaster, and the command closes them at its end."""

from __future__ import annotations

import stat
import subprocess

from builder.deploy.options import DeployOptions
from builder.foundation.ssh import ControlSockets


def command_sockets(opts: DeployOptions) -> ControlSockets:
    """One connection per host for the whole command: every step, ship and audit of it reuses the
    host's one ControlMaster in the command's folder (the user's kept folder with --ssh-persist > 0:
    kept that long after the command; else a folder of the command's own, closed and removed at the
    end, and ended by ssh itself 60 s after its last use if the command is killed)."""
    return ControlSockets.for_run(opts.ssh_persist)


def shared_view(sockets: ControlSockets) -> ControlSockets:
    """What the command's steps, ships and audits see: its sockets, as connections to reuse (and to
    open, when there is none yet), never to close: the command closes them (close_sockets)."""
    return ControlSockets(sockets.folder, True, sockets.persist or 60.0)


def close_sockets(sockets: ControlSockets) -> None:
    """Close the command's own connections (every ControlMaster in its folder) and remove the folder;
    kept ones (--ssh-persist > 0) stay for the next command."""
    if sockets.shared:
        return
    try:
        entries = list(sockets.folder.iterdir())
    except OSError:
        entries = []
    procs = []
    for p in entries:  # (every host's at once)
        try:
            if stat.S_ISSOCK(p.lstat().st_mode):
                procs.append(subprocess.Popen(
                    ["ssh", "-o", f"ControlPath={p}", "-O", "exit", "--", "builder-control"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                ))
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    sockets.cleanup()
