"""(l) A model to N hosts through the fleet registry: one pass over a slow uplink, then the hosts pull at
once over the fabric.

Data: a 2 GiB model (4 files of 512 MiB; --quick: 4 x 64 MiB) in a bench project (bench.bundle's) whose
fleet takes its model files from its registry (`models_from = "registry"`); the hosts hold the image
already, so the release is the model.

The fleet: N + 1 test hosts (tests/lib/fleetlib.py) on one private network. The first, the head, runs
Debian's docker-registry (this machine's binary, copied in): TLS from a CA made here on PORT, and a
second process on the same storage serving plain HTTP on PLAIN_PORT, the fabric listener; the N others
receive. The uplink, from the operator (this machine) to the head, is shaped to UPLINK_MBIT by an htb
class on the head's host-side veth that holds only the packets from the operator's address (tc counts
its bytes: frames, headers included); the fabric, host to host, runs at the network's own speed.

For N = 1, 2, 4, from an empty registry:
- push: `builder bundle --fleet --with-models`, which sends each blob the registry lacks, once: its time,
  and the bytes through the uplink class against one copy of the release (the blobs the registry then
  holds, by their sizes; target <= 1.05).
- pull: `builder ship FLEET/HOST` to the N hosts at once, into empty hosts, twice: a fleet whose hosts
  pull from the fabric listener (`fleet.registry_pull`), and one whose hosts pull over TLS
  (`fleet.registry`). Each host's rate is the one its installer reports (`ship --json`: bytes_pulled /
  pull_seconds: four files at a time, each hashed as it arrives and fsynced); the bytes out of the head
  (its interface's tx counter).
- raw TCP: the same blob files, served by busybox httpd on the head (plain HTTP, sendfile), fetched by
  `curl --parallel` (four at a time) on each of the N hosts at once into files on the same disk, then
  `sync` of them; and curl of the same blobs from the registry over TLS (the same CA).
Rounds go TLS pull, plain pull, curl over TLS, raw TCP (medians of --runs, at most 3). Figures: one
host's plain pull rate against raw TCP's (target >= 0.8); N hosts' summed rate against N raw streams'
(>= 0.8); the TLS pull against curl over TLS (a report); and, in the uplink row's note, what shipping
the model over ssh from the operator would put through the same uplink (N copies).
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import ssl
import statistics
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import Config, GiB, MiB, Row, builder_argv, judge, skipped, write_data_file

NAME = "fanout"
UPLINK_MBIT = 1000
COUNTS = (1, 2, 4)
PORT = 5000
PLAIN_PORT = 5001
RAW_PORT = 8000
PLAIN_FLEET = "fanout-plain"
FILES = 4
HOME = "/home/spark"
REG_DIR = "/srv/registry"
FIG_UPLINK = "fleet registry, N hosts: bytes over the uplink / one copy of the release"
FIG_ONE = "fleet registry, 1 host: pull rate over the fabric listener / raw TCP"
FIG_MANY = "fleet registry, N hosts at once: summed pull rate over the fabric listener / N raw TCP streams"
FIG_TLS = "fleet registry over TLS, N hosts at once: summed pull rate / N curls over TLS"
_IMAGES: list[str] = []


def run(cfg: Config) -> list[Row]:
    figures = [FIG_UPLINK, FIG_ONE, FIG_MANY]
    try:
        from tests.lib import fleetlib, registrylib
    except ImportError as e:
        return [skipped(NAME, f, f"test helpers: {e}") for f in figures]
    reg_bin = shutil.which("docker-registry")
    if reg_bin is None:
        return [skipped(NAME, f, "docker-registry not installed") for f in figures]
    if not (fleetlib.docker_available() and fleetlib.image_exists(fleetlib.testhost_tag())):
        return [skipped(NAME, f, "no Docker engine or no test-host image") for f in figures]
    if shutil.which("tc") is None:
        return [skipped(NAME, f, "tc (iproute2) not installed") for f in figures]
    base = cfg.workdir / NAME
    base.mkdir()
    size = (64 if cfg.quick else 512) * MiB
    files = {f"model-{i:05d}-of-{FILES:05d}.safetensors": base / "data" / f"m{i}" for i in range(1, FILES + 1)}
    for i, path in enumerate(files.values()):
        write_data_file(path, size, seed=100 + i)
    try:
        with fleetlib.start_fleet(max(COUNTS) + 1, base / "fleet") as fleet:
            head = fleet.hosts[0]
            ca = _start_head_registry(fleet, head, Path(reg_bin), base / "tls", registrylib)
            veth = _shape_uplink(fleet, head)
            per_n = [_one_fleet(cfg, base / f"n{n}", fleet, n, files, ca, veth) for n in COUNTS]
    finally:
        shutil.rmtree(base, ignore_errors=True)
        for img in _IMAGES:
            subprocess.run(["docker", "rmi", "-f", img], capture_output=True)
    return _rows(per_n, FILES * size)


# ---------------------------------------------------------------- the head and its uplink


def _start_head_registry(fleet: Any, head: Any, reg_bin: Path, tls: Path, registrylib: Any) -> Path:
    """Debian's docker-registry in the head: TLS from a CA made here for the head's address on PORT, and
    a second process on the same storage serving plain HTTP on PLAIN_PORT (the fabric listener that
    `fleet.registry_pull` names); the CA."""
    from tests.lib import fleetlib

    ca, crt, key = registrylib.make_ca(tls, head.ip)
    fleet.exec(head, f"mkdir -p {REG_DIR}")
    fleetlib.docker("cp", str(reg_bin), f"{head.container}:/usr/local/bin/docker-registry")
    for f in (crt, key):
        fleetlib.docker("cp", str(f), f"{head.container}:{REG_DIR}/{f.name}")
    tls_http = {"addr": f"0.0.0.0:{PORT}", "secret": "bench",
                "tls": {"certificate": f"{REG_DIR}/server.crt", "key": f"{REG_DIR}/server.key"}}
    for name, http in (("tls", tls_http), ("plain", {"addr": f"0.0.0.0:{PLAIN_PORT}", "secret": "bench"})):
        config = {"version": 0.1, "log": {"level": "warn", "accesslog": {"disabled": True}},
                  "storage": {"filesystem": {"rootdirectory": f"{REG_DIR}/storage"}}, "http": http}
        fleet.exec(head, f"cat > {REG_DIR}/{name}.json", input=json.dumps(config))
    _restart_registry(fleet, head, ca)
    return ca


def _restart_registry(fleet: Any, head: Any, ca: Path) -> None:
    """The head's registry, empty, both listeners answering /v2/."""
    from tests.lib import fleetlib

    fleet.exec(head, f"pkill -x docker-registry; while pgrep -x docker-registry >/dev/null; do sleep 0.1; done; "
                     f"rm -rf {REG_DIR}/storage", check=False)
    for name in ("tls", "plain"):
        fleetlib.docker("exec", "-d", head.container, "sh", "-c",
                        f"exec /usr/local/bin/docker-registry serve {REG_DIR}/{name}.json >{REG_DIR}/{name}.log 2>&1")
    ctx = ssl.create_default_context(cafile=str(ca))
    for url in (f"https://{head.ip}:{PORT}/v2/", f"http://{head.ip}:{PLAIN_PORT}/v2/"):
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2, context=ctx if url.startswith("https") else None):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    log = fleet.exec(head, f"cat {REG_DIR}/*.log", check=False).stdout
                    raise RuntimeError(f"the head's registry did not start: {log.strip()[-300:]}") from None
                time.sleep(0.2)


