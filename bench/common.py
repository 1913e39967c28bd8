"""Shared pieces of the benchmarks: the result row, timing as medians, child memory, test data."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GiB = 1024**3
MiB = 1024**2


@dataclass
class Config:
    workdir: Path
    quick: bool = False
    runs: int = 5

    def n(self, full: int | None = None) -> int:
        """Runs for one figure: --runs (at least 5 unless --quick)."""
        return self.runs if full is None else min(self.runs, full)


@dataclass
class Row:
    """One figure. ratio is oriented so that the target reads "ratio >= x" or "ratio <= x"."""

    bench: str
    figure: str
    builder: str = ""
    standard: str = ""
    ratio: float | None = None
    target: str = ""
    status: str = "report"  # pass | fail | report | skipped | error
    note: str = ""
    values: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge(ratio: float | None, target: str) -> str:
    """pass/fail from a target like ">= 1.7" or "<= 0.5"; report when there is none."""
    if ratio is None or not target:
        return "report"
    op, _, num = target.partition(" ")
    want = float(num.rstrip("xs MiB"))
    ok = ratio >= want if op == ">=" else ratio <= want
    return "pass" if ok else "fail"


def skipped(bench: str, figure: str, reason: str, target: str = "") -> Row:
    return Row(bench=bench, figure=figure, target=target, status="skipped", note=f"skipped: {reason}")


def median_time(fn: Callable[[], Any], runs: int, warmup: int = 0) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def median_interleaved(fns: dict[str, Callable[[], Any]], runs: int, warmup: int = 1) -> dict[str, float]:
    """Medians of several contenders run round-robin (A B A B ...), so a noisy neighbour or the page
    cache drifting hits each of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def run(argv: Sequence[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
        check: bool = True, stdin: Any = None, stdout: Any = subprocess.DEVNULL) -> int:
    p = subprocess.run(list(argv), cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv[:3]))}: exit {p.returncode}: "
                           f"{p.stderr.decode(errors='replace').strip()[-300:]}")
    return p.returncode


