"""Storage: each expected NFS mount is mounted, readable within a bounded time, and in /etc/fstab;
free disk under the models folder at or above the minimum."""

from __future__ import annotations

from typing import Any

import pytest
from checklib import FSTAB, Cmd, Concern, free_disk, or_skip, readable_within, run


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """Each NFS mount's bounded read and /etc/fstab, and the free space where the models go."""
    want = expect["expect"]
    mounts = want.get("nfs_mounts") or []
    cmds = [readable_within(m) for m in mounts] + ([FSTAB] if mounts else [])
    if want.get("min_free_disk_gib"):
        cmds.append(free_disk(expect["paths"]["models"]))
    return cmds


CONCERN = Concern(name="storage", order=80, phase="preflight", containers=False, prefetch=planned)


def _fstab_targets(text: str) -> set[str]:
    out = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and not parts[0].startswith("#"):
            out.add(parts[1].rstrip("/") or "/")
    return out


def test_nfs_mounted(host: Any, expect: dict[str, Any]) -> None:
    mounts = or_skip(expect["expect"].get("nfs_mounts"), "no NFS mount expected on this host")
    for m in mounts:
        mp = host.mount_point(m)
        assert mp.exists, f"NFS mount {m}: expected mounted, found not mounted"
        assert mp.filesystem.startswith("nfs"), f"mount {m}: expected nfs, found {mp.filesystem}"
        r = run(host, *readable_within(m))
        assert r.rc == 0, f"NFS mount {m}: expected readable within 10 s, found exit {r.rc} (stale?)"


def test_nfs_in_fstab(host: Any, expect: dict[str, Any]) -> None:
    mounts = or_skip(expect["expect"].get("nfs_mounts"), "no NFS mount expected on this host")
    r = run(host, *FSTAB)
    found = _fstab_targets(r.stdout if r.rc == 0 else "")
    missing = [m for m in mounts if m.rstrip("/") not in found]
    assert not missing, (
        f"/etc/fstab: expected entries for {', '.join(mounts)}, found none for "
        f"{', '.join(missing)} (lost after a reboot)"
    )


def test_free_disk(host: Any, expect: dict[str, Any]) -> None:
    want = expect["expect"]["min_free_disk_gib"]
    if not want:
        pytest.skip("no min_free_disk_gib in the host's expectations")
    path = expect["paths"]["models"]
    r = run(host, *free_disk(path))
    assert r.rc == 0, f"df {path}: expected an answer, found exit {r.rc}: {r.stderr.strip()[:100]}"
    avail_gib = int(r.stdout.split()[3]) / (1024 * 1024)
    assert avail_gib >= want, f"free disk for {path}: expected >= {want:g} GiB, found {avail_gib:.1f} GiB"
