"""A command with its stderr on a pseudo-terminal, as an operator at a terminal runs it (the progress
tests and the progress benchmark)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
from pathlib import Path


def run_on_pty(argv: list[str], cwd: Path | None = None, *, columns: int | None = None,
               env: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """Run argv with stderr on a pseudo-terminal and stdout on a pipe: (exit code, stdout, the bytes
    drawn on the terminal). ``columns``: the terminal's width (its size as a terminal reports it);
    ``env``: the environment (default: this process's)."""
    master, slave = pty.openpty()
    if columns is not None:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in ("NO_COLOR", "TERM", "COLUMNS")}
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


def screen_lines(drawn: bytes) -> list[str]:
    """Every line the terminal was given, as text: escape sequences out, split at each carriage return
    and line feed (what one redraw of a bar writes is one of them)."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07", "", drawn.decode("utf-8", "replace"))
    return [ln for ln in re.split(r"[\r\n]", text) if ln.strip()]
