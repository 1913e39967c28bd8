"""Fast mode's one rule: whether an apply record's entry still vouches for a file's bytes without
reading them (here because hosts judge it too: the installer's record, the audit's checks)."""

from __future__ import annotations

from typing import Any


def recorded_mtime_ns(value: Any) -> int | None:
    """An apply record's mtime in nanoseconds: the installer writes int ns; float (or small int)
    seconds are accepted from other writers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and value > 10**12:
        return value
    return int(round(float(value) * 1e9))


def fast_mode_drift(recorded: Any, sha256: str, size: int, st_size: int, st_mtime_ns: int, st_ino: int) -> str | None:
    """Fast mode's one rule: does an apply record's entry still vouch for a file's bytes?

    An install hashes each model file in full and records its size, mtime (ns) and inode beside the
    sha256; the entry vouches for ``sha256`` while the file keeps all three. This trusts the file
    system: an in-place edit of the same size whose mtime was put back is not seen (full mode hashes).
    None when the entry vouches; else the drift: "no-record" (no entry, or one for other bytes),
    "size", "replaced" (another inode) or "modified" (another mtime). Seconds lose precision as
    floats, so a recorded mtime in seconds matches within a millisecond; nanoseconds match exactly.
    The installer, builder.store.modelstore and checks/test_models.py all decide with this function.
    """
    if not isinstance(recorded, dict) or recorded.get("sha256") != sha256 or recorded.get("size") != size:
        return "no-record"
    if st_size != size:
        return "size"
    if recorded.get("inode") != st_ino:
        return "replaced"
    raw = recorded.get("mtime")
    want = recorded_mtime_ns(raw)
    in_ns = want is not None and want == raw
    if want is None or (want != st_mtime_ns if in_ns else abs(want - st_mtime_ns) >= 1_000_000):
        return "modified"
    return None
