"""The check modules, imported once in the audit's fork server (runner.PRELOAD), for every host's
pytest forked from it: checklib and each test_*.py of the folder in $BUILDER_AUDIT_CHECKS.

pytest imports a test module by its name with the module's folder first on sys.path (its default
"prepend" import mode), so a module already imported from that same file is the one it takes: each
host's pytest then neither compiles nor runs the check modules again. A module that does not import
here is left out, with what it imported, so that each host's pytest imports it itself and reports its
error as any collection error. conftest.py is not imported here: pytest imports each conftest itself.

Imported anywhere else (no $BUILDER_AUDIT_CHECKS), it imports nothing.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

#: each module imported here: name -> (file, size, mtime_ns) when it was imported
LOADED: dict[str, tuple[str, int, int]] = {}


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def load(folder: str) -> None:
    """Import checklib and each test_*.py of `folder`, leaving out any that does not import."""
    root = Path(folder).resolve()
    names = ["checklib", *sorted(p.stem for p in root.glob("test_*.py"))]
    sys.path.insert(0, str(root))
    try:
        for name in names:
            if name in sys.modules or not (root / f"{name}.py").is_file():
                continue
            before = set(sys.modules)
            try:
                importlib.import_module(name)
            except BaseException as e:  # (a check module's error is each host's pytest's to report)
                if isinstance(e, KeyboardInterrupt):
                    raise
                for m in set(sys.modules) - before:
                    del sys.modules[m]
                continue
            for m in set(sys.modules) - before:
                f = getattr(sys.modules[m], "__file__", None)
                stamp = _stamp(f) if f and Path(f).parent == root else None
                if f and stamp is not None:
                    LOADED[m] = (f, *stamp)
    finally:
        sys.path.remove(str(root))


def forget_unless_current(folder: str) -> None:
    """In a host's process: drop every module imported here unless each is of `folder` and its
    file is as it was when imported (the fork server may have been started by an earlier audit of
    the same process, with other checks)."""
    root = Path(folder).resolve()
    if all(Path(f).parent == root and _stamp(f) == (size, mtime) for f, size, mtime in LOADED.values()):
        return
    for name in LOADED:
        sys.modules.pop(name, None)
    LOADED.clear()


if os.environ.get("BUILDER_AUDIT_CHECKS"):
    load(os.environ["BUILDER_AUDIT_CHECKS"])
