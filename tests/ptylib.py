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
    seen = b""
    while True:
        r, _, _ = select.select([master], [], [], 0.2)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        elif p.poll() is not None:
            break
    out = p.stdout.read().decode() if p.stdout else ""
    p.wait(timeout=60)
    os.close(master)
    return p.returncode, out, seen
