"""(d) `builder audit` wall time over 1, 2, 4 and 8 test hosts; the audit's host-side model hashing.

The hosts are the test fleet's containers with a real sshd (tests/fleetlib.py start_fleet, without
their own dockerd to spare this 2-core machine), on a private Docker network. Each size gets its own
small project (tests/auditlib.py make_project with tensor_parallel = N) and fleet file. The hosts
hold no release, so the audit reports drift (exit 1): the time is the real cost of connecting to
every host (one ssh connection per host, shared by every command), reading its facts (one remote
call, checks/checklib.py prefetch) and running every preflight check.

Two ways, each with its own folder of ssh connections ($BUILDER_SSH_DIR), all runs round-robin:
- kept (the default, `--ssh-persist 60`): each audit reuses the connections the one before it
  left open, as an operator's repeated audits do; the warm-up run opens them.
- first contact (`--ssh-persist 0`): every audit opens (ssh key exchange and login) and closes its
  connection to every host.

The test hosts are containers on this machine, so their sshd, python3 and docker CLI run on the
same 2 cores as the audit. Beside the wall times the benchmark reports where the CPU went, per host
added: on the operator's side (the audit's own process tree: pytest, ssh clients) and on the whole
machine (/proc/stat: that plus the hosts' side and the kernel).

The second part runs the script the audit's model check runs on each host (builder.hostcheck
FILES_SCRIPT, full mode, 4 threads) here, over the benchmark's model folder, against openssl dgst and
sha256sum on the same files.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    REPO,
    Config,
    Row,
    builder_argv,
    gib_s,
    have,
    judge,
    median_interleaved,
    secs,
    skipped,
    warm,
)
from bench.data import model_folder

NAME = "audit"
SIZES = (1, 2, 4, 8)
TARGET = "<= 2"


def run(cfg: Config) -> list[Row]:
    return _fleet(cfg) + _host_hashing(cfg)


#: the two ways, each one's extra arguments
WAYS = {"kept": [], "first contact": ["--ssh-persist", "0"]}


def _fleet(cfg: Config) -> list[Row]:
    fig = "audit 8 hosts vs 1 host (wall time)"
    sys.path.insert(0, str(REPO / "tests"))
    try:
        import auditlib
        import fleetlib
    except ImportError as e:
        return [skipped(NAME, fig, f"test helpers: {e}", TARGET)]
    if not fleetlib.docker_available():
        return [skipped(NAME, fig, "Docker engine not reachable", TARGET)]
    if not fleetlib.image_exists(fleetlib.testhost_tag()):
        return [skipped(NAME, fig, f"{fleetlib.testhost_tag()} missing: run tests/fleet/build-testhost.sh",
                        TARGET)]
    import tempfile

    from builder.imagerecord import ImageRecord, tag_for, write_record

    work = cfg.workdir / "audit"
    fleet = fleetlib.start_fleet(max(SIZES), work / "fleet", dockerd=False, build=False)
    images: list[str] = []
    # unix socket paths are short: the connection folders live in /tmp
    folders = {w: Path(tempfile.mkdtemp(prefix="bB-", dir="/tmp")) for w in WAYS}
    try:
        fns = {}
        for n in SIZES:
            paths = auditlib.make_project(work / f"proj{n}", tp=n)
            addr = auditlib.plan_address(paths)
            labels = {"org.builder.lane": "demo", "org.builder.input-address": addr}
            image_id = fleetlib.tiny_image(f"builder-bench-audit:{n}-{os.getpid()}",
                                           files={"/etc/demo": b"bench\n"}, labels=labels)
            images.append(image_id)
            write_record(paths["store"], ImageRecord(
                name="demo", input_address=addr, image_id=image_id, diff_ids=[], tag=tag_for("demo", addr),
                lock_hash="0" * 64, platform="linux/arm64", source_date_epoch=0, labels=labels))
            hosts = [{"name": h.name, "ssh": h.name, "rank": i, "role": "head" if i == 0 else "worker"}
                     for i, h in enumerate(fleet.hosts[:n])]
            (paths["hosts"] / "bench.toml").write_text(
                auditlib.fleet_toml("bench", hosts, ssh_config=str(fleet.plain_ssh_config)))
            base = [*builder_argv(), "--pins", str(paths["pins"]), "--store", str(paths["store"]), "audit",
                    "--fleet", "bench", "--json", "--checks", str(REPO / "checks"), "--connect-timeout", "10"]
            for w, extra in WAYS.items():
                fns[(w, n)] = _audit_fn(base + extra, {"BUILDER_SSH_DIR": str(folders[w])})
        # warm-up: ssh host keys, python caches on the hosts, the kept connections
        t = median_interleaved({f"{w}/{n}": fns[(w, n)] for w in WAYS for n in SIZES}, cfg.runs)
        rows = []
        for w in WAYS:
            rows += _rows(w, fig, {n: t[f"{w}/{n}"] for n in SIZES}, {n: fns[(w, n)] for n in SIZES})
        return rows
    finally:
        for f in folders.values():
            fleetlib.close_kept_connections(f)
        fleet.teardown()
        for img in images:
            subprocess.run(["docker", "rmi", "-f", img], capture_output=True)


def _rows(way: str, fig: str, t: dict[int, float], fns: dict[int, _audit_fn]) -> list[Row]:
    rows = []
    how = "connections kept" if way == "kept" else "first contact"
    cpu = {n: _cpu_medians(tuple(fns[n].argv)) for n in SIZES}
    for n in SIZES:
        key = tuple(fns[n].argv)
        codes = sorted(_CODES.get(key, set()))
        rows.append(Row(NAME, f"audit {n} host{'s' if n > 1 else ''} ({how})", secs(t[n]), "", None, "",
                        "report", f"exit {codes}; {_SUMMARY.get(key, '')}", {"seconds": t[n], "hosts": n, "way": way}))
    ratio = t[8] / t[1]
    note = ("each audit reuses the ssh connections the one before it left open (--ssh-persist, the default)"
            if way == "kept" else "every audit opens and closes its ssh connections (--ssh-persist 0)")
    rows.append(Row(NAME, f"{fig}, {how}", secs(t[8]), f"1 host {secs(t[1])}", ratio, TARGET, judge(ratio, TARGET),
                    f"ratio = 8-host time / 1-host time; {note}; hosts hold no release, so checks report drift",
                    {"t1": t[1], "t8": t[8], "way": way}))
    (o1, m1), (o8, m8) = cpu[1], cpu[8]
    rows.append(Row(NAME, f"audit CPU per added host, {how}: operator side", f"{(o8 - o1) / 7:.3f} s", "", None,
                    "", "report", f"the audit's process tree: {o1:.2f} s of CPU for 1 host, {o8:.2f} s for 8",
                    {"cpu1": o1, "cpu8": o8, "way": way}))
    rows.append(Row(NAME, f"audit CPU per added host, {how}: whole machine", f"{(m8 - m1) / 7:.3f} s", "", None,
                    "", "report", f"/proc/stat, test hosts included: {m1:.2f} s for 1 host, {m8:.2f} s for 8",
                    {"cpu1": m1, "cpu8": m8, "way": way}))
    return rows


_CODES: dict[tuple[str, ...], set[int]] = {}
_SUMMARY: dict[tuple[str, ...], str] = {}
_CPU: dict[tuple[str, ...], list[tuple[float, float]]] = {}


def _machine_cpu() -> float:
    """Busy CPU seconds of the whole machine so far (every core; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _cpu_medians(key: tuple[str, ...]) -> tuple[float, float]:
    got = _CPU.get(key, [])[1:]  # the first call is the warm-up
    return statistics.median(c[0] for c in got), statistics.median(c[1] for c in got)


class _audit_fn:  # noqa: N801 - a callable with its argv attached
    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv = argv
        self.env = env

    def __call__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), **self.env)
        r0, m0 = resource.getrusage(resource.RUSAGE_CHILDREN), _machine_cpu()
        p = subprocess.run(self.argv, capture_output=True, text=True, env=env, timeout=600)
        r1, m1 = resource.getrusage(resource.RUSAGE_CHILDREN), _machine_cpu()
        key = tuple(self.argv)
        own = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
        _CPU.setdefault(key, []).append((own, m1 - m0))
        _CODES.setdefault(key, set()).add(p.returncode)
        if p.returncode not in (0, 1):
            raise RuntimeError(f"builder audit: exit {p.returncode}: {p.stderr.strip()[-300:]}")
        try:
            data: dict[str, Any] = json.loads(p.stdout)
            counts: dict[str, int] = {}
            for h in data.get("hosts", {}).values():
                for c in h.get("checks", {}).values():
                    counts[c["status"]] = counts.get(c["status"], 0) + 1
            _SUMMARY[key] = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        except (ValueError, AttributeError):
            pass


def _host_hashing(cfg: Config) -> list[Row]:
    from builder.hostcheck import FILES_SCRIPT

    mf = model_folder(cfg)
    warm(mf.paths)
    paths = [str(p) for p in mf.paths]
    req = json.dumps({"paths": paths, "hash": True, "jobs": 4})

    def script() -> None:
        out = subprocess.run([sys.executable, "-c", FILES_SCRIPT, req], check=True, capture_output=True).stdout
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
                        "hostcheck.FILES_SCRIPT run locally (what each host runs in --mode full)",
                        {"audit_s": t["audit"], f"{tool}_s": t[tool], "bytes": mf.total}))
    return rows
