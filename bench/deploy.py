"""(g) `builder deploy`: an unchanged fleet against the preflight audit alone; a 4-host deploy against a
1-host deploy.

The hosts are the test fleet's containers (tests/lib/fleetlib.py: a real sshd and their own dockerd); each
fleet is set up through the real CLI (tests/lib/journeylib.py journey without bundles: lock, image,
keygen), then `builder deploy --fleet F --with-image --with-models` makes, ships, gates, starts and
audits its first release. Every deploy below must end as it should (the benchmark raises otherwise).

1. Unchanged fleet (2 hosts, the shipped `demo` lane, serving): `builder deploy --fleet F` finds
   every host running its bundle and the head answering, and only audits (`--phase all`); against
   `builder audit --fleet F` (`--phase preflight`, the default) of the same fleet, round-robin.
   Target: <= 1.2x.
2. A real deploy, 1 host against 4 hosts (lanes `demo-tp1` and `demo-tp4`: the demo lane's serve
   settings with tensor_parallel = N and demo-tiny only): each run first changes a serve setting
   (`context`, a new value each run) and relocks, so every run makes new bundles, ships them, gates,
   stops, switches, starts (workers, then the head), waits for /health and runs the serving audit;
   timed is the deploy alone. Target: <= 1.5x (hosts work in parallel).

The deploys run with `--stop-timeout 2`, a bound on each stop. start.sh runs the engine under
`docker run --init`, so it gets `docker stop`'s SIGTERM and stops at once; the bound only matters
for an engine that ignores SIGTERM.

The test hosts are containers on this machine: their sshd, python3, docker and the demo engine run on
the operator machine's own cores, which a real fleet runs on its Sparks.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from bench.audit import _hosts_cpu, _machine_cpu, lane_for
from bench.common import Config, Row, judge, median_interleaved, secs, skipped, wheelhouse, wheels_in_env

NAME = "deploy"
TARGET_NOOP = "<= 1.2"
TARGET_SCALE = "<= 1.5"
SIZES = (1, 4)


def run(cfg: Config) -> list[Row]:
    fig = "deploy of an unchanged fleet vs the preflight audit (wall time)"
    try:
        from tests.lib import fleetlib, journeylib
    except ImportError as e:
        return [skipped(NAME, fig, f"test helpers: {e}", TARGET_NOOP)]
    if not fleetlib.docker_available():
        return [skipped(NAME, fig, "Docker engine not reachable", TARGET_NOOP)]
    if not fleetlib.image_exists(fleetlib.testhost_tag()):
        return [skipped(NAME, fig, f"{fleetlib.testhost_tag()} missing: run tests/fleet/build-testhost.sh",
                        TARGET_NOOP)]
    wheels, why = wheelhouse("demo", cfg.workdir)
    if wheels is None:
        return [skipped(NAME, fig, f"the demo image's wheel: {why}", TARGET_NOOP)]
    work = cfg.workdir / "deploy"
    # every command runs the code of one copy, the first journey's (others may edit this tree meanwhile)
    code = work / "j2" / "project"
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(code)
    try:
        with wheels_in_env(wheels), contextlib.ExitStack() as stack:
            return _measure(cfg, work, code, stack, journeylib)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _first(j: Any) -> list[str]:
    # (a short stop timeout bounds a stop whatever the engine does with SIGTERM)
    args = ["--key", str(j.keys / "builder.key"), "--start-timeout", "120", "--stop-timeout", "2",
            "--checks", str(j.root / "checks")]
    rc, rep = j.deploy(*args, "--with-image", "--with-models")
    if rc != 0 or rep.get("result") != "deployed":
        raise AssertionError(f"first deploy of {j.name}: exit {rc}: {rep.get('reason')}: {j.last_stderr[-800:]}")
    return args


def _measure(cfg: Config, work: Path, code: Path, stack: contextlib.ExitStack[Any], journeylib: Any) -> list[Row]:
    store = work / "store"
    js: dict[int, Any] = {}
    args: dict[int, list[str]] = {}
    for n in (2, *SIZES):
        lane, extra = lane_for(n)
        t = time.perf_counter()
        js[n] = stack.enter_context(journeylib.journey(
            work / f"j{n}", n, lane=lane, name=f"dep{n}", store=store, pins_extra=extra, bundle=False))
        args[n] = _first(js[n])
        sys.stderr.write(f"   {n} host(s), lane {lane}: first deploy done in {time.perf_counter() - t:.0f} s\n")
    ssh = Path(js[2].env["BUILDER_SSH_DIR"])
    rows = _noop(cfg, js[2], args[2], ssh)
    rows += _scale(cfg, js, args)
    return rows


def _noop(cfg: Config, j: Any, args: list[str], ssh: Path) -> list[Row]:
    env = {"BUILDER_SSH_DIR": str(ssh)}

    def deploy() -> None:
        rc, rep = j.deploy(*args, env=env)
        if rc != 0 or rep.get("result") != "unchanged":
            raise AssertionError(f"deploy of an unchanged fleet: exit {rc}: {rep.get('reason')}")

    def audit() -> None:
        rc, rep = j.audit("--checks", str(j.root / "checks"), env=env)
        if rc != 0:
            raise AssertionError(f"preflight audit of a deployed fleet: exit {rc}")

    t = median_interleaved({"deploy": deploy, "audit": audit}, cfg.runs)
    ratio = t["deploy"] / t["audit"]
    return [Row(NAME, "deploy of an unchanged fleet vs the preflight audit (wall time)", secs(t["deploy"]),
                f"audit {secs(t['audit'])}", ratio, TARGET_NOOP, judge(ratio, TARGET_NOOP),
                "2 hosts serving; the deploy finds every host on its bundle and audits --phase all; the audit is "
                "--phase preflight; each command opens its own ssh connections (the default, --ssh-persist 0)",
                {"deploy_s": t["deploy"], "audit_s": t["audit"]})]


_context = itertools.count(5000, 16)


def _scale(cfg: Config, js: dict[int, Any], args: dict[int, list[str]]) -> list[Row]:
    timings: dict[int, list[float]] = {n: [] for n in SIZES}
    cpu: dict[int, list[tuple[float, float]]] = {n: [] for n in SIZES}

    def one(n: int) -> float:
        j = js[n]
        j.set_serve(lane=_lane(j), context=next(_context))  # a new release: new bundles on every host
        m0, h0 = _machine_cpu(), _hosts_cpu(j)
        t = time.perf_counter()
        rc, rep = j.deploy(*args[n])
        dt = time.perf_counter() - t
        m1, h1 = _machine_cpu(), _hosts_cpu(j)
        cpu[n].append((m1 - m0, (h1 - h0) if h0 is not None and h1 is not None else float("nan")))
        if rc != 0 or rep.get("result") != "deployed":
            raise AssertionError(f"deploy of {n} host(s): exit {rc}: {rep.get('reason')}: {j.last_stderr[-800:]}")
        return dt

    for n in SIZES:  # warm-up
        one(n)
        cpu[n].clear()
    for _ in range(cfg.runs):  # round-robin: load from other work hits both sizes alike
        for n in SIZES:
            timings[n].append(one(n))
    t = {n: statistics.median(v) for n, v in timings.items()}
    ratio = t[4] / t[1]
    rows = [Row(NAME, f"deploy {n} host{'s' if n > 1 else ''}, a changed serve setting", secs(t[n]), "", None, "",
                "report", "bundle, stage, gate, stop, switch, start, wait for /health, serving audit",
                {"seconds": t[n], "runs": timings[n]}) for n in SIZES]
    mc = {n: statistics.median(c[0] for c in cpu[n]) for n in SIZES}
    hc = {n: statistics.median(c[1] for c in cpu[n]) for n in SIZES}
    rows.append(Row(NAME, "deploy CPU, 1 host vs 4 hosts (whole machine; the test hosts' part)",
                    f"{mc[4]:.1f} s ({hc[4]:.1f} s)", f"1 host {mc[1]:.1f} s ({hc[1]:.1f} s)", None, "", "report",
                    f"/proc/stat over the deploy, and the host containers' cgroups (sshd, python3, docker, dockerd, "
                    f"the engine): the {os.cpu_count()} cores run the operator side and every test host",
                    {"machine1": mc[1], "machine4": mc[4], "hosts1": hc[1], "hosts4": hc[4]}))
    rows.append(Row(NAME, "deploy 4 hosts vs 1 host (wall time)", secs(t[4]), f"1 host {secs(t[1])}", ratio,
                    TARGET_SCALE, judge(ratio, TARGET_SCALE),
                    "ratio = 4-host deploy / 1-host deploy; each run a new release (relocked), timed the deploy alone",
                    {"t1": t[1], "t4": t[4]}))
    return rows


def _lane(j: Any) -> str:
    text = (j.root / "hosts" / f"{j.name}.toml").read_text()
    return str(tomllib.loads(text)["fleet"]["lane"])
