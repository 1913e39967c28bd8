"""checks/checklib.py imported by file, as the module `checklib`: the name the check modules import it
by. checks/ is not a package (`builder audit` runs it as a pytest root of its own, one per host), so
its modules are loaded from their files here rather than through sys.path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CHECKS = Path(__file__).resolve().parents[2] / "checks"


def checklib() -> ModuleType:
    """The module `checklib` (checks/checklib.py): the one already imported by that name, else that file
    imported now under that name."""
    mod = sys.modules.get("checklib")
    if mod is not None:
        return mod
    spec = importlib.util.spec_from_file_location("checklib", CHECKS / "checklib.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["checklib"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["checklib"]
        raise
    return mod


_MODULES: dict[str, ModuleType] = {}


def check_module(name: str) -> ModuleType:
    """checks/test_NAME.py, imported under a name of its own (tests/ has test modules of the same
    names), with `checklib` (above) as the module it imports."""
    if name not in _MODULES:
        checklib()
        spec = importlib.util.spec_from_file_location(f"checks_test_{name}", CHECKS / f"test_{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODULES[name] = mod
    return _MODULES[name]
