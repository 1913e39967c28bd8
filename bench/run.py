"""Run every benchmark and print a table of figures and ratios against the standard tools.

    python3 -m bench.run [--json] [--quick] [--only NAME[,NAME]] [--workdir DIR] [--runs N] [--keep]

Each benchmark makes its own data under a temp folder (in /tmp, or --workdir) and the folder is
removed at the end. Figures are medians of --runs runs (default 5; --quick: 2 runs, smaller data).
A benchmark that cannot run here (no Docker, no test-host image, no openssl) prints
``skipped: reason``. Exit 0 whatever the ratios (a benchmark is not a test); 1 when a benchmark
raised instead of measuring (its row says ``error: ...``, the traceback is on stderr: e.g. the audit
of a correctly installed fleet did not pass); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import Config, Row

#: name -> module (bench/<module>.py with run(cfg) -> list[Row]), in the order they run.
BENCHMARKS: dict[str, str] = {
    "verify": "bench.verify",  # (a) model folder verification
    "cli": "bench.cli",  # (b) builder --help, builder lock --check
    "image": "bench.image",  # (c) builder image demo (up to date) vs docker build (cached)
    "audit": "bench.audit",  # (d) builder audit over 1, 2, 4, 8 test hosts; host-side hashing
    "bundle": "bench.bundle",  # (e) bundle creation, install-side verification; (f) peak memory
    "deploy": "bench.deploy",  # (g) builder deploy: unchanged fleet vs preflight audit; 4 hosts vs 1
    "fetch": "bench.fetch",  # (h) builder fetch (verified) vs hf download from the fake Hub
    "ship": "bench.ship",  # (i) fleet bundles linked from the store, ship vs scp -r, installer, progress
    "registry": "bench.registry",  # (j) top-layer update: registry and thin bundle vs archive; push vs docker push
    "derive": "bench.derive",  # (k) a held derivation vs its check; bytes read when held and when made
    "fanout": "bench.fanout",  # (l) a model to 1, 2, 4 hosts via the fleet registry: uplink bytes, pull vs curl
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="Print the results as JSON on stdout.")
    p.add_argument("--quick", action="store_true", help="Smaller data and 2 runs per figure (a smoke run).")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]",
                   help="Run only these benchmarks: " + ", ".join(BENCHMARKS))
    p.add_argument("--workdir", type=Path, default=None, help="Parent folder for the temp data [/tmp].")
    p.add_argument("--runs", type=int, default=None, help="Runs per figure (default 5; --quick 2).")
    p.add_argument("--keep", action="store_true", help="Keep the temp folder (for debugging).")
    return p


def format_table(rows: list[Row]) -> str:
    head = ["bench", "figure", "builder", "standard tool", "ratio", "target", "result"]
    body = []
    for r in rows:
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        result = r.note if r.status in ("skipped", "error") else r.status
        body.append([r.bench, r.figure, r.builder, r.standard, ratio, r.target, result])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=False)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(b, widths, strict=True)).rstrip())
    notes = [f"- {r.bench} / {r.figure}: {r.note}" for r in rows if r.note and r.status not in ("skipped", "error")]
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    names = list(BENCHMARKS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BENCHMARKS]
        if unknown:
            sys.stderr.write(f"--only: unknown benchmark {', '.join(unknown)} (known: {', '.join(BENCHMARKS)})\n")
            return 2
    runs = args.runs if args.runs is not None else (2 if args.quick else 5)
    if runs < 1:
        sys.stderr.write("--runs: must be at least 1\n")
        return 2
    parent = args.workdir
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="builder-bench-", dir=parent))
    cfg = Config(workdir=work, quick=args.quick, runs=runs)
    rows: list[Row] = []
    started = time.time()
    load_before = os.getloadavg()
    try:
        for name in names:
            sys.stderr.write(f"== {name}\n")
            t = time.perf_counter()
            try:
                mod = importlib.import_module(BENCHMARKS[name])
                got = mod.run(cfg)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # one broken benchmark must not hide the others
                traceback.print_exc(file=sys.stderr)
                first = str(e).splitlines()[0][:300] if str(e) else ""
                got = [Row(bench=name, figure="(benchmark)", status="error",
                           note=f"error: {type(e).__name__}: {first}")]
            for r in got:
                sys.stderr.write(f"   {r.figure}: {r.builder} vs {r.standard} "
                                 f"{'' if r.ratio is None else f'ratio {r.ratio:.2f}'} {r.status} {r.note}\n")
            sys.stderr.write(f"   ({time.perf_counter() - t:.0f} s)\n")
            rows.extend(got)
    finally:
        if args.keep:
            sys.stderr.write(f"kept {work}\n")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        out = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()},
            "quick": args.quick,
            "runs": runs,
            # Other work on the machine skews the ratios (the parallel hashing needs idle cores):
            # the 1-minute load average before and after the run says how quiet it was.
            "loadavg_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "results": [r.as_dict() for r in rows],
        }
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        sys.stdout.write(format_table(rows) + "\n")
        sys.stdout.write(f"\n(load average 1 min: {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
                         f"{os.cpu_count()} CPUs)\n")
    # a benchmark that raised (e.g. the audit of a correct install did not pass) is not a figure
    return 1 if any(r.status == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
