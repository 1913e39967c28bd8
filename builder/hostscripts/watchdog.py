"""Run on the host: one step of a command (``sh -c STEP``) that ends once nobody reads its output.

``python3 -I -S -c SOURCE STEP`` (builder.hostscripts.tied). The step runs in a session of its own;
this process polls its own stdout and stderr (events 0: only POLLERR/POLLHUP, the reader gone: the
ssh channel closed because its client died; sshd signals a command only when it has a pty) and the
step (a pidfd, else every 50 ms). Reader gone: TERM the step's process group, KILL it 3 s later, exit
255. Otherwise its exit status is the step's (128 + N for a step killed by signal N).

It runs for every remote step, so it starts as little as it can: the standard library's os, select,
signal and time, no subprocess (os.fork and exec: this process has no other thread).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time


def _clear_parent_death_signal() -> None:
    # a local step (`sh -c`, no ssh) inherits the parent-death signal of builder's child (with_parent):
    # this process must outlive the command, to end the step
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG, none
    except Exception:
        pass


def _start(step: str) -> int:
    pid = os.fork()
    if pid == 0:  # the step: a session of its own, the signals Python ignores back to their defaults
        try:
            os.setsid()
            for name in ("SIGPIPE", "SIGXFSZ"):
                if hasattr(signal, name):
                    signal.signal(getattr(signal, name), signal.SIG_DFL)
            os.closerange(3, 65536)
            os.execvp("sh", ["sh", "-c", step])
        finally:
            os._exit(127)
    return pid


def _status(wait_status: int) -> int:
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def _end(pid: int) -> int:
    """TERM the step's group, KILL it 3 s later; 255."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pid, sig)
        except OSError:
            pass
        deadline = time.time() + grace
        while grace and time.time() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return 255
            time.sleep(0.05)
    return 255


def main(argv: list[str]) -> int:
    _clear_parent_death_signal()
    pid = _start(argv[0])
    poller = select.poll()
    poller.register(1, 0)
    poller.register(2, 0)
    timeout_ms = 50
    try:
        poller.register(os.pidfd_open(pid), select.POLLIN)  # (Linux 5.3, Python 3.9)
        timeout_ms = -1
    except Exception:
        pass
    while True:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return _status(wait_status)
        if [fd for fd, _ in poller.poll(timeout_ms) if fd in (1, 2)]:
            return _end(pid)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
