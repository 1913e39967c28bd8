"""All terminal output goes through here.

Data goes to stdout: plain lines, tables, JSON with --json. Status, warnings, errors and progress
go to stderr through rich. Colour is off on a stream that is not a terminal, or when NO_COLOR is set.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# rich is imported where it draws: colour, a table or bars. Most runs (a script's, --json's, a pipe's)
# print plain lines only, and rich's import is most of what a command's start-up would otherwise cost
# before its stage's own.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Column

_console: Console | None = None


def color_enabled() -> bool:
    return "NO_COLOR" not in os.environ and sys.stderr.isatty()


def console() -> Console:
    """The stderr console (created on first use)."""
    from rich.console import Console

    global _console
    if _console is None:
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
    # Without colour a line is just its text, written as given: no markup, wrapping or highlighting.
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def status(message: str) -> None:
    """A status line for people, on stderr. It has no style, so even in colour it is its plain text.
    (While bars are drawn, rich's live display has sys.stderr, and prints the line above them.)"""
    _plain(message)


def detail(line: str) -> None:
    """A step's detail under its status line (indented, dim in colour), on stderr."""
    if color_enabled():
        console().print(f"  {line}", markup=False, emoji=False, style="dim")
    else:
        _plain(f"  {line}")


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
    """A table of data, on stdout (a command given --json prints its JSON instead)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    # a console of its own for each table: stdout's colour is stdout's (a pipe gets plain text), and a
    # test that swaps sys.stdout gets the table
    color = "NO_COLOR" not in os.environ and sys.stdout.isatty()
    Console(file=sys.stdout, no_color=not color, highlight=False, force_terminal=None if color else False,
            soft_wrap=False).print(t)
    sys.stdout.flush()


class _Quiet:
    """What progress() gives when stderr is not a terminal: the same calls, no output, no rich."""

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> int:
        return 0

    def update(self, task: int, **fields: Any) -> None:
        return None

    def advance(self, task: int, advance: float = 1) -> None:
        return None

    def reset(self, task: int, **fields: Any) -> None:
        return None


def progress_enabled() -> bool:
    """Progress bars are drawn only on a terminal (and never into a pipe, a file or --json's output)."""
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


#: seconds a job runs before its progress is drawn: a shorter one shows none, and the bars (rich's
#: import and its refresh thread) cost a job that needs them under 2 % of its time
PROGRESS_DELAY = 3.0
#: how often drawn bars are redrawn
REFRESH_PER_SECOND = 4


def fit(text: str, width: int) -> str:
    """A label (``verb name [+k]``: ``get tiny/model-00001-of-00004.safetensors +3``) cut to ``width``
    columns keeping what tells the work apart: the verb, how many more run beside it, and of the name
    its last part (the file, not its folder), cut in its middle when still too long (its start, where a
    shard's number is, and its end)."""
    if len(text) <= width:
        return text
    verb, sep, rest = text.partition(" ")
    if not sep or len(verb) + 6 > width:
        verb, sep, rest = "", "", text
    more = re.search(r" \+\d+$", rest)
    suffix = more.group(0) if more else ""
    name = rest[: len(rest) - len(suffix)]
    room = width - len(verb) - len(sep) - len(suffix)
    if room < 4:
        return (verb + sep + name)[: width - 1] + "\u2026"
    if len(name) > room and len(name.rsplit("/", 1)[-1]) < room:  # the file's name whole, what room is left
        name = "\u2026" + name[len(name) - room + 1:]
    elif len(name) > room:
        name = name.rsplit("/", 1)[-1]
    if len(name) > room:
        keep = room - 1
        name = name[: keep - keep // 3] + "\u2026" + name[len(name) - keep // 3:]
    return verb + sep + name + suffix


#: the columns of the bytes a drawn bar shows after its label and bar: done/total, rate, time left
#: (rich's widest renderings: "999.9/999.9 MB", "999.9 MB/s", "0:00:00"), one space between columns
BYTES_COLUMNS = (14, 10, 7)
ITEMS_COLUMNS = (7,)


def _columns(unit: str, width: int) -> tuple[Any, ...]:
    """rich columns that keep one bar on one line of a terminal ``width`` columns wide (at 80: a label
    of 30 columns, a bar of 14, then bytes, rate and time left)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        ProgressColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.table import Column
    from rich.text import Text

    class Label(ProgressColumn):
        def __init__(self, cols: int) -> None:
            super().__init__(table_column=Column(width=cols, no_wrap=True, overflow="crop"))
            self.cols = cols

        def render(self, task: Any) -> Text:
            return Text(fit(str(task.description), self.cols))

    def fixed(cols: int) -> Column:
        return Column(width=cols, no_wrap=True, justify="right", overflow="crop")

    usable = max(40, min(width, 240) - 1)  # (the last column left free: no terminal wraps there)
    tail = BYTES_COLUMNS if unit == "bytes" else ITEMS_COLUMNS
    room = usable - sum(tail) - len(tail) - 2  # a space before each tail column, and around the bar
    bar = max(10, min(40, room // 3))
    label = max(8, room - bar)
    after: tuple[Any, ...] = (
        (DownloadColumn(table_column=fixed(BYTES_COLUMNS[0])),
         TransferSpeedColumn(table_column=fixed(BYTES_COLUMNS[1])),
         TimeRemainingColumn(table_column=fixed(BYTES_COLUMNS[2])))
        if unit == "bytes"
        # a job counted in items (hosts) has no byte rate to show, only how long each one has run
        else (TimeElapsedColumn(table_column=fixed(ITEMS_COLUMNS[0])),)
    )
    return (Label(label), BarColumn(bar_width=bar), *after)


class _Deferred:
    """progress() on a terminal: tasks are kept here and drawn by a rich Progress only once the job
    has run PROGRESS_DELAY seconds (then every call is passed on to it)."""

    def __init__(self, delay: float, unit: str = "bytes") -> None:
        self._unit = unit
        self._lock = threading.Lock()
        self._tasks: list[dict[str, Any]] = []
        self._rich: Any = None
        self._rich_ids: list[Any] = []
        self._closed = False
        self._timer = threading.Timer(delay, self._start)
        self._timer.daemon = True

    def __enter__(self) -> _Deferred:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        with self._lock:
            self._closed = True
            if self._rich is not None:
                self._rich.stop()

    def _start(self) -> None:
        from rich.progress import Progress

        with self._lock:
            if self._closed:
                return

            bar = Progress(
                *_columns(self._unit, console().width),
                console=console(),
                transient=True,
                # rich redraws from a thread of its own; 4 a second (its default is 10) is smooth to
                # read and takes less of the cores from the job the bars follow
                refresh_per_second=REFRESH_PER_SECOND,
            )
            for t in self._tasks:
                self._rich_ids.append(bar.add_task(t["description"], total=t["total"], completed=t["completed"],
                                                   visible=t["visible"]))
            bar.start()
            self._rich = bar

    def add_task(self, description: str, total: float | None = None, visible: bool = True, **_: Any) -> int:
        with self._lock:
            self._tasks.append({"description": description, "total": total, "completed": 0, "visible": visible})
            if self._rich is not None:
                self._rich_ids.append(self._rich.add_task(description, total=total, visible=visible))
            return len(self._tasks) - 1

    def update(self, task: int, **fields: Any) -> None:
        with self._lock:
            t = self._tasks[task]
            for k in ("description", "total", "visible"):
                if k in fields:
                    t[k] = fields[k]
            if "advance" in fields:
                t["completed"] += fields["advance"]
            if self._rich is not None:
                self._rich.update(self._rich_ids[task], **fields)

    def advance(self, task: int, advance: float = 1) -> None:
        with self._lock:
            self._tasks[task]["completed"] += advance
            if self._rich is not None:
                self._rich.advance(self._rich_ids[task], advance)

    def reset(self, task: int, **fields: Any) -> None:
        with self._lock:
            t = self._tasks[task]
            t["completed"] = 0
            for k in ("description", "total", "visible"):
                if k in fields:
                    t[k] = fields[k]
            if self._rich is not None:
                self._rich.reset(self._rich_ids[task], **fields)


def progress(delay: float = PROGRESS_DELAY, unit: str = "bytes") -> Any:
    """The one progress display of builder: rich bars on stderr with bytes, rate and time left
    (``unit="items"``: a bar and the time each task has run, for work counted in hosts), transient,
    drawn once the job has run ``delay`` seconds. Off a terminal it is a silent
    stand-in that does not import rich, so a script's stderr and --json's stdout never see a bar.
    Its methods (add_task, update, advance, reset: rich's) may be called from any thread."""
    if not progress_enabled():
        return _Quiet()
    return _Deferred(delay, unit)


def byte_counter(bar: Any, description: str, total: int) -> Callable[[int], None]:
    """A new task on bar and the callback that advances it by a number of bytes."""
    task = bar.add_task(description, total=total)

    def advance(n: int) -> None:
        bar.advance(task, n)

    return advance


class InFlight:
    """One task of a bar whose label names the work in flight, not the work done: the oldest job still
    running, and how many more run beside it (``get tiny/model.safetensors +3``); ``idle`` while none
    runs. Advanced by bytes, from any thread."""

    def __init__(self, bar: Any, idle: str, total: int | None) -> None:
        self._bar = bar
        self._idle = idle
        self._task = bar.add_task(idle, total=total)
        self._lock = threading.Lock()
        self._jobs: dict[int, str] = {}
        self._next = 0

    def _label(self) -> str:
        if not self._jobs:
            return self._idle
        first = next(iter(self._jobs.values()))
        more = len(self._jobs) - 1
        return first + (f" +{more}" if more else "")

    def start(self, label: str) -> int:
        """A job begins; returns its key for finish()."""
        with self._lock:
            key = self._next
            self._next += 1
            self._jobs[key] = label
            text = self._label()
        self._bar.update(self._task, description=text)
        return key

    def finish(self, key: int) -> None:
        with self._lock:
            self._jobs.pop(key, None)
            text = self._label()
        self._bar.update(self._task, description=text)

    def advance(self, n: int) -> None:
        if n:
            self._bar.advance(self._task, n)
