"""On a host: run many fact commands at once, each bounded in time, and report every answer.

argv[1] is a JSON list of items: a shell command line (a string), or ``["py", key, source, arg]``
for a fact module (``source``: its text, run as ``python3 -I -S -c source arg`` would run it, in a
fork of this interpreter: no other python3 starts). argv[2], if given, bounds each item's seconds.
Every item runs in a child process of its own session, all started before the threads that read
them (a fork is then of a process with one thread). One that runs past its bound (a hung
nvidia-smi, a df or a stat on a stale NFS mount) is killed with its process group and answers exit
status 124 ("builder: timed out after N s" on stderr), so the host's other facts still come back. A fact module may
report progress (one byte to the descriptor in $BUILDER_PROGRESS_FD, see files.py); each report
restarts its bound, so a full-mode hash that takes minutes goes on while one stuck read is killed
N s after its last progress.

Prints JSON ``{line or key: [rc, stdout, stderr]}``, the outputs base64 (they need not be text).
The checks read most of a host's facts through one call of this (checks/checklib.py prefetch):
one remote command instead of one per fact.

Standard library only: it runs as ``python3 -I -S -c SOURCE ITEMS SECONDS`` (builder.hostfacts).
"""

from __future__ import annotations

import binascii
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import CodeType
    from typing import Any



def encode(rc: int, out: bytes, err: bytes) -> list[object]:
    b64 = binascii.b2a_base64
    return [rc, b64(out, newline=False).decode(), b64(err, newline=False).decode()]


class Child:
    """One item's process, its outputs, and (for a fact module) its progress pipe."""

    def __init__(self, item: Any, limit: float | None) -> None:
        self.limit = limit
        self.progress_r: int | None = None
        if isinstance(item, str):
            self.proc: subprocess.Popen[bytes] | Forked = subprocess.Popen(
                ["/bin/sh", "-c", item], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True,
            )
        else:
            self.progress_r, pw = os.pipe()
            compiled(item[2])  # (once, here: each fork of the same module runs it)
            try:
                self.proc = Forked(item[2], item[3], pw)
            except OSError:
                os.close(self.progress_r)
                raise
            finally:
                os.close(pw)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out_fd, self.err_fd = self.proc.stdout.fileno(), self.proc.stderr.fileno()
        self.bufs: dict[int, list[bytes]] = {self.out_fd: [], self.err_fd: []}
        self.sel = selectors.DefaultSelector()
        for fd in (self.out_fd, self.err_fd) if self.progress_r is None else (self.out_fd, self.err_fd,
                                                                                self.progress_r):
            self.sel.register(fd, selectors.EVENT_READ)

    def _outputs_open(self) -> bool:
        m = self.sel.get_map()
        return self.out_fd in m or self.err_fd in m

    def drain(self, until: float | None, restart: bool) -> tuple[bool, float | None]:
        """Read what comes until both outputs end or `until` passes: (whether they ended, until).
        With `restart`, each progress byte moves `until` to a full bound from now."""
        while self._outputs_open():
            left = None if until is None else until - time.monotonic()
            if left is not None and left <= 0:
                return False, until
            for key, _ in self.sel.select(left):
                b = os.read(key.fd, 65536)
                if not b:
                    self.sel.unregister(key.fd)
                elif key.fd == self.progress_r:
                    if restart and self.limit is not None:
                        until = time.monotonic() + self.limit
                else:
                    self.bufs[key.fd].append(b)
        return True, until

    def answer(self) -> list[object]:
        done, until = self.drain(None if self.limit is None else time.monotonic() + self.limit, True)
        rc = -1
        if done:
            try:  # both outputs closed: it is exiting (or runs on without them, within the same bound)
                rc = self.proc.wait(timeout=None if until is None else max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                done = False
        if not done:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            # what it wrote before; one that cannot die (D state) keeps the pipes
            self.drain(time.monotonic() + 5, False)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.close()
        out, err = b"".join(self.bufs[self.out_fd]), b"".join(self.bufs[self.err_fd])
        if not done:
            return encode(124, out, err + f"builder: timed out after {self.limit:g} s\n".encode())
        return encode(rc, out, err)

    def close(self) -> None:
        self.sel.close()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()
        if self.progress_r is not None:
            os.close(self.progress_r)


class Forked:
    """A fact module running in a fork of this interpreter, as ``python3 -I -S -c SOURCE ARG`` would
    run it (this interpreter is one), without another interpreter's start: its own session, stdin
    from /dev/null, its outputs to pipes, `progress_w` as $BUILDER_PROGRESS_FD. What the batch needs
    of a subprocess.Popen: pid, stdout, stderr, wait."""

    def __init__(self, source: str, arg: str, progress_w: int) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            self.pid = os.fork()
        except OSError:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            raise
        if self.pid == 0:  # (the child: never returns)
            code = 1
            try:
                os.setsid()
                null = os.open(os.devnull, os.O_RDONLY)
                for fd, to in ((null, 0), (out_w, 1), (err_w, 2), (progress_w, 3)):
                    os.dup2(fd, to)
                os.closerange(4, os.sysconf("SC_OPEN_MAX"))  # (other items' pipes among them)
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                os.environ["BUILDER_PROGRESS_FD"] = "3"
                sys.argv = ["-c", arg]
                code = run_source(source)
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        os.close(out_w)
        os.close(err_w)
        self.stdout = open(out_r, "rb", buffering=0)
        self.stderr = open(err_r, "rb", buffering=0)
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status (as Popen.wait); subprocess.TimeoutExpired when it runs past `timeout`."""
        until = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, 0 if until is None else os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif until is not None and time.monotonic() >= until:
                raise subprocess.TimeoutExpired("fact", timeout or 0)
            else:
                time.sleep(0.002)
        return self.returncode


#: each fact module's source compiled once, in this process, before the forks that run it (None:
#: it does not compile; each fork then compiles it and reports the error as ``python3 -c`` would)
COMPILED: dict[str, CodeType | None] = {}


def compiled(source: str) -> CodeType | None:
    if source not in COMPILED:
        try:
            COMPILED[source] = compile(source, "<string>", "exec")
        except (SyntaxError, ValueError):
            COMPILED[source] = None
    return COMPILED[source]


def run_source(source: str) -> int:
    """Run a module's source as __main__ (as ``python3 -c`` does): its exit status; an uncaught
    exception prints its traceback and gives 1."""
    try:
        code = COMPILED.get(source) or compile(source, "<string>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    return 0


def run_item(item: Any, limit: float | None) -> tuple[str, list[object]]:
    """(the item's key, its answer)."""
    key, child = start(item, limit)
    return key, child if isinstance(child, list) else child.answer()


def start(item: Any, limit: float | None) -> tuple[str, Child | list[object]]:
    """(the item's key, its running process, or the answer when it could not start)."""
    key = item if isinstance(item, str) else item[1]
    try:
        return key, Child(item, limit)
    except OSError as e:
        return key, encode(127, b"", str(e).encode())


def main(argv: list[str]) -> int:
    items = json.loads(argv[1])
    limit = float(argv[2]) if len(argv) > 2 else None
    answers: dict[str, list[object]] = {}

    started = [start(i, limit) for i in items]  # (every fork before the first thread)

    def put(key: str, child: Child | list[object]) -> None:
        answers[key] = child if isinstance(child, list) else child.answer()

    threads = [threading.Thread(target=put, args=kc) for kc in started]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sys.stdout.write(json.dumps(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
