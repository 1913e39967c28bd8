#!/usr/bin/env python3
"""FAKE nvidia-smi (builder tests): replays output captured on a real NVIDIA H200, driver 580.159.04.

A standalone script (standard library only), installed on a test host or in a test's folder as
`nvidia-smi` by tests.lib.auditlib, beside its state folder (`$FAKE_NVSMI_DIR`, default
/etc/fake-nvidia-smi). `capture.json` there holds what the real one printed: the `--query-gpu` field
list it answers, the `csv` reply (header and one row, with units) and `--version`. It knows four
invocations (that field list, the burn's sample field list, --version and --query-compute-apps) and
answers anything else as an old driver would ("not a valid field", exit 2). Drift is injected through
files in the state folder: `query` replaces the --query-gpu reply, `apps` is the --query-compute-apps
reply, `apps-live` more of it, each line only while its pid lives (as the real one lists only live
processes), `sample` the sample reply (captured on the H200 at rest).

It is also a FAKE GPU load, the stand-in for the burn's matmul on a host with no GPU: run as
`nvidia-smi --fake-burn SECONDS`, it marks the GPU busy for SECONDS (while it runs, the sample reply is
`sample-busy`, by default the H200 under a fp16 matmul, 2026-12-04) and prints the load's JSON line
with `tflops` (the state file `tflops`, by default that run's 628.97). A latched or throttled GPU is
made by writing `sample-busy` and `tflops`.
"""

from __future__ import annotations

import json
import os
import sys

STATE = os.environ.get("FAKE_NVSMI_DIR", "/etc/fake-nvidia-smi")


def state(name: str, default: str) -> str:
    p = os.path.join(STATE, name)
    if not os.path.exists(p):
        return default
    with open(p) as f:
        return f.read()


def fake_burn(seconds: float) -> int:
    import signal
    import time

    # a load ended by SIGTERM frees the GPU as a real one's end does: the mark goes (the `finally` runs)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    mark = os.path.join(STATE, "burning")
    with open(mark, "w") as f:
        f.write(str(os.getpid()))
    try:
        time.sleep(seconds)
    finally:
        os.unlink(mark)
    print(json.dumps({"tflops": float(state("tflops", "628.97")), "iters": 0, "seconds": seconds, "size": 4096,
                      "dtype": "fp16", "device_name": "FAKE"}))
    return 0


def main(args: list[str]) -> int:
    if args[:1] == ["--fake-burn"]:
        return fake_burn(float(args[1]))
    with open(os.path.join(STATE, "capture.json")) as f:
        capture = json.load(f)
    fields = capture["query_fields"]
    q = [a for a in args if a.startswith("--query-gpu=")]
    if q and q[0].split("=", 1)[1] == capture.get("sample_fields"):
        busy = os.path.exists(os.path.join(STATE, "burning"))
        sys.stdout.write(state("sample-busy", capture["sample_busy"]) if busy else state("sample", capture["sample"]))
    elif q:
        asked = q[0].split("=", 1)[1]
        if asked != fields:
            bad = [x for x in asked.split(",") if x not in fields.split(",")]
            print(f'Field "{bad[0] if bad else asked}" is not a valid field to query.')
            return 2
        sys.stdout.write(state("query", capture["query"]))
    elif "--version" in args:
        sys.stdout.write(capture["version"])
    elif any(a.startswith("--query-compute-apps=") for a in args):
        sys.stdout.write(state("apps", ""))
        # as the real one, which lists only live processes: each line of `apps-live` while its pid lives
        for line in state("apps-live", "").splitlines(keepends=True):
            if os.path.exists(f"/proc/{line.split(',')[0].strip()}"):
                sys.stdout.write(line)
    else:
        print(f'Field "{" ".join(args)}" is not a valid field to query.')
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
