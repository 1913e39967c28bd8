"""builder/hostcheck.py's BATCH_SCRIPT bounds every fact of a host, the python3 fact scripts too.

Run here as the checks run it on a host (`python3 -I -S -c BATCH_SCRIPT ITEMS SECONDS`), with a bound
of 1 s instead of checklib's 120 s (argv[2] is the bound the checks pass).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from builder import hostcheck as hc


def batch(items: list[object], seconds: float = 1) -> tuple[dict[str, tuple[int, bytes, bytes]], float]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-I", "-S", "-c", hc.BATCH_SCRIPT, json.dumps(items), f"{seconds:g}"],
                       capture_output=True, text=True, check=True, timeout=120)
    return hc.parse_batch(r.stdout), time.monotonic() - start


def gone(pattern: str) -> bool:
    # SIGKILL is sent at once, but a busy machine may take a moment to finish the processes off
    for _ in range(100):
        if not subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.strip():
            return True
        time.sleep(0.1)
    return False


def test_a_fact_script_that_blocks_times_out_and_the_others_come_back(tmp_path: Path) -> None:
    """A read that never returns (a FIFO nobody writes, as a file on a stale NFS mount): its fact
    answers 124 "timed out after 1 s" within the bound, killed with its process group, while a
    FILES_SCRIPT fact and a shell command of the same batch succeed."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights" * 1000)
    # the marker names its processes for pgrep (a duration no other test uses); the fact starts a
    # child of its own, which must go too
    stuck = ("import subprocess, sys  # builder-test-stuck-fact-4711\n"
             "subprocess.Popen(['sleep', '4711'])\n"
             f"open({str(fifo)!r}, 'rb').read()\n")
    items: list[object] = [
        ["py", "stuck", stuck, ""],
        ["py", "files", hc.FILES_SCRIPT, json.dumps({"paths": [str(model)], "hash": True})],
        "echo fine",
    ]
    got, took = batch(items, 1)
    rc, out, err = got["stuck"]
    assert rc == 124 and out == b"" and err.endswith(b"builder: timed out after 1 s\n"), got["stuck"]
    rc, out, _ = got["files"]
    assert rc == 0 and json.loads(out)[str(model)]["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert got["echo fine"] == (0, b"fine\n", b"")
    assert took < 6, f"the batch took {took:.1f} s with a 1 s bound"
    assert gone("builder-test-stuck-fact-4711") and gone("^sleep 4711$"), "the stuck fact's processes live on"


def test_progress_restarts_a_fact_scripts_bound(tmp_path: Path) -> None:
    """A fact script that reports progress (hostcheck.PROGRESS, as FILES_SCRIPT does per file and per
    8 MiB hashed) runs past the bound for as long as it keeps reporting; the same work without
    reports is killed at the bound."""
    work = "import os, time\n" + hc.PROGRESS + "for _ in range(12):\n    time.sleep(0.25)\n    {}\nprint('done')\n"
    got, _ = batch([["py", "ticks", work.format("tick()"), ""], ["py", "silent", work.format("pass"), ""]], 1)
    assert got["ticks"] == (0, b"done\n", b""), got["ticks"]
    assert got["silent"][0] == 124 and got["silent"][2].endswith(b"builder: timed out after 1 s\n")


def test_files_and_list_scripts_report_progress(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / "d" / str(i)).mkdir(parents=True)
        (tmp_path / "d" / str(i) / "f").write_bytes(b"x" * (9 << 20 if i == 0 else 1))
    paths = [str(tmp_path / "d" / str(i) / "f") for i in range(3)]
    for script, arg, least in [
        (hc.FILES_SCRIPT, json.dumps({"paths": paths, "hash": True}), 3 + 2),  # each file, each 8 MiB
        (hc.LIST_SCRIPT, json.dumps([str(tmp_path / "d")]), 1 + 4),  # the root, each folder
    ]:
        r, w = os.pipe()
        try:
            env = {"PATH": os.environ["PATH"], "BUILDER_PROGRESS_FD": str(w)}
            p = subprocess.run([sys.executable, "-I", "-S", "-c", script, arg], env=env, pass_fds=(w,),
                               capture_output=True, timeout=60, check=True)
            os.close(w)
            w = -1
            ticks = b""
            while chunk := os.read(r, 65536):
                ticks += chunk
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        assert json.loads(p.stdout) and len(ticks) >= least, (script[:40], len(ticks))
    # run on its own (no $BUILDER_PROGRESS_FD), as a check runs it without the batch: no reports
    p = subprocess.run([sys.executable, "-I", "-S", "-c", hc.FILES_SCRIPT, json.dumps({"paths": paths})],
                       env={"PATH": os.environ["PATH"]}, capture_output=True, timeout=60, check=True)
    assert set(json.loads(p.stdout)) == set(paths) and p.stderr == b""
