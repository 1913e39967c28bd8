"""Facts read on a host: what runs there, and how its answers are read here.

The other modules of this package run ON the host, not here: each is standard library only, reads
its request from argv, prints JSON, and is sent as it is (its source text, `source(name)`) to run as
``python3 -I -S -c SOURCE ARG`` (-I -S: no site-packages, no user paths: nothing on the host but the
standard library is assumed). They are real modules so that ruff, mypy and the tests see them; the
tests import and call them directly too.

* ``batch``: many fact commands at once, each bounded in time (checks/checklib.py prefetch);
* ``filefacts``: stat or hash model files, list model and Engram folders;
* ``fabric``: RDMA devices and network interfaces in sysfs;
* ``serve``: the lane's API (/health, /v1/models, a one-token completion);
* ``gates``: the lane's serving gates, replay prompts and speed check, asked of its API;
* ``memory``: who holds the host's memory (each running container's cgroup, the biggest processes);
* ``burnload``: the burn gate's load, run bounded, with the GPUs sampled while it runs;
* ``gpuprocs``: the lane each GPU compute process belongs to, from its environment;
* ``matmul``: the burn's default load, a timed matrix product (needs torch: it runs in the lane's image);
* ``derive``: a rank's derivations, each made in the lane's image where its address does not hold it;
* ``watchdog``: one step of a command, ended once nobody reads its output (``tied``: every remote step);
* ``lane``: the lane's releases and containers on the host, and the wait for its rank to answer
  (builder.deploy.hoststate; sent over stdin as ``python3 - REQUEST``).

This module is the local side: their sources, and the pure functions the checks use to read and
judge their answers (unit-tested on their own). It imports nothing outside the standard library,
as each host's pytest imports it.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import shlex
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

_HERE = Path(__file__).resolve().parent


@cache
def source(name: str) -> str:
    """The source text of the host module `name` (``files`` for files.py), as it is sent."""
    return (_HERE / f"{name}.py").read_text()


BATCH = source("batch")
FILES = source("filefacts")
FABRIC = source("fabric")
SERVE = source("serve")
GATES = source("gates")
MEMORY = source("memory")
DERIVE = source("derive")
BURN = source("burnload")
GPUPROCS = source("gpuprocs")
MATMUL = source("matmul")
WATCHDOG = source("watchdog")


def tied(command: str) -> str:
    """`command` (a shell command line for a host) run so that it ends once nobody reads its output: its
    ssh channel closed (watchdog.py). The host needs python3 (as the installer and the lane's steps do)."""
    return f"exec python3 -I -S -c {shlex.quote(WATCHDOG)} {shlex.quote(command)}"

# ----------------------------------------------------------------------------- the batch

#: the most characters of JSON in one list argument of a remote command line (the batch's commands, the
#: paths of one filefacts call): Linux caps one argument at 128 KiB (MAX_ARG_STRLEN), and the list is
#: quoted once more for the remote shell.
ARG_MAX_CHARS = 60_000

T = TypeVar("T")


def _chars(item: Any) -> int:
    """What `item` adds to a JSON list: its JSON, and the ", " json.dumps puts between items."""
    return len(json.dumps(item)) + 2


def fits(item: Any, max_chars: int = ARG_MAX_CHARS) -> bool:
    """Whether `item` fits in a list argument by itself (the brackets and the item)."""
    return 2 + _chars(item) <= max_chars


def split_args(items: Iterable[T], max_chars: int = ARG_MAX_CHARS) -> list[list[T]]:
    """Split `items`, in order, into lists whose JSON is at most `max_chars` each: one remote command
    line's list argument. An item too long for any list is refused (ValueError naming its start): left
    out, the host would not be asked what the caller needs."""
    groups: list[list[T]] = []
    cur: list[T] = []
    size = 2  # the list's brackets
    for item in items:
        n = _chars(item)
        if not fits(item, max_chars):
            raise ValueError(f"{json.dumps(item)[:60]}...: too long for one remote command line ({n - 2} "
                             f"characters of JSON, at most {max_chars - 4})")
        if cur and size + n > max_chars:
            groups.append(cur)
            cur, size = [], 2
        cur.append(item)
        size += n
    if cur:
        groups.append(cur)
    return groups


def parse_batch(text: str) -> dict[str, tuple[int, bytes, bytes]]:
    """The batch's output -> {command: (rc, stdout, stderr)}; ValueError when it is not that."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("batch output: not a JSON object")
    out: dict[str, tuple[int, bytes, bytes]] = {}
    for cmd, v in data.items():
        if not (isinstance(v, list) and len(v) == 3 and isinstance(v[0], int)):
            raise ValueError(f"batch output: bad entry for {cmd[:40]!r}")
        out[cmd] = (v[0], base64.b64decode(v[1]), base64.b64decode(v[2]))
    return out


def dumps(obj: Any) -> str:
    """A request as the host modules take it (compact, sorted: the same request, the same line)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


# ----------------------------------------------------------------------------- files and memory


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo -> {key: KiB}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0])
    return out


