"""The fleet lock: two deploys (or a deploy and a start or stop) of one fleet never interleave.

A file on the operator machine, ``<store>/deploy/<fleet>.lock``, held with flock for the whole command;
the kernel drops it when the process ends, however it ends (a SIGKILL leaves no stale lock). The file
names its holder (pid, command, since), so a refused command says who holds the fleet.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

from builder.errors import BuilderError


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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            with contextlib.suppress(OSError, ValueError, AttributeError):
                info = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
                holder = f" (`builder {info['what']}`, pid {info['pid']}, since {info['since']})"
            raise BuilderError(
                f"fleet {fleet}: another command holds {path}{holder}; a fleet's deploys, starts and stops "
                "never interleave: wait for it, then run this again"
            ) from None
        info = {"pid": os.getpid(), "what": what, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield
    finally:
        os.close(fd)  # (releases the lock)
