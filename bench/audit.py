"""(d) `builder audit` wall time over 1, 2, 4 and 8 test hosts holding a correct install; the audit's
host-side model hashing.

The hosts are the test fleet's containers (tests/lib/fleetlib.py: a real sshd and their own dockerd) and
the install is the operator's journey through the real CLI (tests/lib/journeylib.py journey: lock, fetch,
image, keygen, bundle --with-image --with-models, ship to every host). Every command runs the code
of one copy of the project (the first journey's, on PYTHONPATH), so edits to this tree during the
run do not mix versions. Each size is its own fleet with a lane whose tensor_parallel is the host
count: the shipped `demo` lane for 2 hosts, and for the others a lane `demo-tpN` added to the
journey's project copy before the lock (the demo lane's serve settings, tensor_parallel = N,
models = ["demo-tiny"]). The four fleets (15 hosts) run side by side and share one store, so the
demo image is built once; every audit is then round-robin over the sizes and ways, so load from
other work hits them alike.

Every audit must pass (exit 0, no check failing): the benchmark raises, naming the failing checks,
if one does not. Measured twice: `--phase preflight` (the default) on the installed hosts before
start, and `--phase all` (preflight and the serving checks: health, a one-token completion) after
every journey's `start()`.

Two ways, each with its own folder of ssh connections ($BUILDER_SSH_DIR):
- kept (`--ssh-persist 600`): each audit reuses the connections the one before it left open, as an
  operator's repeated audits with `--ssh-persist N` do; the warm-up run opens them. 600 s, not 60:
  a round-robin pass over the eight audits can take more than a minute on a loaded machine, and a
  lapsed connection would turn the next "kept" audit into a first contact.
- first contact (`--ssh-persist 0`, the default): every audit opens (ssh key exchange and
  login) and closes its connection to every host.

The test hosts are containers on this machine, so their sshd, python3 and docker CLI run on the
same cores as the audit. Beside the wall times the benchmark reports where the CPU went: per host
added on the operator's side (a cgroup holding the audit's whole process tree: the hosts' pytest,
the ssh clients and masters; RUSAGE_CHILDREN, which misses what was put in the background, where no
cgroup can be made); per host on the
test hosts' side (their containers' cgroups: sshd, the batch's python3, the docker CLI and the host's
own dockerd), which a real fleet runs on its Sparks; per host added on the whole machine
(/proc/stat: both, the kernel, and whatever else runs here); and the memory the test hosts use.

The second part runs the script the audit's model check runs on each host (builder/hostscripts/filefacts.py,
full mode, 4 threads) here, over the benchmark's model folder, against openssl dgst and
sha256sum on the same files.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    REPO,
    Config,
    GiB,
    MiB,
    Row,
    gib_s,
    have,
    judge,
    median_interleaved,
    secs,
    skipped,
    warm,
    wheelhouse,
    wheels_in_env,
)
from bench.data import model_folder
from builder.hostscripts import FILES as FILES_SCRIPT

NAME = "audit"
SIZES = (1, 2, 4, 8)
TARGET = "<= 2"

#: the two ways, each one's extra arguments. Kept for 600 s, not 60: one round-robin pass over the 8
#: audits can take over a minute on a loaded machine, and a lapsed connection would make the next
#: "kept" audit a first contact.
WAYS: dict[str, list[str]] = {"kept": ["--ssh-persist", "600"], "first contact": ["--ssh-persist", "0"]}
#: the two phases: before start (the default) and after start
PHASES: dict[str, list[str]] = {"preflight": [], "all": ["--phase", "all"]}
#: stop before starting more hosts when the machine has less memory than this left
MIN_AVAILABLE = 3 * GiB


def run(cfg: Config) -> list[Row]:
    return _fleet(cfg) + _host_hashing(cfg)


def lane_for(n: int) -> tuple[str, str]:
    """(lane name, pins.toml text to add) for n hosts: the shipped demo lane when its tensor_parallel
    is n, else `demo-tpN`, the demo lane with tensor_parallel = N and demo-tiny only."""
    shipped = tomllib.loads((REPO / "pins.toml").read_text())["lanes"]["demo"]
    if shipped["serve"].get("tensor_parallel") == n:
        return "demo", ""
    name = f"demo-tp{n}"
    lane = dict(shipped, models=["demo-tiny"], serve=dict(shipped["serve"], tensor_parallel=n))
    lane["mounts"] = [m for m in shipped.get("mounts", []) if m["source"] in ("model:demo-tiny",)]
    return name, _table(f"lanes.{name}", lane)


def _value(v: Any) -> str:
    """A TOML value: JSON's spelling of strings, numbers and lists; inline tables for dicts."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return json.dumps(v)


