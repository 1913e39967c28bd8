"""The one runner of the real CLI: `python3 -m builder ARGS` in a child process, as a user runs it, with
an environment that keeps its output plain (no colour, wide lines) and away from the user's git config,
and this checkout's builder first on the path.

    p = clirun.run("lock", "--offline", cwd=root, pins=root / "pins.toml")
    p = clirun.run("deploy", "--fleet", name, cwd=root, env=clirun.environment({"BUILDER_STORE": ...}), check=True)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARGV = (sys.executable, "-m", "builder")
#: the command operators type (pip install -e . puts it beside the interpreter): the journeys run it
SCRIPT = shutil.which("builder", path=str(Path(sys.executable).parent)) or shutil.which("builder") or "builder"
#: what every run of the CLI gets: plain output whatever the terminal, and no user or system git config
PLAIN = {"NO_COLOR": "1", "COLUMNS": "250", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def environment(extra: Mapping[str, str | None] | None = None, *, base: Mapping[str, str] | None = None,
        drop: tuple[str, ...] = ()) -> dict[str, str]:
    """``base`` (this process's environment when None) less the variables whose names start with one of
    ``drop``, with PLAIN and this checkout on PYTHONPATH, then ``extra`` (a None value unsets)."""
    e = {k: v for k, v in (os.environ if base is None else base).items() if not (drop and k.startswith(drop))}
    e.update(PLAIN)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), e.get("PYTHONPATH", "")) if p)
    for k, v in (extra or {}).items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    return e


def run(*args: str, cwd: Path | None = None, pins: Path | None = None, store: Path | None = None,
        env: Mapping[str, str] | None = None, check: bool = False, timeout: float = 600,
        argv0: tuple[str, ...] = ARGV) -> subprocess.CompletedProcess[str]:
    """`python3 -m builder [--pins PINS] [--store STORE] ARGS` in ``cwd``, its output captured as text
    (``argv0``: (SCRIPT,) runs the installed command instead). ``env`` is the whole environment
    (environment() when None). ``check``: a non-zero exit raises an AssertionError with the command and
    the ends of its output."""
    argv = [*argv0, *(("--pins", str(pins)) if pins is not None else ()),
            *(("--store", str(store)) if store is not None else ()), *args]
    p = subprocess.run(argv, cwd=cwd, env=dict(env) if env is not None else environment(),
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"builder {' '.join(args)}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p
