"""All terminal output goes through here.

Data goes to stdout (JSON with --json); status, progress and tables for people go to
stderr through rich. Colour is off when stderr is not a terminal or NO_COLOR is set.
rich is imported lazily so `builder --help` stays fast.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

_console: Console | None = None


def color_enabled() -> bool:
    return "NO_COLOR" not in os.environ and sys.stderr.isatty()


def console() -> Console:
    """The stderr console (created on first use)."""
    global _console
    if _console is None:
        from rich.console import Console

        _console = Console(
            stderr=True,
            no_color=not color_enabled(),
            highlight=False,
            force_terminal=None if color_enabled() else False,
            soft_wrap=True,
        )
    return _console


def reset() -> None:
    """Forget the console (tests swap stderr)."""
    global _console
    _console = None


def _plain(line: str) -> None:
    # Without colour a line is just its text: rich (~60 ms to import) is not needed for it.
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def status(message: str) -> None:
    """A status line for people, on stderr."""
    if color_enabled():
        console().print(message, markup=False, emoji=False)
    else:
        _plain(message)


def warn(message: str) -> None:
    if color_enabled():
        console().print(f"warning: {message}", markup=False, emoji=False, style="yellow")
    else:
        _plain(f"warning: {message}")


def error(message: str) -> None:
    """One line, no traceback."""
    first = message.splitlines()[0] if message else "error"
    if color_enabled():
        console().print(f"error: {first}", markup=False, emoji=False, style="bold red")
    else:
        _plain(f"error: {first}")


def data(text: str) -> None:
    """Data for scripts, on stdout."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()


def data_json(obj: Any) -> None:
    data(json.dumps(obj, indent=2, sort_keys=True, default=str))


def table(title: str | None, columns: list[str], rows: list[list[str]]) -> None:
    """A table for people, on stderr."""
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    console().print(t)


def progress() -> Any:
    """A rich Progress on stderr (transient; silent when not a terminal)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console(),
        transient=True,
        disable=not sys.stderr.isatty(),
    )