def _shape_uplink(fleet: Any, head: Any) -> str:
    """An htb class of UPLINK_MBIT for the packets from this machine's address to the head, on the head's
    host-side veth (the rest at line rate); the veth's name."""
    idx = fleet.exec(head, "cat /sys/class/net/eth0/iflink").stdout.strip()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    veth = next(ln.split(": ")[1].split("@")[0] for ln in links.splitlines() if ln.startswith(f"{idx}: "))
    gateway = _gateway(fleet)
    for cmd in (f"qdisc replace dev {veth} root handle 1: htb default 10",
                f"class add dev {veth} parent 1: classid 1:10 htb rate 100gbit",
                f"class add dev {veth} parent 1: classid 1:20 htb rate {UPLINK_MBIT}mbit ceil {UPLINK_MBIT}mbit",
                f"filter add dev {veth} parent 1: protocol ip prio 1 u32 match ip src {gateway}/32 flowid 1:20"):
        subprocess.run(["tc", *cmd.split()], capture_output=True, text=True, check=True)
    return veth


def _gateway(fleet: Any) -> str:
    return str(next(ipaddress.ip_network(fleet.subnet).hosts()))


def _uplink_bytes(veth: str) -> int:
    """Bytes the uplink class has sent (``tc -s class show``: "class htb 1:20 ..." then " Sent N bytes")."""
    out = subprocess.run(["tc", "-s", "class", "show", "dev", veth], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    for i, line in enumerate(out):
        if line.startswith("class htb 1:20 "):
            return int(out[i + 1].split()[1])
    raise RuntimeError(f"{veth}: no htb class 1:20")


def _tx_bytes(fleet: Any, h: Any) -> int:
    return int(fleet.exec(h, "cat /sys/class/net/eth0/statistics/tx_bytes").stdout)


# ---------------------------------------------------------------- one fleet of N receiving hosts


def _one_fleet(cfg: Config, base: Path, fleet: Any, n: int, files: dict[str, Path], ca: Path,
               veth: str) -> dict[str, Any]:
    from bench.bundle import _project
    from tests.lib import bundlelib, factory, fleetlib

    head, hosts = fleet.hosts[0], fleet.hosts[1:n + 1]
    paths = {"models": f"{HOME}/models", "engram": f"{HOME}/engram", "bundles": f"{HOME}/builder"}
    rows = [{"name": h.name, "ssh": h.name, "rank": i, "role": "head" if i == 0 else "worker", "address": h.ip,
             "paths": paths} for i, h in enumerate(hosts)]
    base.mkdir(parents=True)
    p = _project(base, files, base / "hosts", hosts=rows, ssh_config=str(fleet.ssh_config))
    _IMAGES.append(p["image_id"])
    root = p["root"]
    shutil.copyfile(ca, root / "hosts" / "registry-ca.crt")
    doc = factory.fleet(bundlelib.FLEET, bundlelib.LANE,
                        [factory.host(**{**r, "fabric": {}, "expect": {"gpu_count": 0, "nvidia_runtime": False}})
                         for r in rows],
                        ssh_config=str(fleet.ssh_config), registry=f"https://{head.ip}:{PORT}",
                        registry_ca="registry-ca.crt", models_from="registry")
    factory.write_fleet(root, doc, "test")
    doc["fleet"] = {**doc["fleet"], "name": PLAIN_FLEET, "registry_pull": f"http://{head.ip}:{PLAIN_PORT}"}
    factory.write_fleet(root, doc, "plain")
    tar = fleetlib.save_image(p["image_id"], base / "image.tar")
    for h in hosts:
        fleet.docker_load(h, tar)
        fleet.exec(h, f"cp /dev/stdin {HOME}/registry-ca.crt; chown spark {HOME}/registry-ca.crt",
                   input=ca.read_text())
    pins = ["--pins", str(root / "pins.toml")]

    _restart_registry(fleet, head, ca)
    up0, t0 = _uplink_bytes(veth), time.perf_counter()
    _ok([*builder_argv(), *pins, "bundle", "--fleet", bundlelib.FLEET, "--with-models", "--key", str(p["key"])])
    push_s, uplink = time.perf_counter() - t0, _uplink_bytes(veth) - up0
    _ok([*builder_argv(), *pins, "bundle", "--fleet", PLAIN_FLEET, "--with-models", "--key", str(p["key"])])
    stored = sum(int(x) for x in fleet.exec(
        head, f"find {REG_DIR}/storage -path '*/blobs/*' -name data -printf '%s\\n'").stdout.split())
    urls = [f"https://{head.ip}:{PORT}/v2/builder/model-files/blobs/sha256:{m['sha256']}"
            for m in json.loads((root / "out" / "bundles" / bundlelib.FLEET / hosts[0].name
                                 / "manifest.json").read_text())["models"]]

    def reset() -> None:
        for h in hosts:
            fleet.exec(h, f"rm -rf {HOME}/builder {HOME}/models {HOME}/engram {HOME}/raw; sync")

    def ship_all(fleet_name: str) -> dict[str, Any]:
        def one(h: Any) -> dict[str, Any]:
            out: dict[str, Any] = json.loads(_ok([*builder_argv(), *pins, "ship", f"{fleet_name}/{h.name}",
                                                  "--signing-key", str(p["key"]), "--json"]).stdout)
            return out

        tx0 = _tx_bytes(fleet, head)
        t = time.perf_counter()
        got = _at_once([lambda h=h: one(h) for h in hosts])
        wall = time.perf_counter() - t
        return {"wall_s": wall, "head_tx": _tx_bytes(fleet, head) - tx0,
                "rates": [r["bytes_pulled"] / r["pull_seconds"] for r in got],
                "pulled": sum(r["bytes_pulled"] for r in got)}

    digests = [u.rsplit("sha256:", 1)[1] for u in urls]
    blobs = f"{REG_DIR}/storage/docker/registry/v2/blobs/sha256"
    fleetlib.docker("exec", "-d", head.container, "busybox", "httpd", "-f", "-p", str(RAW_PORT), "-h", blobs)
    plain = [f"http://{head.ip}:{RAW_PORT}/{d[:2]}/{d}/data" for d in digests]

    def curl_all(sources: list[str], tls: bool) -> dict[str, Any]:
        names = [f"{HOME}/raw/f{i}" for i in range(len(sources))]
        pairs = " ".join(f"{u} -o {o}" for u, o in zip(sources, names, strict=True))
        ca_opt = f"--cacert {HOME}/registry-ca.crt " if tls else ""
        cmd = (f"mkdir -p {HOME}/raw && s=$(date +%s%N) && curl -sS --fail {ca_opt}"
               f"--parallel --parallel-max {FILES} {pairs} && sync {' '.join(names)} && e=$(date +%s%N) && "
               f"echo $((e - s)) $(cat {' '.join(names)} | wc -c)")

        def one(h: Any) -> tuple[float, int]:
            ns, nbytes = fleet.exec(h, cmd, user="spark", timeout=600).stdout.split()
            return int(ns) / 1e9, int(nbytes)

        got = _at_once([lambda h=h: one(h) for h in hosts])
        return {"rates": [b / s for s, b in got], "bytes": sum(b for _, b in got)}

    ships: list[dict[str, Any]] = []
    plains: list[dict[str, Any]] = []
    curls: list[dict[str, Any]] = []
    raws: list[dict[str, Any]] = []
    for _ in range(cfg.n(3)):
        reset()
        ships.append(ship_all(bundlelib.FLEET))
        reset()
        plains.append(ship_all(PLAIN_FLEET))
        reset()
        curls.append(curl_all(urls, tls=True))
        reset()
        raws.append(curl_all(plain, tls=False))
    reset()
    fleet.exec(head, "pkill -f 'busybox httpd'", check=False)
    for h in hosts:
        fleet.exec(h, ["docker", "image", "rm", "-f", p["image_id"]], check=False)
    release = sum(f.stat().st_size for f in files.values())
    return {"n": n, "push_s": push_s, "uplink": uplink, "stored": stored, "release": release,
            "ships": ships, "plains": plains, "curls": curls, "raws": raws}


def _at_once(fns: list[Any]) -> list[Any]:
    """Run each function in its own thread, all at once; their results in order (the first error raised)."""
    with ThreadPoolExecutor(max_workers=len(fns)) as ex:
        futures = [ex.submit(fn) for fn in fns]
        return [f.result() for f in futures]


def _ok(argv: list[str]) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[-6:])}: exit {p.returncode}: {p.stderr.strip()[-400:]}")
    return p


