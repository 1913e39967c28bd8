"""The generator of tests/data/prefetch_plans.json: the commands checks/checklib.py `planned` prefetches
for each host variant and selection of concerns, each fact module's source shown by its name.

    python3 -m tests.lib.prefetchplans --write             # write tests/data/prefetch_plans.json
    python3 -m tests.lib.prefetchplans --write --out PATH  # write them elsewhere (no --write: stdout)

tests/test_concerns.py writes them into a tmp folder and compares the bytes with the file, so a change
to what a concern prefetches shows as a diff of that file, accepted by running this with --write.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from builder import hostscripts as hs
from builder.foundation.canon import atomic_write
from tests.lib.checkmods import checklib_fresh, concerns_for

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "prefetch_plans.json"
NAMES = ("image", "release", "models", "engram", "gpu", "burn", "memory", "fabric", "storage", "runtime", "serving",
         "gates")
# Each host's expectations with every want on ("full", "hashing": --mode full) or off ("bare")
VARIANTS = ("full", "hashing", "bare")
SELECTIONS = {**{c: [c] for c in NAMES}, "preflight": [c for c in NAMES if c not in ("serving", "gates")],
              "all": list(NAMES),
              "image+runtime": ["image", "runtime"], "release+gpu": ["release", "gpu"]}


def variant(name: str) -> dict[str, Any]:
    on = name != "bare"
    return {
        "lane": "demo",
        "host": {"name": "h", "rank": 0 if on else 1, "role": "head" if on else "worker"},
        "mode": "full" if name == "hashing" else "fast",
        "hash_jobs": 4,
        "paths": {"engram": "/srv/engram/", "models": "/srv/models"},
        "applied_path": "/var/lib/builder/state/applied.json",
        "current_path": "/var/lib/builder/current",
        "image": {"image_id": "sha256:ab", "tag": "builder/demo:1"} if on else None,
        "models": [{"root": "/srv/models/tiny", "files": [{"path": "/srv/models/tiny/w.bin"},
                                                           {"path": "/srv/models/tiny/c.json"}]}] if on else [],
        "derivations": {"derivations": [{"name": "d"}]} if on else None,
        "expect": {
            "docker": on, "gpu_count": 1 if on else 0, "min_free_memory_gib": 1 if on else None, "rdma": on,
            "nfs_mounts": ["/mnt/a", "/mnt/b"] if on else [], "min_free_disk_gib": 1 if on else None,
        },
    }


def shown(cmd: tuple[str, ...]) -> list[str]:
    """A command with each fact module's source as its name (the plans stay a few KiB)."""
    names = {getattr(hs, n): f"<{n}>" for n in ("BATCH", "FILES", "FABRIC", "SERVE", "MEMORY", "DERIVE")}
    return [names.get(a, a) for a in cmd]


def plan(case: str) -> list[list[str]]:
    """The plan of one case, ``VARIANT/SELECTION``."""
    cl: Any = checklib_fresh()
    v, sel = case.split("/")
    expect = {**variant(v), "concerns": SELECTIONS[sel]}
    return [shown(c) for c in cl.planned(expect, concerns_for(expect))]


def cases() -> list[str]:
    return [f"{v}/{s}" for v in VARIANTS for s in SELECTIONS]


def render() -> bytes:
    """The file's bytes: every case's plan, in the order of cases(), JSON indented by one."""
    return (json.dumps({c: plan(c) for c in cases()}, indent=1) + "\n").encode()


def write(path: Path) -> None:
    atomic_write(path, render())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.lib.prefetchplans", description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write {GOLDEN.name} instead of printing it")
    ap.add_argument("--out", type=Path, default=GOLDEN, help="the file --write writes (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.write:
        write(args.out)
    else:
        sys.stdout.buffer.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
