"""The fleet lock: two deploys (or a deploy and a start or stop) of one fleet never interleave.

A file on the operator machine, ``<store>/deploy/<fleet>.lock``, held with flock for the whole command;
the kernel drops it when the process ends, however it ends (a SIGKILL leaves no stale lock). The file
names its holder (pid, command, since), so a refused command says who holds the fleet. The holder writes
that line just after it takes the lock and empties the file before it lets go; a command refused in
between waits (briefly) for a whole line that names a live process, so it always names the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from builder.errors import BuilderError
from builder.foundation.canon import pid_alive

#: how long a refused command waits for the holder's line (written microseconds after its lock is taken;
#: a loaded machine may take longer to schedule it)
NAME_WAIT = 5.0


def lock_path(store: Path, fleet: str) -> Path:
    return store / "deploy" / f"{fleet}.lock"


@contextlib.contextmanager
def fleet_lock(store: Path, fleet: str, what: str) -> Iterator[None]:
    """Hold the fleet's lock for the block; BuilderError (exit 1, nothing changed) when another
    command holds it."""
    path = lock_path(store, fleet)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        deadline = time.monotonic() + NAME_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                info = _holder(fd)
                if info is None and time.monotonic() < deadline:
                    time.sleep(0.01)  # the holder has the lock and is writing its line (or just let go)
                    continue
                holder = (f" (`builder {info['what']}`, pid {info['pid']}, since {info['since']})"
                          if info is not None else " (a holder that did not name itself)")
                raise BuilderError(
                    f"fleet {fleet}: another command holds {path}{holder}; a fleet's deploys, starts and stops "
                    "never interleave: wait for it, then run this again"
                ) from None
        line = json.dumps({"pid": os.getpid(), "what": what,
                           "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}).encode()
        os.pwrite(fd, line, 0)
        os.ftruncate(fd, len(line))
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # (still held: no line is left naming a holder that is gone)
    finally:
        os.close(fd)  # (releases the lock)


def _holder(fd: int) -> dict[str, Any] | None:
    """The holder's line: None until it is whole and names a live process (an empty file, a part of a
    line, or what a killed holder left)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        whole = isinstance(info, dict) and {"pid", "what", "since"} <= info.keys()
        return info if whole and pid_alive(int(info["pid"])) else None
    except (OSError, ValueError, TypeError):
        return None
