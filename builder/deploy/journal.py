"""What a deploy in progress has done, on the operator machine, so a rerun after a kill converges.

``<store>/deploy/<fleet>.json`` is written (atomically) before a deploy changes anything on a host
and at each phase after that: the release every host ran before (``origin``: the fleet's last whole
state), the release it is moving to (``target``), the phase, and why it is rolling back. It is removed
when the deploy ends with every host on one side: all on the target (deployed), or all back on the
origin (rolled back) and the old release started again and audited (a rollback's phases are
``rolling-back``, ``restarting-old``, ``verifying-old``). A rerun that finds it knows what "the old
release" is for every host, even when the killed run had already switched some of them: it moves every
host to its target, and on any failure back to that origin, never leaving a mix.

``<store>/deploy/locks/<lock hash>/`` keeps the pins, the lock and the image recipe of every lock a
deploy moved a fleet to, so a rollback to it can be audited against what it was deployed from (the
working pins and lock by then describe the new release).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from builder.core.atomic import tmp_name
from builder.errors import ConfigError
from builder.foundation.canon import atomic_write, pretty_json, replace_folder

FORMAT = 1


@dataclass
class Journal:
    fleet: str
    target: dict[str, str]  # host -> bundle id
    origin: dict[str, str | None]  # host -> bundle id it ran before (None: nothing installed)
    origin_locks: dict[str, str | None]  # host -> lock hash of its origin release
    target_lock: str
    phase: str = "staging"
    reason: str = ""
    pid: int = field(default_factory=os.getpid)
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    format: int = FORMAT

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


#: the phases of a rollback (the journal stays until the old release is started and audited)
ROLLBACK_PHASES = ("rolling-back", "restarting-old", "verifying-old")


def rolling_back(j: Journal) -> bool:
    return j.phase in ROLLBACK_PHASES


def journal_path(store: Path, fleet: str) -> Path:
    return store / "deploy" / f"{fleet}.json"


def load(store: Path, fleet: str) -> Journal | None:
    """The unfinished deploy of this fleet, if any. A journal that is there but cannot be read is an error
    (ConfigError, naming the file and the fix), never taken for "none": it alone says which release
    every host ran before, what a rollback goes back to."""
    p = journal_path(store, fleet)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(_unreadable(p, fleet, f"cannot read it: {e.strerror}")) from None
    try:
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        if d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format')!r}, where this builder reads format {FORMAT}")
        j = Journal(**{k: d[k] for k in Journal.__dataclass_fields__ if k in d})
    except (ValueError, TypeError) as e:
        raise ConfigError(_unreadable(p, fleet, str(e).splitlines()[0] if str(e) else type(e).__name__)) from None
    return j


def _unreadable(p: Path, fleet: str, why: str) -> str:
    return (f"{p}: the journal of an unfinished deploy of fleet {fleet} cannot be read ({why}); it names the "
            f"release each host ran before: put back the file a deploy wrote, or, with every host checked "
            f"(`builder status --fleet {fleet}`), remove it and deploy again")


def save(store: Path, j: Journal) -> None:
    p = journal_path(store, j.fleet)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, pretty_json(j.to_json()))


def clear(store: Path, fleet: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        journal_path(store, fleet).unlink()


# ------------------------------------------------------------------ what each lock was deployed from


def snapshot_dir(store: Path, lock_hash: str) -> Path:
    return store / "deploy" / "locks" / lock_hash


def snapshot(store: Path, lock_hash: str, pins: Path, lock: Path, root: Path, recipe: str | None) -> Path:
    """Keep the pins, the lock and the image's recipe folder (``recipe``: relative to the project
    root ``root``) under the lock's hash (once)."""
    d = snapshot_dir(store, lock_hash)
    if (d / "pins.lock").is_file():
        return d
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tmp_name(d))
    tmp.mkdir()
    shutil.copy2(pins, tmp / "pins.toml")
    if recipe is not None and (root / recipe).is_dir():  # (the recipe: a folder of the project, such as images/demo)
        shutil.copytree(root / recipe, tmp / recipe, symlinks=True)
    shutil.copy2(lock, tmp / "pins.lock")  # last: a snapshot with its lock is complete
    try:
        replace_folder(tmp, d)  # (two fleets deploying this lock at once: each puts a whole copy in place)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def find_snapshot(store: Path, lock_hash: str | None) -> Path | None:
    if not lock_hash:
        return None
    d = snapshot_dir(store, lock_hash)
    return d if (d / "pins.lock").is_file() and (d / "pins.toml").is_file() else None
