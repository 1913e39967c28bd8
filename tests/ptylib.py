"""A command with its stderr on a pseudo-terminal, as an operator at a terminal runs it (the progress
tests and the progress benchmark)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
from pathlib import Path


def run_on_pty(argv: list[str], cwd: Path | None = None) -> tuple[int, str, bytes]:
    """Run argv with stderr on a pseudo-terminal and stdout on a pipe: (exit code, stdout, the bytes
    drawn on the terminal)."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    env["TERM"] = "xterm-256color"
    p = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    assert p.stdout is not None
    # both outputs at once: a child blocked on a full stdout pipe would never close the terminal
    reading, out, seen = [master, p.stdout.fileno()], b"", b""
    while reading:
        ready, _, _ = select.select(reading, [], [], 0.2)
        for fd in ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # (the terminal's end once the child is gone: EIO)
                chunk = b""
            if not chunk:
                reading.remove(fd)
            elif fd == master:
                seen += chunk
            else:
                out += chunk
        if not ready and p.poll() is not None:
            break
    p.stdout.close()
    p.wait(timeout=60)
    os.close(master)
    return p.returncode, out.decode(), seen
