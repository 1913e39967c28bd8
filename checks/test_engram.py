"""Engram and per-rank inputs: the Engram folder holds this rank's own `r<k>of<n>` files, n equal to the
lane's tensor-parallel size, and no other rank's files. Each placed file's presence, size and content
are the models checks' (builder.store.placement puts the lane's Engram files under paths.engram).

The lane's derivations (rank caches, token map, packed Engram: builder.launch.derivplan), each in its folder
addressed by its inputs: made for this address, every file of its record present with its size (full
mode: its sha256), nothing added, no other rank's file."""

from __future__ import annotations

from typing import Any

import pytest
from checklib import (
    Cmd,
    Concern,
    cat,
    derived_command,
    json_output,
    listing,
    listing_command,
    listing_roots,
    or_skip,
    read_applied,
    run,
)

from builder.hostscripts import shown
from builder.store.placement import rank_tag


def planned(expect: dict[str, Any]) -> list[Cmd]:
    """The apply record, the Engram folder's listing (with the model roots') and this rank's derivations."""
    cmds = [cat(expect["applied_path"]), listing_command(listing_roots(expect))]
    return cmds + ([derived_command(expect)] if expect.get("derivations") else [])


CONCERN = Concern(name="engram", order=40, phase="preflight", containers=False, prefetch=planned)


@pytest.fixture(scope="module")
def engram(host: Any, expect: dict[str, Any]) -> dict[str, Any]:
    serve = or_skip(expect.get("serve"), expect.get("serve_reason") or "lane settings unknown")
    root = expect["paths"]["engram"].rstrip("/")
    rec, _ = read_applied(host, expect)
    recorded = [m for m in (rec or {}).get("models") or [] if str(m.get("path", "")).startswith(root + "/")]
    wanted = any(m.get("role") == "engram" for m in expect.get("models") or []) or bool(recorded)
    files = listing(host, expect, root)
    if files is None:
        if wanted:
            pytest.fail(f"Engram folder: expected {root}, found none")
        pytest.skip(f"the lane has no Engram or per-rank inputs (no {root} and none recorded)")
    tagged = {}
    for rel in files:
        t = rank_tag(rel)
        if t is not None:
            tagged[rel] = t
    if not tagged and not wanted:
        pytest.skip(f"no per-rank files in {root} and none expected")
    per_rank = any(rank_tag(f["file"]) for m in expect.get("models") or [] if m.get("role") == "engram"
                   for f in m.get("files") or [])
    return {
        "per_rank": per_rank or (bool(tagged) and not wanted),
        "root": root,
        "tp": serve["tensor_parallel"],
        "rank": expect["host"]["rank"],
        "files": files,
        "tagged": tagged,
        "recorded": recorded,
    }


def test_own_rank_files(engram: dict[str, Any]) -> None:
    if not engram["per_rank"]:
        pytest.skip("the lane's Engram is whole on every rank (the lock lists no r<k>of<n> file)")
    k, n = engram["rank"], engram["tp"]
    own = [f for f, t in engram["tagged"].items() if t == (k, n)]
    seen = sorted({f"r{a}of{b}" for a, b in engram["tagged"].values()})
    assert own, (
        f"{engram['root']}: expected files tagged r{k}of{n}, found none (tags found: "
        f"{', '.join(seen) or 'none'})"
    )


def test_tensor_parallel_size(engram: dict[str, Any]) -> None:
    n = engram["tp"]
    wrong = sorted(f for f, t in engram["tagged"].items() if t[1] != n)
    assert not wrong, (
        f"{engram['root']}: expected ranges for tensor-parallel {n}, found {len(wrong)} file(s) "
        f"for another size: {shown(wrong)}"
    )


def test_no_other_rank_files(engram: dict[str, Any]) -> None:
    k = engram["rank"]
    other = sorted(f for f, t in engram["tagged"].items() if t[0] != k)
    assert not other, f"{engram['root']}: expected only rank {k}'s files, found other ranks': {shown(other)}"


@pytest.fixture(scope="module")
def derived(host: Any, expect: dict[str, Any]) -> dict[str, Any]:
    plan = or_skip(expect.get("derivations"), expect.get("derivations_reason") or "the lane has no derivations")
    if not plan.get("derivations"):
        pytest.skip("the lane has no derivations")
    return json_output(run(host, *derived_command(expect)))  # type: ignore[no-any-return]


def test_derivations_match_their_records(derived: dict[str, Any]) -> None:
    bad = [p for problems in derived.values() for p in problems]
    assert not bad, f"{len(bad)} derivation problem(s): expected each made and unchanged, found {shown(bad)}"