def _table(header: str, values: dict[str, Any]) -> str:
    """A TOML table of plain values (strings, numbers, booleans, lists, inline tables) and sub-tables."""
    text = f"\n[{header}]\n"
    subs = ""
    for k, v in values.items():
        if isinstance(v, dict) and k not in ("ready", "options"):
            subs += _table(f"{header}.{k}", v)
        else:
            text += f"{k} = {_value(v)}\n"
    return text + subs


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _fleet(cfg: Config) -> list[Row]:
    fig = "audit 8 hosts vs 1 host (wall time)"
    try:
        from tests.lib import fleetlib, journeylib
    except ImportError as e:
        return [skipped(NAME, fig, f"test helpers: {e}", TARGET)]
    if not fleetlib.docker_available():
        return [skipped(NAME, fig, "Docker engine not reachable", TARGET)]
    if not fleetlib.image_exists(fleetlib.testhost_tag()):
        return [skipped(NAME, fig, f"{fleetlib.testhost_tag()} missing: run tests/fleet/build-testhost.sh",
                        TARGET)]
    # the journeys build the demo image, which needs the ziglang wheel (journeylib reads the
    # wheelhouse from BUILDER_WHEELHOUSE)
    wheels, why = wheelhouse("demo", cfg.workdir)
    if wheels is None:
        return [skipped(NAME, fig, f"the demo image's wheel: {why}", TARGET)]
    work = cfg.workdir / "audit"
    store = work / "store"
    # Other work may edit this tree while the benchmark runs: every journey and audit runs the code
    # of one copy, the first journey's (PYTHONPATH ahead of the editable install, and its checks/).
    code = work / f"j{SIZES[0]}" / "project"
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(code)
    try:
        with wheels_in_env(wheels), contextlib.ExitStack() as stack:
            return _measure(cfg, work, store, code, stack, journeylib, fleetlib)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _measure(cfg: Config, work: Path, store: Path, code: Path, stack: contextlib.ExitStack[Any],
             journeylib: Any, fleetlib: Any) -> list[Row]:
    groups: dict[tuple[str, int], _CpuGroup | None] = {}
    for w in WAYS:
        for n in SIZES:
            g = groups[(w, n)] = _CpuGroup.make(f"builder-bench-{os.getpid()}-{w.replace(' ', '-')}-{n}")
            if g is not None:
                stack.callback(g.remove)  # last in, first out: after the fleets and connections went
    js: dict[int, Any] = {}
    for n in SIZES:
        if _mem_available() < MIN_AVAILABLE:
            raise RuntimeError(f"only {_mem_available() / GiB:.1f} GiB of memory left before starting "
                               f"{n} more test hosts")
        lane, extra = lane_for(n)
        t = time.perf_counter()
        js[n] = stack.enter_context(journeylib.journey(
            work / f"j{n}", n, lane=lane, name=f"bench{n}", store=store, pins_extra=extra))
        sys.stderr.write(f"   {n} host(s), lane {lane}: installed by the CLI in {time.perf_counter() - t:.0f} s\n")
    # unix socket paths are short: the connection folders live in /tmp; closed (callbacks run
    # first, last in first out) before the fleets go
    folders = {w: Path(tempfile.mkdtemp(prefix="bB-", dir="/tmp")) for w in WAYS}
    for f in folders.values():
        stack.callback(fleetlib.close_kept_connections, f)
    mem = {"installed": (_hosts_memory(js), _mem_available())}
    rows = _phase(cfg, "preflight", js, folders, groups, code, journeylib.failing)
    for n in SIZES:
        js[n].start()
    mem["serving"] = (_hosts_memory(js), _mem_available())
    rows += _phase(cfg, "all", js, folders, groups, code, journeylib.failing)
    mem["after"] = (_hosts_memory(js), _mem_available())
    (h0, a0), (h1, a1) = mem["installed"], max(mem["serving"], mem["after"])
    rows.append(Row(NAME, f"test hosts' memory ({sum(SIZES)} hosts, each with its own dockerd)",
                    f"{h1 / MiB:.0f} MiB", "", None, "", "report",
                    f"docker stats of the host containers: {h0 / MiB:.0f} MiB installed, {h1 / MiB:.0f} MiB "
                    f"serving; the machine's MemAvailable {a0 / GiB:.1f} GiB, then {a1 / GiB:.1f} GiB",
                    {"installed": h0, "serving": h1, "available_installed": a0, "available_serving": a1}))
    return rows


