"""Models: every file the lock lists is on the host with its size; sha256 (full) or stat (fast); count.

"Model files" are every file builder.store.placement gives this rank: the lane's models', and its runtime
inputs' (each file of a kit with its MANIFEST, each mounted plain file such as a chat template or an
overlay), each in its own folder; drift in any of them is named by its path here.

Full mode hashes on the host, many files at once (one remote python3 per batch, a thread per
file). Fast mode compares size, mtime and inode with what the install recorded in the apply
record, and only the size with the lock; a file rewritten in place with the same size and
mtime is what full mode is for.
"""

from __future__ import annotations

from typing import Any

import pytest
from checklib import (
    Cmd,
    Concern,
    cat,
    json_output,
    listing,
    listing_command,
    listing_roots,
    model_files_commands,
    or_skip,
    read_applied,
    run,
)

from builder.core.fastmode import fast_mode_drift
from builder.hostscripts import shown


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """The apply record, every model file's stat (fast) or hash (full), and the model roots' listing."""
    return [cat(expect["applied_path"]), *model_files_commands(expect), listing_command(listing_roots(expect))]


CONCERN = Concern(name="models", order=30, phase="preflight", containers=False, prefetch=planned)


def _expected(expect: dict[str, Any]) -> list[dict[str, Any]]:
    models = or_skip(expect.get("models"), expect.get("models_reason") or "no models expected")
    out = [f for m in models for f in m["files"]]  # this rank's files only (builder.store.placement)
    return or_skip(out, "the lane's models list no files")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def facts(host: Any, expect: dict[str, Any]) -> dict[str, Any]:
    _expected(expect)  # skips when the lane lists no model files
    got: dict[str, Any] = {}
    for cmd in model_files_commands(expect):
        got.update(json_output(run(host, *cmd)))
    return got


def test_files_present(expect: dict[str, Any], facts: dict[str, Any]) -> None:
    files = _expected(expect)
    missing = [
        f"{f['path']} ({facts[f['path']]['error']})" for f in files if "error" in facts.get(f["path"], {})
    ]
    assert not missing, (
        f"{len(missing)} of {len(files)} model file(s): expected present, found absent: {shown(missing)}"
    )


def test_sizes(expect: dict[str, Any], facts: dict[str, Any]) -> None:
    bad = []
    for f in _expected(expect):
        g = facts.get(f["path"], {})
        if "size" in g and g["size"] != f["size"]:
            bad.append(f"{f['path']}: expected {f['size']} bytes, found {g['size']}")
    assert not bad, f"{len(bad)} model file size(s) differ: {shown(bad)}"


def test_content(host: Any, expect: dict[str, Any], facts: dict[str, Any]) -> None:
    files = _expected(expect)
    if expect.get("mode") == "full":
        bad = [
            f"{f['path']}: expected sha256 {f['sha256'][:16]}, found {facts[f['path']]['sha256'][:16]}"
            for f in files
            if "sha256" in facts.get(f["path"], {}) and facts[f["path"]]["sha256"] != f["sha256"]
        ]
        assert not bad, f"{len(bad)} model file(s) changed (sha256): {shown(bad)}"
        return
    rec, why = read_applied(host, expect)
    if rec is None:
        pytest.skip(f"fast mode compares with the apply record: {why} (use --mode full)")
    recorded = {m.get("path"): m for m in rec.get("models") or []}
    bad = []
    for f in files:
        g, r = facts.get(f["path"], {}), recorded.get(f["path"])
        if "error" in g:
            continue  # reported by models::files_present
        drift = fast_mode_drift(r, f["sha256"], f["size"], g["size"], g["mtime_ns"], g["inode"])
        if drift in (None, "size"):
            continue  # a size is models::sizes' to report
        if r is None:
            bad.append(f"{f['path']}: expected in the apply record, found not recorded")
        elif drift == "no-record":
            bad.append(
                f"{f['path']}: recorded sha256 {str(r.get('sha256'))[:16]}, lock says {f['sha256'][:16]}"
            )
        elif drift == "replaced":
            bad.append(f"{f['path']}: expected inode {r.get('inode')}, found {g['inode']} (replaced)")
        else:
            bad.append(
                f"{f['path']}: expected mtime {r.get('mtime')}, found {g['mtime_ns'] / 1e9:.3f} (modified)"
            )
    assert not bad, f"{len(bad)} model file(s) differ from the apply record: {shown(bad)}"


def test_file_count(host: Any, expect: dict[str, Any]) -> None:
    models = or_skip(expect.get("models"), expect.get("models_reason") or "no models expected")
    bad = []
    for m in models:
        have = listing(host, expect, m["root"])
        want = {f["file"] for f in m["files"]}
        if have is None:
            bad.append(f"{m['root']}: expected {len(want)} files, found no folder")
            continue
        extra = sorted(set(have) - want)
        if extra:
            bad.append(f"{m['root']}: expected {len(want)} files, found {len(have)} (extra: {shown(extra)})")
        if m.get("expect_files") is not None and m["locked_files"] != m["expect_files"]:
            bad.append(
                f"{m['name']}: expected {m['expect_files']} files by the pins, the lock has {m['locked_files']}"
            )
    assert not bad, "; ".join(bad)
