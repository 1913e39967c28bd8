"""(k) Derivations: a derivation already made costs what checking it against its record costs, and
reads none of its bytes; making one reads what it wrote once (one hashing pass).

The derivation is a plain command making per-rank files (no image: what is measured is the host side,
builder.hostscripts.derive, which a deploy runs on every host). Bytes read are `/proc/self/io` rchar,
which also counts a reaped child's reads: the command makes its files with `truncate`, which reads
nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import Config, MiB, Row, judge, median_interleaved, secs
from builder.hostscripts import derive

NAME = "derive"


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


def run(cfg: Config) -> list[Row]:
    files, size = (8, 8 * MiB) if cfg.quick else (16, 64 * MiB)
    total = files * size
    root = cfg.workdir / "derive"
    root.mkdir(parents=True, exist_ok=True)
    # (truncate writes without reading: a child's reads count in its parent's /proc/self/io once reaped)
    script = f'for i in $(seq 1 {files}); do truncate -s {size} "$1/rank0of1-part$i.bin"; done'
    plan: dict[str, Any] = {"format": 1, "rank": 0, "world_size": 1, "derivations": [{
        "name": "cache", "address": "a" * 64, "path": str(root / "cache-aaaaaaaaaaaaaaaa"), "output": "/cache",
        "argv": ["sh", "-c", script, "sh", "{out}"]}]}
    before = _rchar()
    out = derive.make(plan)
    made_read = _rchar() - before
    assert out["derivations"][0]["result"] == "made", out
    before = _rchar()
    out = derive.make(plan)
    held_read = _rchar() - before
    assert out["derivations"][0]["result"] == "held", out
    t = median_interleaved({"held": lambda: derive.make(plan), "check": lambda: derive.check(plan, False)},
                           cfg.runs)
    ratio = t["held"] / t["check"]
    passes = made_read / total
    rows = [
        Row(NAME, "make of a held derivation vs its fast check", secs(t["held"]), secs(t["check"]), ratio,
            "<= 1.5", judge(ratio, "<= 1.5"), f"{files} files, {total / MiB:.0f} MiB",
            {"held_s": t["held"], "check_s": t["check"]}),
        Row(NAME, "bytes read by a held make / the derivation's size", f"{held_read} B", f"{total} B",
            held_read / total, "<= 0.01", judge(held_read / total, "<= 0.01"), "the record, no file's bytes",
            {"held_read": held_read, "bytes": total}),
        Row(NAME, "passes over the data when made (bytes read / size)", f"{made_read} B", f"{total} B", passes,
            "<= 1.05", judge(passes, "<= 1.05"), "one hashing pass over what the command wrote",
            {"made_read": made_read, "bytes": total}),
    ]
    (root / "result.json").write_text(json.dumps([r.as_dict() for r in rows]))
    return rows