def _hosts_memory(js: dict[int, Any]) -> int:
    return sum(sum(j.fleet.memory().values()) for j in js.values())


def _phase(cfg: Config, phase: str, js: dict[int, Any], folders: dict[str, Path],
           groups: dict[tuple[str, int], _CpuGroup | None], code: Path,
           failing: Callable[[dict[str, Any]], set[tuple[str, str]]]) -> list[Row]:
    opts = ["--checks", str(code / "checks"), "--connect-timeout", "10"]
    fns = {(w, n): _Audit(js[n], phase, [*PHASES[phase], *extra, *opts], folders[w], groups[(w, n)], failing)
           for w, extra in WAYS.items() for n in SIZES}
    # warm-up (median_interleaved runs each once first): ssh host keys, python caches on the hosts,
    # the kept connections
    t = median_interleaved({f"{w}/{n}": fns[(w, n)] for w in WAYS for n in SIZES}, cfg.runs)
    rows = []
    for w in WAYS:
        rows += _rows(phase, w, {n: t[f"{w}/{n}"] for n in SIZES}, {n: fns[(w, n)] for n in SIZES})
    return rows


def _rows(phase: str, way: str, t: dict[int, float], fns: dict[int, _Audit]) -> list[Row]:
    rows = []
    how = "connections kept" if way == "kept" else "first contact"
    what = "preflight" if phase == "preflight" else "--phase all, serving"
    for n in SIZES:
        rows.append(Row(NAME, f"audit {n} host{'s' if n > 1 else ''}, {what} ({how})", secs(t[n]), "", None, "",
                        "report", f"exit 0 every run; {fns[n].summary}",
                        {"seconds": t[n], "hosts": n, "way": way, "phase": phase}))
    ratio = t[8] / t[1]
    note = ("each audit reuses the ssh connections the one before it left open (--ssh-persist 600)"
            if way == "kept" else "every audit opens and closes its ssh connections (--ssh-persist 0)")
    x1, x8 = fns[1].others_median(), fns[8].others_median()
    rows.append(Row(NAME, f"{fig_ratio(phase)}, {how}", secs(t[8]), f"1 host {secs(t[1])}", ratio, TARGET,
                    judge(ratio, TARGET), f"ratio = 8-host time / 1-host time; {note}; hosts hold a correct install; "
                    f"other work took {x1:.0%} of the machine during the 1-host audits, {x8:.0%} during the 8-host",
                    {"t1": t[1], "t8": t[8], "way": way, "phase": phase, "others1": x1, "others8": x8}))
    (o1, h1, m1), (o8, h8, m8) = fns[1].cpu_medians(), fns[8].cpu_medians()
    tree = ("its cgroup: the audit's whole process tree, ssh masters included" if fns[1].group
             else "RUSAGE_CHILDREN: the audit's process tree, without the backgrounded ssh masters")
    rows.append(Row(NAME, f"audit CPU per added host, {what}, {how}: operator side", f"{(o8 - o1) / 7:.3f} s", "",
                    None, "", "report", f"{tree}: {o1:.2f} s of CPU for 1 host, {o8:.2f} s for 8",
                    {"cpu1": o1, "cpu8": o8, "way": way, "phase": phase}))
    rows.append(Row(NAME, f"audit CPU per host, {what}, {how}: test host side", f"{h8 / 8:.3f} s", "",
                    None, "", "report", f"the host containers' cgroups (sshd, python3, docker CLI, their dockerd): "
                    f"{h1:.2f} s for 1 host, {h8:.2f} s for 8", {"cpu1": h1, "cpu8": h8, "way": way, "phase": phase}))
    rows.append(Row(NAME, f"audit CPU per added host, {what}, {how}: whole machine", f"{(m8 - m1) / 7:.3f} s", "",
                    None, "", "report", f"/proc/stat, test hosts included: {m1:.2f} s for 1 host, {m8:.2f} s for 8",
                    {"cpu1": m1, "cpu8": m8, "way": way, "phase": phase}))
    return rows


