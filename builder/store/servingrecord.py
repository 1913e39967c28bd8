"""The release record of what a release answered: its gates, its replay and its speed, per fleet and bundle.

``<store>/deploy/serving/<fleet>/<bundle id>.json`` (the head's bundle id) is written, atomically, by a
deploy or a start once the release's serving audit passes (builder.deploy.servingrecords); the head
keeps a copy beside its release (``releases/<bundle id>/serving.json``). A redeploy compares the new
release's replay with the running release's record (checks/test_gates.py), and ``builder status``
shows the last one. It compares answers, not bytes: a changed model byte whose answers stay the same
replays identically.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from builder.errors import ConfigError
from builder.foundation.canon import atomic_write

FORMAT = 1
#: the records a fleet keeps (the newest by write time); older ones are removed when a new one is written
KEEP = 16


def folder(store: Path, fleet: str) -> Path:
    return store / "deploy" / "serving" / fleet


def path(store: Path, fleet: str, bundle: str) -> Path:
    return folder(store, fleet) / f"{bundle}.json"


def load(store: Path, fleet: str, bundle: str) -> dict[str, Any] | None:
    """The record of `bundle` on `fleet`, or None when none was written. A record that cannot be read
    is an error naming the file and the fix (never silently None: it is a release's baseline)."""
    p = path(store, fleet, bundle)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the release's serving record: {e.strerror}") from None
    try:
        rec = json.loads(data)
        if not isinstance(rec, dict) or rec.get("format") != FORMAT:
            raise ValueError("not a serving record")
    except ValueError as e:
        raise ConfigError(f"{p}: damaged serving record ({e}); remove it and run `builder start` or "
                          "`builder deploy` again to record the release's answers anew") from None
    return rec


def records(store: Path, fleet: str) -> dict[str, dict[str, Any]]:
    """Every record of `fleet`, by bundle id."""
    out = {}
    d = folder(store, fleet)
    for p in sorted(d.glob("*.json")) if d.is_dir() else []:
        rec = load(store, fleet, p.stem)
        if rec is not None:
            out[p.stem] = rec
    return out


def make(fleet: str, bundle: str, lock_hash: str | None, facts: dict[str, Any], at: str,
         accepted: bool = False) -> dict[str, Any]:
    """The record of `bundle` from the gates check's facts (``gates``, ``replay``, ``speed``)."""
    return {
        "format": FORMAT,
        "fleet": fleet,
        "bundle": bundle,
        "lock_hash": lock_hash,
        "at": at,
        "gates": facts.get("gates") or {},
        "replay": facts.get("replay") or [],
        "speed": facts.get("speed"),
        "accepted": accepted,
    }


def save(store: Path, rec: dict[str, Any]) -> Path:
    p = path(store, rec["fleet"], rec["bundle"])
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, json.dumps(rec, indent=1, sort_keys=True).encode() + b"\n")
    old = sorted(p.parent.glob("*.json"), key=lambda q: q.stat().st_mtime_ns, reverse=True)[KEEP:]
    for q in old:
        q.unlink(missing_ok=True)
    return p


def replay_differences(base: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    """One line per prompt whose answer changed: the first differing position and token on each side."""
    was = {r.get("prompt"): r for r in base}
    out = []
    for r in new:
        b = was.get(r.get("prompt"))
        if b is None:
            continue  # (a prompt the baseline never asked: nothing to compare)
        if r.get("error"):
            out.append(f"{r['prompt']!r}: no answer ({r['error']})")
            continue
        if b.get("token_sha") == r.get("token_sha"):
            continue
        x, y = b.get("ids"), r.get("ids")
        if x is not None and y is not None:
            i = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
            at = (f"first difference at token {i}: id {x[i] if i < len(x) else 'end'} -> "
                  f"{y[i] if i < len(y) else 'end'}")
        else:
            at = "the text differs"
        out.append(f"{r['prompt']!r}: {at} ({str(b.get('text', ''))[:40]!r} -> {str(r.get('text', ''))[:40]!r})")
    return out