def gib(kib: int) -> float:
    return kib / (1024 * 1024)


#: holders of less than this (bytes) are not named in a memory check's message
MEMORY_SHOWN_MIN = 64 << 20


def memory_holders(
    facts: dict[str, Any], own: set[str], gpu_apps: Iterable[tuple[int, str, int]] = ()
) -> tuple[list[tuple[str, int]], list[tuple[str, int]], list[tuple[str, int]]]:
    """Who holds the host's memory, from memory.py's answer: (the lane's own containers, the other
    containers, the processes outside containers), each a list of (name, bytes), biggest first.

    `own` holds the IDs of the lane's own containers. `gpu_apps` is (pid, name, bytes) of each
    compute process of a GPU whose memory is the host's own (unified memory, as on a DGX Spark: the
    driver's allocations are in no cgroup and MemAvailable does not count them); each one's memory
    goes to the container that runs it, or to the process."""
    containers = facts.get("containers") or {}
    by_pid = {pid: cid for cid, c in containers.items() for pid in c.get("pids") or []}
    held = {cid: int(c.get("held") or 0) for cid, c in containers.items()}
    procs = {p["pid"]: (f"pid {p['pid']} {p['name']}", int(p["held"])) for p in facts.get("processes") or []}
    for pid, name, size in gpu_apps:
        if pid in by_pid:
            held[by_pid[pid]] += size
        else:
            label, n = procs.get(pid, (f"pid {pid} {name}", 0))
            procs[pid] = (label, n + size)

    def order(items: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        return sorted(items, key=lambda x: (-x[1], x[0]))

    mine = order((str(containers[c].get("name")), n) for c, n in held.items() if c in own)
    other = order((str(containers[c].get("name")), n) for c, n in held.items() if c not in own)
    return mine, other, order(procs.values())


def memory_shortfall(
    available_kib: int, want_gib: float, own: list[tuple[str, int]], containers: list[tuple[str, int]],
    processes: list[tuple[str, int]], note: str = "",
) -> str:
    """"" when MemAvailable and what the lane's own containers hold (freed when the rank stops)
    reach `want_gib`; else the check's message, naming the biggest other holders."""
    credit = sum(n for _, n in own)
    found = gib(available_kib)
    if found + credit / (1 << 30) >= want_gib:
        return ""
    names = ", ".join(name for name, _ in own)
    word = "container" if len(own) == 1 else "containers"
    held = f" (with {credit / (1 << 30):.1f} GiB held by the lane's own {word} {names})" if own else ""
    msg = f"MemAvailable: expected >= {want_gib:g} GiB{held}, found {found:.1f} GiB"
    if note:
        msg += f" ({note})"
    for what, items in (("other containers", containers), ("other processes", processes)):
        big = [f"{name} {n / (1 << 30):.1f} GiB" for name, n in items if n >= MEMORY_SHOWN_MIN]
        if big:
            msg += f"; {what}: {shown(big)}"
    return msg


def shown(items: Iterable[str], limit: int = 3) -> str:
    """The first `limit` items, and how many more."""
    items = list(items)
    head = ", ".join(items[:limit])
    return head + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


# ----------------------------------------------------------------------------- the fabric


def roce_v2_gid(ipv4: str) -> str:
    """The IPv4-mapped GID as sysfs writes it: 0000:0000:0000:0000:0000:ffff:c000:0201."""
    packed = ipaddress.IPv4Address(ipv4).packed
    return "0000:0000:0000:0000:0000:ffff:" + f"{packed[0]:02x}{packed[1]:02x}:{packed[2]:02x}{packed[3]:02x}"


def rail_gid(
    facts: dict[str, Any], ipv4: str, gid_index: int | str = "auto", devices: list[str] | None = None
) -> tuple[str, str, str] | None:
    """The (device, port, index) holding a RoCE v2 GID for `ipv4` in fabric.py's answer, or None.

    With a fixed gid_index only that index counts; with "auto" any index does.
    """
    want = roce_v2_gid(ipv4)
    for dev, ports in sorted(facts.get("rdma", {}).items()):
        if devices and dev not in devices:
            continue
        for port, info in sorted(ports.items()):
            for idx, g in info.get("gids", {}).items():
                if gid_index != "auto" and str(gid_index) != idx:
                    continue
                if (g.get("gid") or "").lower() == want and "v2" in (g.get("type") or "").lower():
                    return dev, port, idx
    return None


def iface_of(facts: dict[str, Any], ipv4: str) -> str | None:
    """The interface holding `ipv4` in fabric.py's answer."""
    for name, info in sorted(facts.get("net", {}).items()):
        if ipv4 in (info.get("ipv4") or []):
            return name
    return None
