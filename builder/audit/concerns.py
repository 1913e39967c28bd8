"""The check concerns, each declared by its own check module: `CONCERN = Concern(...)` at the top
level of checks/test_NAME.py.

Two sides read a declaration. The operator's (`declared`) reads it from the module's source, without
importing the module (a check module imports pytest and testinfra): its name, its order, its phase and
whether its checks look at the rank's containers, which give the concerns an audit can select, the
phases' selections and `--only`. The check process (checks/conftest.py) takes it from the imported
module: its `prefetch`, the commands its checks will run on the host, which checklib.prefetch runs
in one remote call before the first check.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from builder.errors import ConfigError

Phase = Literal["preflight", "serving"]
#: a command as testinfra takes it: (format, *args)
Cmd = tuple[str, ...]
Prefetch = Callable[[dict[str, Any]], list[Cmd]]

#: where a module that declares no concern (or does not parse) comes: after every declared one
UNDECLARED = 1 << 30


@dataclass(frozen=True)
class Concern:
    """What a check module declares of its concern."""

    #: the module's name less `test_` (checks/test_NAME.py); what `--only` and the check ids say
    name: str
    #: where it comes among the concerns: the order the modules run in and the matrix's rows
    order: int
    #: the phase whose audit runs it (`--phase all` runs every concern)
    phase: Phase = "preflight"
    #: its checks look at this rank's containers (the image's `docker inspect` then lists them too)
    containers: bool = False
    #: the commands its checks will run on a host whatever they find, from the host's expectations;
    #: only the check process has it (it is code: `declared` does not read it from the source)
    prefetch: Prefetch | None = field(default=None, compare=False)


#: the keywords `declared` reads from the source: each one a literal
STATIC = ("name", "order", "phase", "containers")


def read_declaration(path: Path) -> Concern | None:
    """The module's `CONCERN = Concern(...)`, its literal keywords read from the source; None when it
    declares none or does not parse (its host's pytest then reports the module's error). A
    declaration that cannot be read is a ConfigError."""
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["CONCERN"]):
            continue
        where = f"{path}:{node.lineno}: CONCERN"
        if not isinstance(node.value, ast.Call) or node.value.args:
            raise ConfigError(f"{where}: expected Concern(name=..., order=..., ...) with keywords only")
        kw: dict[str, Any] = {}
        for k in node.value.keywords:
            if k.arg in STATIC:
                try:
                    kw[k.arg] = ast.literal_eval(k.value)
                except ValueError:
                    raise ConfigError(f"{where}: {k.arg} must be a literal") from None
            elif k.arg != "prefetch":
                raise ConfigError(f"{where}: unknown keyword {k.arg!r}")
        if not isinstance(kw.get("name"), str) or not isinstance(kw.get("order"), int):
            raise ConfigError(f"{where}: expected a name and an order")
        c = Concern(**kw)
        if c.name != path.stem.removeprefix("test_"):
            raise ConfigError(f"{where}: name {c.name!r}, but the module is {path.name}")
        if c.phase not in get_args(Phase) or not isinstance(c.containers, bool):
            raise ConfigError(f"{where}: expected phase one of {', '.join(get_args(Phase))} and containers a bool")
        return c
    return None


def declared(checks_dir: Path) -> tuple[Concern, ...]:
    """The concerns of a checks folder, one per test_NAME.py, in their order. A module that declares
    none is a preflight concern after the declared ones, with nothing prefetched: it still runs, so
    its host's pytest reports what is wrong with it."""
    found = [
        read_declaration(p) or Concern(name=p.stem.removeprefix("test_"), order=UNDECLARED)
        for p in sorted(checks_dir.glob("test_*.py"))
    ]
    return tuple(sorted(found, key=lambda c: (c.order, c.name)))