# ---------------------------------------------------------------- the figures


def _mib_s(rate: float) -> str:
    return f"{rate / MiB:.0f} MiB/s"


def _rows(per_n: list[dict[str, Any]], model: int) -> list[Row]:
    rows: list[Row] = []
    for r in per_n:
        n = r["n"]
        ratio = r["uplink"] / r["stored"]
        ssh_s = n * r["release"] * 8 / (UPLINK_MBIT * 1e6)
        rows.append(Row(NAME, f"{FIG_UPLINK} (N={n})", f"{r['uplink'] / GiB:.3f} GiB in {r['push_s']:.1f} s",
                        f"{r['stored'] / GiB:.3f} GiB", ratio, "<= 1.05", judge(ratio, "<= 1.05"),
                        f"uplink shaped to {UPLINK_MBIT} Mbit/s (tc htb, frames with headers); over ssh from the "
                        f"operator the same release would put {n}x through it (>= {ssh_s:.0f} s at line rate)",
                        {"uplink_bytes": r["uplink"], "stored_bytes": r["stored"], "push_s": r["push_s"],
                         "ssh_uplink_bytes": n * r["release"]}))
        med = {k: statistics.median(sum(x["rates"]) for x in r[k]) for k in ("ships", "plains", "curls", "raws")}
        head_tx = statistics.median(s["head_tx"] for s in r["plains"])
        wall = {k: statistics.median(x["wall_s"] for x in r[k]) for k in ("ships", "plains")}
        ratio = med["plains"] / med["raws"]
        fig = FIG_ONE if n == 1 else f"{FIG_MANY} (N={n})"
        per_host = ", ".join(_mib_s(x) for x in r["plains"][-1]["rates"])
        rows.append(Row(NAME, fig, _mib_s(med["plains"]), _mib_s(med["raws"]), ratio, ">= 0.8",
                        judge(ratio, ">= 0.8"),
                        f"{n} x {model / GiB:.2f} GiB; builder: ship of a fleet with registry_pull = the head's "
                        f"plain-HTTP listener; raw TCP: curl over plain HTTP from busybox httpd on the head "
                        f"(sendfile), into files then synced; per host (last round): {per_host}; ship of all "
                        f"{n} {wall['plains']:.1f} s wall; out of the head {head_tx / GiB:.2f} GiB "
                        f"({head_tx / (n * r['release']):.3f}x of {n} copies)",
                        {"pull_rate": med["plains"], "raw_rate": med["raws"], "head_tx_bytes": head_tx,
                         "wall_s": wall["plains"], "rounds": len(r["plains"]), "n": n}))
        ratio = med["ships"] / med["curls"]
        rows.append(Row(NAME, f"{FIG_TLS} (N={n})", _mib_s(med["ships"]), _mib_s(med["curls"]), ratio, "",
                        "report", f"curl --parallel of the same blobs from the same registry (the same CA), into "
                        f"files then synced; the TLS pull against raw TCP: {med['ships'] / med['raws']:.2f}x; "
                        f"ship of all {n} {wall['ships']:.1f} s wall",
                        {"pull_rate": med["ships"], "curl_tls_rate": med["curls"], "raw_rate": med["raws"],
                         "wall_s": wall["ships"], "n": n}))
    return rows
