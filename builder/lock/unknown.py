"""`builder lock --check` in full: the lock's check, and which of the inputs missing from the lock are
UNKNOWN: their pins give no hash (nobody has published one), so only their source can, and the lock
cannot be completed from this project alone. `builder lock NAME` on a machine that reaches the
source resolves and records each; nothing is guessed."""

from __future__ import annotations

import re
from pathlib import Path

from builder.inputs.pins import INPUT_KINDS, GitSource, Pins, PublishedImage, load_pins
from builder.lock.gitsrc import is_local_url
from builder.lock.lockfile import LockCheck, check_lock, load_lock, selected_images

HEX40 = re.compile(r"^[0-9a-f]{40}$")


def what_is_unknown(pins: Pins, kind: str, name: str) -> str | None:
    """What input ``kind.name``'s pin does not give and where only it can come from; None when the pin
    gives its hash or the project holds its bytes (then `builder lock --offline` resolves it)."""
    if kind == "sources":
        return _source(pins.sources[name])
    if kind == "bases":
        b = pins.bases[name]
        return None if b.digest else f"its digest: from the registry of {b.ref}"
    if kind == "models":
        m = pins.models[name]
        if m.local:
            return None
        commit = "" if HEX40.match(m.revision) else f"the commit of revision {m.revision} and "
        return f"{commit}every file's sha256: from the Hugging Face Hub ({m.repo})"
    if kind == "files":
        f = pins.files[name]
        if f.sha256 != "UNKNOWN":
            return None
        return ("its sha256 and its URL: nobody has published its content" if f.url == "UNKNOWN"
                else f"its sha256: from {f.url}")
    if kind == "kits":
        k = pins.kits[name]
        if k.local or k.source is None or _source(pins.sources[k.source]) is None:
            return None
        return f"every file's sha256: from its {k.manifest} in source {k.source}"
    if kind == "images":
        i = pins.images[name]
        if isinstance(i, PublishedImage) and i.published.endswith("@UNKNOWN"):
            return f"its digest: from the registry of {i.published.rsplit('@', 1)[0]}"
    return None


def _source(s: GitSource) -> str | None:
    if is_local_url(s.url):
        return None
    parts = []
    if s.ref == "UNKNOWN":
        parts.append("its branch")
    if s.rev is None or s.rev == "UNKNOWN":
        parts.append(f"the commit of {s.ref}" if s.ref != "UNKNOWN" else "its commit")
    elif not HEX40.match(s.rev):
        parts.append(f"the full commit of {s.rev}")
    parts.append("its tree hash")
    what = f"{', '.join(parts[:-1])} and {parts[-1]}" if len(parts) > 1 else parts[0]
    return f"{what}: from {s.url}"


def check(pins_path: Path, lock_path: Path, names: list[str] | None = None) -> LockCheck:
    """check_lock, with ``unknown``: each selected input missing from the lock whose hash its pin does not
    give (input -> what and where from), and ``complete_lanes``: the lanes none of whose inputs is so."""
    res = check_lock(pins_path, lock_path, names)
    pins = load_pins(pins_path)
    lock = load_lock(lock_path)
    selected = pins.closure(names) if names else pins.all_inputs()
    missing = [(kind, n) for kind in INPUT_KINDS for n in sorted(selected[kind]) if n not in getattr(lock, kind)]
    missing += [("images", n) for n in sorted(selected_images(pins, names)) if n not in lock.images]
    for kind, n in missing:
        what = what_is_unknown(pins, kind, n)
        if what is not None:
            res.unknown[f"{kind}.{n}"] = what
    for lane in sorted(pins.lanes):
        need = pins.closure([lane])
        keys = {f"{k}.{n}" for k, ns in need.items() for n in ns} | {f"images.{pins.lanes[lane].image}"}
        if not keys & set(res.unknown):
            res.complete_lanes.append(lane)
    return res