def run_measured(argv: Sequence[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
                 ) -> tuple[int, float, int, str]:
    """Run a child; return (exit code, wall seconds, peak RSS in bytes of that child, stderr tail).

    Peak RSS is the child's ru_maxrss. A forked child starts with its parent's resident pages, and
    ru_maxrss keeps that high-water mark across exec, so the child is started by GNU time (a small
    process) and its %M is read; without /usr/bin/time, wait4()'s rusage of the direct child is used
    (an upper bound: it includes this process's RSS at the fork).
    """
    gnu_time = Path("/usr/bin/time")
    rss_file = None
    cmd = list(argv)
    if gnu_time.is_file():
        fd, rss_file = tempfile.mkstemp(prefix="rss-")
        os.close(fd)
        cmd = [str(gnu_time), "-f", "%M", "-o", rss_file, *cmd]
    t = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert p.stderr is not None
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    p.returncode = os.waitstatus_to_exitcode(status)
    rss = ru.ru_maxrss * 1024
    if rss_file is not None:
        try:
            lines = Path(rss_file).read_text().split()
            if lines and lines[-1].isdigit():
                rss = int(lines[-1]) * 1024
        finally:
            os.unlink(rss_file)
    return p.returncode, wall, rss, err.decode(errors="replace").strip()[-300:]


def builder_argv() -> list[str]:
    """How a user runs builder: the installed console script when it is there, else python -m builder."""
    exe = Path(sys.executable).parent / "builder"
    if exe.is_file() and os.access(exe, os.X_OK):
        return [str(exe)]
    return [sys.executable, "-m", "builder"]


def have(tool: str) -> bool:
    return shutil.which(tool) is not None


def write_data_file(path: Path, size: int, seed: int) -> None:
    """size bytes of incompressible data (like model weights), fast: a 16 MiB random block, each copy
    with its own 16-byte prefix so no two chunks or files are equal."""
    block = bytearray(os.urandom(16 * MiB))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left, i = size, 0
        while left > 0:
            block[:16] = seed.to_bytes(8, "little") + i.to_bytes(8, "little")
            n = min(left, len(block))
            f.write(memoryview(block)[:n])
            left -= n
            i += 1


def warm(paths: Sequence[Path]) -> None:
    """Read files once so the page cache holds them (the benchmarks measure a warm cache)."""
    buf = bytearray(8 * MiB)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def gib_s(nbytes: int, seconds: float) -> str:
    return f"{nbytes / GiB / seconds:.2f} GiB/s" if seconds > 0 else "inf"


def secs(s: float) -> str:
    if s < 0.01:
        return f"{s * 1000:.2f} ms"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def wheelhouse(image_name: str, workdir: Path) -> tuple[Path | None, str]:
    """A folder holding every wheel `builder image IMAGE` builds with on this engine (the ziglang wheel
    of the demo image), for BUILDER_WHEELHOUSE; or (None, why not).

    Looked for, by the locked file name and checked against the locked sha256: in the folders
    BUILDER_WHEELHOUSE names and the project's .cache/wheelhouse (where .ci/run puts it); in the
    project's store (.cache/builder, or $BUILDER_STORE), where the README's `builder image demo`
    left it; else downloaded with `pip download` into workdir/wheelhouse (PyPI, or pip's own cache of
    the wheel `pip install -e '.[dev]'` installed). The files are linked into workdir/wheelhouse.
    """
    # read the files themselves (not builder's loaders): the benchmark needs two fields of each
    try:
        img = tomllib.loads((REPO / "pins.toml").read_text())["images"][image_name]
        lock = json.loads((REPO / "pins.lock").read_text())
    except (OSError, ValueError, KeyError) as e:
        return None, f"pins.toml/pins.lock, image {image_name}: {type(e).__name__}: {str(e)[:120]}"
    p = subprocess.run(["docker", "version", "--format", "{{json .Server}}"], capture_output=True, text=True)
    try:
        srv = json.loads(p.stdout)
        engine = f"{srv['Os']}/{srv['Arch']}"
    except (ValueError, KeyError, TypeError):
        return None, "no Docker engine reachable (its platform picks the wheel)"
    out = workdir / "wheelhouse"
    out.mkdir(parents=True, exist_ok=True)
    folders = [Path(x) for x in os.environ.get("BUILDER_WHEELHOUSE", "").split(os.pathsep) if x]
    folders.append(REPO / ".cache" / "wheelhouse")
    stores = [Path(os.environ["BUILDER_STORE"])] if os.environ.get("BUILDER_STORE") else []
    stores.append(REPO / ".cache" / "builder")

    def sha256(path: Path) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(4 * MiB):
                h.update(chunk)
        return h.hexdigest()

    for tname in img.get("toolchains", []):
        lt = lock.get("toolchains", {}).get(tname)
        if lt is None:
            return None, f"toolchains.{tname}: not in pins.lock (run `builder lock --offline {image_name}`)"
        if lt.get("kind") != "wheel":
            continue
        art = lt.get("platforms", {}).get(engine) or lt.get("platforms", {}).get(img.get("platform"))
        if not art or not art.get("filename") or not art.get("sha256"):
            return None, f"toolchains.{tname}: no wheel for {engine} in the lock"
        filename, want = art["filename"], art["sha256"]
        dest = out / filename
        cands = [f / filename for f in folders] + [s / "objects" / want for s in stores]
        for c in cands:
            if c.is_file() and sha256(c) == want:
                dest.unlink(missing_ok=True)
                dest.symlink_to(c.resolve())
                break
        else:
            # the wheel's name is package-version-python-abi-platform.whl; pip wants one platform tag
            package, version = filename.split("-")[:2]
            plat = filename[:-4].split("-")[-1].split(".")[0]
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--platform", plat, "-d", str(out), f"{package}=={version}"]
            sys.stderr.write(f"   {filename}: not in a wheelhouse or the store; {' '.join(cmd[2:])}\n")
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            except subprocess.TimeoutExpired:
                return None, f"pip download {package}=={version}: timed out"
            if r.returncode != 0 or not dest.is_file():
                err = r.stderr.strip()[-160:] or f"no {filename}"
                return None, f"pip download {package}=={version}: {err}"
            if sha256(dest) != want:
                return None, f"{filename}: pip's copy does not match the locked sha256"
    return out, ""


@contextmanager
def wheels_in_env(folder: Path | None) -> Iterator[None]:
    """BUILDER_WHEELHOUSE with `folder` added in front for the duration (the builds and the journeys
    of a benchmark read it from the environment)."""
    saved = os.environ.get("BUILDER_WHEELHOUSE")
    if folder is not None:
        os.environ["BUILDER_WHEELHOUSE"] = os.pathsep.join([str(folder), *([saved] if saved else [])])
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("BUILDER_WHEELHOUSE", None)
        else:
            os.environ["BUILDER_WHEELHOUSE"] = saved