def fig_ratio(phase: str) -> str:
    return "audit 8 hosts vs 1 host (wall time)" + ("" if phase == "preflight" else ", --phase all")


class _CpuGroup:
    """A cgroup (v1 cpuacct) the audit runs in, so that its whole process tree is counted, the ssh
    masters too: `ssh -f` puts them in the background, out of reach of RUSAGE_CHILDREN. The bench
    process enters it for the audit's duration (a child starts in its parent's group) and leaves it
    after. One group per (way, size): a kept master stays in the group of the audit that opened it."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def make(cls, name: str) -> _CpuGroup | None:
        try:
            home = next(ln.split(":", 2)[2] for ln in Path("/proc/self/cgroup").read_text().splitlines()
                        if ln.split(":")[1].split(",").count("cpuacct"))
            path = cls.ROOT / home.lstrip("/") / name
            path.mkdir()
        except (OSError, StopIteration, IndexError):
            return None
        return cls(path)

    def usage(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def leave(self) -> None:
        (self.path.parent / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        """Move what is left (nothing, once the masters are closed) to the parent, then remove it."""
        with contextlib.suppress(OSError):
            for pid in (self.path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (self.path.parent / "cgroup.procs").write_text(pid)
            self.path.rmdir()


def _hosts_cpu(j: Any) -> float | None:
    """CPU seconds the journey's host containers have used so far (their cgroups: v1 cpuacct or v2
    cpu.stat), or None where neither can be read."""
    total = 0.0
    for h in j.fleet.hosts:
        v1 = Path(f"/sys/fs/cgroup/cpuacct/docker/{h.container}/cpuacct.usage")
        v2 = Path(f"/sys/fs/cgroup/system.slice/docker-{h.container}.scope/cpu.stat")
        try:
            if v1.is_file():
                total += int(v1.read_text()) / 1e9
            else:
                usage = next(ln for ln in v2.read_text().splitlines() if ln.startswith("usage_usec"))
                total += int(usage.split()[1]) / 1e6
        except (OSError, StopIteration, ValueError):
            return None
    return total


def _machine_cpu() -> float:
    """Busy CPU seconds of the whole machine so far (every core; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


class _Audit:
    """One audit of one journey's fleet (`Journey.audit`: `builder audit --fleet NAME --json`), which
    must pass; records its CPU (the audit's own, the test hosts', the whole machine's) and the checks'
    count."""

    def __init__(self, j: Any, phase: str, args: list[str], ssh_dir: Path, group: _CpuGroup | None,
                 failing: Callable[[dict[str, Any]], set[tuple[str, str]]]) -> None:
        self.j, self.phase, self.args, self.ssh_dir, self.failing = j, phase, args, ssh_dir, failing
        self.group = group
        self.cpu: list[tuple[float, float, float]] = []
        self.others: list[float] = []  # share of the machine's CPU other work took, per audit
        self.summary = ""

    def __call__(self) -> None:
        g = self.group
        r0, m0, h0 = resource.getrusage(resource.RUSAGE_CHILDREN), _machine_cpu(), _hosts_cpu(self.j)
        g0 = g.usage() if g else 0.0
        t0 = time.perf_counter()
        if g:
            g.enter()
        try:
            rc, report = self.j.audit(*self.args, env={"BUILDER_SSH_DIR": str(self.ssh_dir)})
        finally:
            if g:
                g.leave()
        wall = time.perf_counter() - t0
        r1, m1, h1 = resource.getrusage(resource.RUSAGE_CHILDREN), _machine_cpu(), _hosts_cpu(self.j)
        own = g.usage() - g0 if g else r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
        hosts = h1 - h0 if h0 is not None and h1 is not None else float("nan")
        self.cpu.append((own, hosts, m1 - m0))
        # what else ran on the machine meanwhile: its busy CPU less the audit's and the hosts'
        ours = own + (hosts if h0 is not None and h1 is not None else 0.0)
        self.others.append(max(0.0, m1 - m0 - ours) / (wall * (os.cpu_count() or 1)))
        bad = self.failing(report)
        if rc != 0 or bad:
            detail = {f"{h}/{c}": report["hosts"][h]["checks"][c].get("message", "") for h, c in sorted(bad)}
            msgs = {h: hr.get("message", "") for h, hr in report.get("hosts", {}).items() if hr.get("message")}
            raise AssertionError(
                f"builder audit {' '.join(self.args)} of {len(self.j.fleet.hosts)} correctly installed host(s) "
                f"did not pass: exit {rc}; failing: {json.dumps(detail)[:1500]}; hosts: {json.dumps(msgs)[:600]}; "
                f"stderr: {self.j.last_stderr.strip()[-600:]}")
        counts: dict[str, int] = {}
        for h in report.get("hosts", {}).values():
            for c in h.get("checks", {}).values():
                counts[c["status"]] = counts.get(c["status"], 0) + 1
        self.summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))

    def others_median(self) -> float:
        return statistics.median(self.others[1:])

    def cpu_medians(self) -> tuple[float, float, float]:
        """Medians of (operator side, test hosts' side, whole machine), warm-up left out."""
        got = self.cpu[1:]
        return (statistics.median(c[0] for c in got), statistics.median(c[1] for c in got),
                statistics.median(c[2] for c in got))


