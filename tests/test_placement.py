"""The placement rule: which locked model files a rank holds, and where on its host."""

from __future__ import annotations

import pytest

from builder.errors import ConfigError
from builder.inputs.hosts import Host
from builder.inputs.pins import load_pins
from builder.lock.lockfile import LockedModel, load_lock
from builder.store.placement import model_root, owns, place_models, rank_tag
from tests.lib.shipped import ROOT


@pytest.mark.parametrize(
    "name,want",
    [
        ("engram-r1of2.bin", (1, 2)),
        ("engram-l1-r0of2.bin", (0, 2)),
        ("rank3of4-cache.bin", (3, 4)),
        ("rank-cache/rank3of4-2891eb.bin", (3, 4)),
        ("x/r0of8_table.npy", (0, 8)),
        ("tbl.r12of16", (12, 16)),
        ("engram-R1of2.bin", (1, 2)),
        ("ENGRAM-RANK0OF2.BIN", (0, 2)),
        ("model-00001-of-00002.safetensors", None),
        ("error0of2", None),
        ("engram.bin", None),
        ("weights.bin", None),
        ("r1of2x3", (1, 2)),
        ("r1of2/weights.bin", None),  # only the file's own name carries a tag
    ],
)
def test_rank_tag(name: str, want: tuple[int, int] | None) -> None:
    assert rank_tag(name) == want


def test_owns_is_case_insensitive_and_checks_the_size() -> None:
    assert owns("engram-R1of2.bin", 1, 2, "x") and not owns("engram-R1of2.bin", 0, 2, "x")
    assert owns("tokenizer.json", 0, 2, "x") and owns("tokenizer.json", 1, 2, "x")
    with pytest.raises(ConfigError, match="m: file e-r0of3.bin is for 3 ranks but the lane has tensor_parallel = 2"):
        owns("e-r0of3.bin", 0, 2, "m")
    with pytest.raises(ConfigError, match="names rank 2 of 2"):
        owns("e-r2of2.bin", 0, 2, "m")


def _host(rank: int) -> Host:
    return Host(
        name=f"h{rank}", ssh=f"h{rank}", rank=rank, role="head" if rank == 0 else "worker",
        paths={"models": "/m/", "engram": "/e", "bundles": "/b"},  # type: ignore[arg-type]
    )


def test_shipped_demo_lane_places_each_rank_its_own_engram_files() -> None:
    pins, lock = load_pins(ROOT / "pins.toml"), load_lock(ROOT / "pins.lock")
    by_rank = {k: {m.name: m for m in place_models(pins, lock, "demo", _host(k))} for k in (0, 1)}
    for k, models in by_rank.items():
        tiny, engram = models["demo-tiny"], models["demo-engram"]
        assert tiny.root == "/m/demo-tiny" and engram.root == "/e/demo-engram"
        assert len(tiny.files) == tiny.locked_files == 4  # untagged: every rank
        assert engram.locked_files == 4
        assert sorted(f.file for f in engram.files) == [f"engram-l1-r{k}of2.bin", f"engram-l14-r{k}of2.bin"]
        assert all(f.path == f"/e/demo-engram/{f.file}" for f in engram.files)


def test_a_changed_pin_or_a_missing_lock_entry_is_refused() -> None:
    pins, lock = load_pins(ROOT / "pins.toml"), load_lock(ROOT / "pins.lock")
    lm: LockedModel = lock.models["demo-tiny"]
    changed = lm.model_copy(update={"spec_hash": "0" * 64})
    stale = lock.model_copy(update={"models": {**lock.models, "demo-tiny": changed}})
    with pytest.raises(ConfigError, match=r"models\.demo-tiny: changed since the lock"):
        place_models(pins, stale, "demo", _host(0))
    gone = lock.model_copy(update={"models": {k: v for k, v in lock.models.items() if k != "demo-engram"}})
    with pytest.raises(ConfigError, match=r"models\.demo-engram: not in the lock"):
        place_models(pins, gone, "demo", _host(1))


def test_model_root_by_role() -> None:
    h = _host(0)
    assert model_root(h.paths, "w", "weights") == "/m/w"
    assert model_root(h.paths, "e", "engram") == "/e/e"
