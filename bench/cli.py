"""(b) Start-up: `builder --help` and `builder lock --check` on the shipped pins, as subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.common import REPO, Config, Row, builder_argv, judge, median_time, secs

NAME = "cli"


def _heaviest_imports(argv: list[str], n: int = 3) -> str:
    """The top cumulative imports of one run (python -X importtime), for the note when over target."""
    cmd = [sys.executable, "-X", "importtime", "-m", "builder", *argv[1:]] if argv[0].endswith("builder") else \
        [sys.executable, "-X", "importtime", *argv[1:]]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    rows = []
    for ln in p.stderr.splitlines():
        if not ln.startswith("import time:") or "cumulative" in ln:
            continue
        parts = [x.strip() for x in ln[len("import time:"):].split("|")]
        if len(parts) == 3 and parts[1].isdigit():
            rows.append((int(parts[1]), parts[2].strip()))
    top = [r for r in sorted(rows, reverse=True) if "." not in r[1] or r[1].startswith("builder")][:n]
    return ", ".join(f"{name} {us / 1000:.0f} ms" for us, name in top)


def run(cfg: Config) -> list[Row]:
    base = builder_argv()
    env = dict(os.environ)
    rows: list[Row] = []
    cases = [
        ("builder --help", [*base, "--help"], 0.25),
        ("builder lock --check (shipped pins)", [*base, "lock", "--check"], 0.4),
    ]
    for fig, argv, limit in cases:
        codes: list[int] = []

        def one(argv: list[str] = argv, codes: list[int] = codes) -> None:
            p = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            codes.append(p.returncode)

        t, _ = median_time(one, max(cfg.runs, 10), warmup=1)
        target = f"<= {limit}"
        status = judge(t, target)
        note = f"exit {sorted(set(codes))}"
        if "lock" in fig and codes and codes[-1] != 0:
            note += " (the shipped lock covers only the offline lanes here: --check reports the others stale)"
        if status == "fail":
            note += "; heaviest imports: " + _heaviest_imports(argv)
        rows.append(Row(NAME, fig, secs(t), "", None, f"{target} s", status, note, {"seconds": t}))
    # The floor under both: this interpreter's own start, with the site-packages .pth files it runs
    # (an editable install's import finder, anything the machine adds), before builder runs at all.
    t, _ = median_time(lambda: subprocess.run([sys.executable, "-c", "pass"], env=env), max(cfg.runs, 10), warmup=1)
    rows.append(Row(NAME, "python3 -c pass (the interpreter's start: the floor under both)", secs(t), "", None, "",
                    "report", "", {"seconds": t}))
    return rows
