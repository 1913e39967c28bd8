"""builder.output: data on stdout, lines for people on stderr, rich only where it adds colour."""

from __future__ import annotations

import os
import subprocess
import sys


def test_lines_without_a_terminal_are_plain_text() -> None:
    code = (
        "from builder import output\n"
        "output.status('image :smile: sha256:ab [bold]x[/bold]')\n"
        "output.warn('careful')\n"
        "output.error('bad\\nsecond line')\n"
        "output.data_json({'b': 1, 'a': 2})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        "image :smile: sha256:ab [bold]x[/bold]",  # no emoji, no markup: the text as given
        "warning: careful",
        "error: bad",  # one line
    ]
    assert r.stdout == '{\n  "a": 2,\n  "b": 1\n}\n'
