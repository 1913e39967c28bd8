"""checks/checklib.py imported by file, as the module `checklib`: the name the check modules import it
by. checks/ is not a package (`builder audit` runs it as a pytest root of its own, one per host), so
its modules are loaded from their files here rather than through sys.path. Also what the unit tests of
checklib share: a fresh checklib, the concerns an expectation selects, a local expectation, a command
counter on a testinfra host."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

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


def checklib_fresh() -> object:
    """checks/checklib as the per-host pytest imports it, with its per-host caches empty."""
    cl: Any = checklib()
    for cache in (cl.RAN, cl.APPLIED_CACHE, cl.EXISTS_CACHE, cl.LIST_CACHE):
        cache.clear()
    cl.PREFETCHED.clear()
    return cl


def concerns_for(expect: dict[str, Any]) -> list[Any]:
    """The CONCERN of each check module `expect` selects, as checks/conftest.py gives them to
    checklib.prefetch; `expect["containers"]` is set as `builder audit` writes it."""
    found: list[Any] = [check_module(n).CONCERN for n in expect["concerns"]]
    expect["containers"] = any(c.containers for c in found)
    return found


def local_expect(tmp_path: Path) -> dict[str, object]:
    root = tmp_path / "models" / "tiny"
    root.mkdir(parents=True)
    (root / "w.bin").write_bytes(b"w" * 10)
    return {
        "concerns": ["release", "models", "engram", "memory", "storage", "runtime"],
        "mode": "fast",
        "phase": "preflight",
        "host": {"role": "head"},
        "paths": {"engram": str(tmp_path / "engram"), "models": str(tmp_path / "models")},
        "applied_path": str(tmp_path / "state" / "applied.json"),
        "current_path": str(tmp_path / "current"),
        "models": [{"root": str(root), "files": [{"path": "w.bin", "size": 10, "sha256": "0" * 64}]}],
        "expect": {"gpu_count": 0, "rdma": False, "nfs_mounts": [], "min_free_disk_gib": 1, "docker": False},
    }


def count_commands(host: Any) -> list[str]:
    """The commands host.run is given from now on (each still runs, on the real host)."""
    calls: list[str] = []
    real_run = host.run

    def counting_run(command: str, *args: str) -> Any:
        calls.append(command)
        return real_run(command, *args)

    host.run = counting_run
    return calls
