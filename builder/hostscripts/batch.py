"""On a host: run many fact commands at once, each bounded in time, and report every answer.

argv[1] is a JSON list of items: a shell command line (a string), or ``["py", key, source, arg]``
for a fact module (``source``: its text, run as ``python3 -I -S -c source arg`` by this python3).
argv[2], if given, bounds each item's seconds. Every item runs in a child process of its own
session. One that runs past its bound (a hung
nvidia-smi, a df or a stat on a stale NFS mount) is killed with its process group and answers exit
status 124 ("builder: timed out after N s" on stderr), so the host's other facts still come back. A fact module may
report progress (one byte to the descriptor in $BUILDER_PROGRESS_FD, see filefacts.py); each report
restarts its bound, so a full-mode hash that takes minutes goes on while one stuck read is killed
N s after its last progress.

Prints JSON ``{line or key: [rc, stdout, stderr]}``, the outputs base64 (they need not be text).
The checks read most of a host's facts through one call of this (checks/checklib.py prefetch):
one remote command instead of one per fact.

Standard library only: it runs as ``python3 -I -S -c SOURCE ITEMS SECONDS`` (builder.hostscripts).
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
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                ["/bin/sh", "-c", item], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True,
            )
        else:
            self.progress_r, pw = os.pipe()
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", item[2], item[3]], stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, pass_fds=(pw,),
                    env={**os.environ, "BUILDER_PROGRESS_FD": str(pw)},
                )
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

    started = [start(i, limit) for i in items]

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