def _host_hashing(cfg: Config) -> list[Row]:
    mf = model_folder(cfg)
    warm(mf.paths)
    paths = [str(p) for p in mf.paths]
    req = json.dumps({"paths": paths, "hash": True, "jobs": 4})

    def script() -> None:
        argv = [sys.executable, "-I", "-S", "-c", FILES_SCRIPT, req]  # as a host runs it
        out = subprocess.run(argv, check=True, capture_output=True).stdout
        got = json.loads(out)
        assert all(got[str(mf.root / n)].get("sha256") == d for n, _, d in mf.entries)

    fns: dict[str, Callable[[], object]] = {"audit": script}
    if have("openssl"):
        fns["openssl"] = lambda: subprocess.run(["openssl", "dgst", "-sha256", *paths], check=True,
                                                stdout=subprocess.DEVNULL)
    if have("sha256sum"):
        fns["sha256sum"] = lambda: subprocess.run(["sha256sum", *paths], check=True, stdout=subprocess.DEVNULL)
    t = median_interleaved(fns, cfg.runs)
    rows = []
    for tool in ("openssl", "sha256sum"):
        fig = f"audit full-mode model hashing (host script) vs {tool}"
        if tool not in t:
            rows.append(skipped(NAME, fig, f"{tool} not installed"))
            continue
        ratio = t[tool] / t["audit"]
        rows.append(Row(NAME, fig, gib_s(mf.total, t["audit"]), gib_s(mf.total, t[tool]), ratio, "", "report",
                        "builder/hostscripts/filefacts.py run locally (what each host runs in --mode full)",
                        {"audit_s": t["audit"], f"{tool}_s": t[tool], "bytes": mf.total}))
    return rows
