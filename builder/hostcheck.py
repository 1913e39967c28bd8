"""Pure helpers the host checks in checks/ use: remote fact scripts and local evaluators.

The checks read facts with one remote command per topic (one python3 call for a batch of
model files, one for the whole fabric in sysfs, one nvidia-smi call per query) and decide
locally. Nothing here talks to a host: each script is a string that a check runs through
testinfra's ``host.run("python3 -c %s %s", SCRIPT, arg)``, and each evaluator is a pure
function of that script's JSON output and the expectations, unit-tested on its own.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Iterator
from typing import Any

#: how a fact script tells BATCH_SCRIPT it is getting on (`tick()`: one byte to $BUILDER_PROGRESS_FD,
#: which the batch gives it; a no-op when run on its own), so the batch's bound counts from its last
#: progress rather than from its start. Goes after the script's `import os`.
PROGRESS = r"""
def _progress():
    fd = os.environ.get("BUILDER_PROGRESS_FD")
    if not fd:
        return lambda: None
    fd = int(fd)
    os.set_blocking(fd, False)
    def tick():
        try:
            os.write(fd, b".")
        except OSError:  # a full pipe (progress enough) or a closed one
            pass
    return tick
tick = _progress()
"""

#: stat (fast) or stat + sha256 (full) many files on the host, in parallel threads.
#: argv[1] = JSON {"paths": [...], "hash": bool, "jobs": int}; prints JSON {path: {...}}.
FILES_SCRIPT = r"""
import json, os, sys
""" + PROGRESS + r"""
req = json.loads(sys.argv[1])
def one(p):
    try:
        st = os.stat(p)
    except OSError as e:
        return p, {"error": e.strerror or str(e)}
    finally:
        tick()
    if not os.path.isfile(p):
        return p, {"error": "not a regular file"}
    r = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    if req.get("hash"):
        import hashlib
        h = hashlib.sha256()
        try:
            with open(p, "rb", buffering=0) as f:
                while True:
                    b = f.read(8 << 20)
                    if not b:
                        break
                    h.update(b)
                    tick()
        except OSError as e:
            return p, {"error": e.strerror or str(e)}
        r["sha256"] = h.hexdigest()
    return p, r
if req.get("hash") and len(req["paths"]) > 1:
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max(1, int(req.get("jobs", 4)))) as ex:
        out = dict(ex.map(one, req["paths"]))
else:  # stat only: no threads (their imports cost more than the stats)
    out = dict(map(one, req["paths"]))
sys.stdout.write(json.dumps(out))
"""

#: every regular file under some folders (relative paths), or null for a missing folder.
LIST_SCRIPT = r"""
import json, os, sys
""" + PROGRESS + r"""
out = {}
for root in json.loads(sys.argv[1]):
    isdir = os.path.isdir(root)
    tick()
    if not isdir:
        out[root] = None
        continue
    files = []
    for d, dirs, names in os.walk(root):
        tick()
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                files.append(os.path.relpath(p, root))
    out[root] = files
sys.stdout.write(json.dumps(out))
"""

#: the RDMA and network facts in sysfs (argv[1] = sysfs root, normally /sys) plus `ip -j -4 addr`.
FABRIC_SCRIPT = r"""
import json, os, subprocess, sys
sysfs = sys.argv[1] if len(sys.argv) > 1 else "/sys"
def rd(p):
    try:
        with open(p) as f:
            return f.read().strip()
    except OSError:
        return None
ib = os.path.join(sysfs, "class", "infiniband")
devs = {}
for d in sorted(os.listdir(ib)) if os.path.isdir(ib) else []:
    ports = {}
    pdir = os.path.join(ib, d, "ports")
    for p in sorted(os.listdir(pdir)) if os.path.isdir(pdir) else []:
        base = os.path.join(pdir, p)
        gids = {}
        gdir = os.path.join(base, "gids")
        idxs = os.listdir(gdir) if os.path.isdir(gdir) else []
        for i in sorted(idxs, key=lambda s: int(s) if s.isdigit() else 0):
            g = rd(os.path.join(gdir, i))
            if not g or g.replace("0", "").replace(":", "") == "":
                continue
            gids[i] = {"gid": g, "type": rd(os.path.join(base, "gid_attrs", "types", i)),
                       "ndev": rd(os.path.join(base, "gid_attrs", "ndevs", i))}
        ports[p] = {"state": rd(os.path.join(base, "state")), "gids": gids}
    devs[d] = ports
net = {}
ndir = os.path.join(sysfs, "class", "net")
for n in sorted(os.listdir(ndir)) if os.path.isdir(ndir) else []:
    mtu = rd(os.path.join(ndir, n, "mtu"))
    net[n] = {"mtu": int(mtu) if mtu and mtu.isdigit() else None, "ipv4": []}
try:
    addrs = json.loads(subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True,
                                      timeout=10).stdout or "[]")
except Exception:
    addrs = []
for a in addrs:
    n = a.get("ifname")
    if n is None:
        continue
    net.setdefault(n, {"mtu": a.get("mtu"), "ipv4": []})
    net[n]["ipv4"] = [i["local"] for i in a.get("addr_info", []) if i.get("family") == "inet"]
sys.stdout.write(json.dumps({"dev_infiniband": os.path.isdir("/dev/infiniband"), "rdma": devs, "net": net}))
"""

#: the docker engine's answers the checks read, as the docker CLI gives them, without starting the
#: CLI (a Go program: ~20 ms of CPU per run, twice per host): argv[1] = JSON {"cmd": "info"} (as
#: `docker info --format '{{json .}}'`) or {"cmd": "inspect", "refs": [...]} (as `docker image
#: inspect REF...`: the images found as a JSON list on stdout, the engine's "No such image: REF" on
#: stderr for each one not found, exit 1 if any), plus "seconds", the most one answer may take. It asks the
#: Engine API on the unix socket the CLI would use. Where only the CLI knows the engine (DOCKER_HOST
#: not unix://, a docker context), it runs the CLI itself, so the answer is the CLI's either way.
DOCKER_SCRIPT = r"""
import json, os, socket, sys
req = json.loads(sys.argv[1])
limit = float(req.get("seconds") or 120)
def endpoint():
    host = os.environ.get("DOCKER_HOST", "")
    if host:
        return host[len("unix://"):] if host.startswith("unix://") else None
    if os.environ.get("DOCKER_CONTEXT", "default") != "default":
        return None
    cfg = os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker"), "config.json")
    try:
        with open(cfg) as f:
            if json.load(f).get("currentContext") not in (None, "", "default"):
                return None
    except (OSError, ValueError, AttributeError):
        pass
    return "/var/run/docker.sock"
def cli(argv):
    import subprocess
    try:
        p = subprocess.run(argv, capture_output=True, timeout=limit, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        sys.stderr.write(f"{e}\n")
        sys.exit(127)
    except subprocess.TimeoutExpired:
        sys.stderr.write(f"builder: timed out after {limit:g} s\n")
        sys.exit(124)
    sys.stdout.write(p.stdout.decode("utf-8", "replace"))
    sys.stderr.write(p.stderr.decode("utf-8", "replace"))
    sys.exit(p.returncode)
sock = endpoint()
if sock is None:
    info = ["docker", "info", "--format", "{{json .}}"]
    cli(info if req["cmd"] == "info" else ["docker", "image", "inspect", *req["refs"]])
# HTTP/1.0 by hand over the socket (http.client's imports, email and ssl among them, cost more
# than the rest of a host's batch; urllib.parse's quote, 4 ms more, is the three lines below):
# the engine answers 1.0 without chunking and closes the connection, so the response is
# everything read up to EOF.
SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~/:@")
def quote(ref):
    return "".join(chr(b) if b in SAFE else "%%%02X" % b for b in ref.encode())
class Malformed(OSError):
    pass
def get(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(limit)
    try:
        s.connect(sock)
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: docker\r\n\r\n".encode())
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    finally:
        s.close()
    head, sep, body = b"".join(chunks).partition(b"\r\n\r\n")
    first = head.split(b"\r\n", 1)[0].split()
    if not sep or len(first) < 2 or not first[0].startswith(b"HTTP/") or not first[1].isdigit():
        raise Malformed("not an HTTP response from the Docker daemon")
    return int(first[1]), body
def unreachable(e):
    if isinstance(e, Malformed):
        return f"unix://{sock}: {e}"
    if isinstance(e, PermissionError):
        return f"permission denied while trying to connect to the Docker daemon socket at unix://{sock}"
    if isinstance(e, (socket.timeout, TimeoutError)):
        return f"builder: timed out after {limit:g} s"
    return f"Cannot connect to the Docker daemon at unix://{sock}. Is the docker daemon running?"
def message(body):
    try:
        return json.loads(body).get("message") or body.decode("utf-8", "replace").strip()
    except (ValueError, AttributeError):
        return body.decode("utf-8", "replace").strip()
if req["cmd"] == "info":
    try:
        status, body = get("/info")
    except OSError as e:
        sys.stdout.write(json.dumps({"ServerErrors": [unreachable(e)]}))
        sys.exit(1)
    if status != 200:
        sys.stdout.write(json.dumps({"ServerErrors": [message(body)]}))
        sys.exit(1)
    sys.stdout.write(body.decode("utf-8", "replace").strip())
    sys.exit(0)
found, rc = [], 0
for ref in req["refs"]:
    try:
        status, body = get("/images/" + quote(ref) + "/json")
    except OSError as e:
        sys.stderr.write(unreachable(e) + "\n")
        sys.exit(1)
    if status == 200:
        found.append(json.loads(body))
    else:
        rc = 1
        sys.stderr.write(f"Error response from daemon: {message(body)}\n")
sys.stdout.write(json.dumps(found, indent=4) + "\n")
sys.exit(rc)
"""

#: run many commands on the host at once and report each one's exit status and output.
#: argv[1] = JSON list of items: a shell command line (a string), or ["py", line, script, arg] for a
#: python3 fact script, which runs as `python3 -I -S -c script arg` (this interpreter). Every item runs
#: in a child process of its own session, in parallel threads. argv[2], if given, bounds each item's
#: seconds: one that runs longer (a hung nvidia-smi, df or a stat on a stale NFS mount) is killed with
#: its process group and answers exit status 124 ("builder: timed out after N s" on stderr), so the
#: other facts still come back. A fact script may report progress (PROGRESS below: FILES_SCRIPT per
#: file and per 8 MiB hashed, LIST_SCRIPT per folder); each report restarts its bound, so a full-mode
#: hash that takes minutes keeps going while one stuck read or stat is killed N s after its last
#: progress. Prints JSON {line: [rc, out, err]}, out and err base64 (a command's output need not be
#: text). The checks read most of a host's facts through one call of this (checklib.py prefetch):
#: one ssh channel instead of one per fact, which is most of what an audit costs per host.
BATCH_SCRIPT = r"""
import binascii, json, os, selectors, signal, subprocess, sys, threading, time
def enc(rc, out, err):
    return [rc, binascii.b2a_base64(out, newline=False).decode(), binascii.b2a_base64(err, newline=False).decode()]
limit = float(sys.argv[2]) if len(sys.argv) > 2 else None
def child(argv, progress):
    # progress: a pipe whose write end the script finds in $BUILDER_PROGRESS_FD; a byte on it
    # restarts the bound
    pr = pw = None
    env = None
    if progress:
        pr, pw = os.pipe()
        env = dict(os.environ, BUILDER_PROGRESS_FD=str(pw))
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, env=env, pass_fds=(pw,) if progress else ())
    except OSError as e:
        if pr is not None:
            os.close(pr)
        return enc(127, b"", str(e).encode())
    finally:
        if pw is not None:
            os.close(pw)
    ofd, efd = p.stdout.fileno(), p.stderr.fileno()
    bufs = {ofd: [], efd: []}
    sel = selectors.DefaultSelector()
    for fd in (ofd, efd) if pr is None else (ofd, efd, pr):
        sel.register(fd, selectors.EVENT_READ)
    def outputs_open():
        m = sel.get_map()
        return ofd in m or efd in m
    def drain(until, restart):
        # read what comes until both outputs end or `until` passes: (whether they ended, until)
        while outputs_open():
            left = None if until is None else until - time.monotonic()
            if left is not None and left <= 0:
                return False, until
            for key, _ in sel.select(left):
                b = os.read(key.fd, 65536)
                if not b:
                    sel.unregister(key.fd)
                elif key.fd == pr:
                    if restart and limit is not None:
                        until = time.monotonic() + limit
                else:
                    bufs[key.fd].append(b)
        return True, until
    done, until = drain(None if limit is None else time.monotonic() + limit, True)
    if done:
        try:  # both outputs closed: it is exiting (or runs on without them, within the same bound)
            rc = p.wait(timeout=None if until is None else max(0.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            done = False
    if not done:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
        drain(time.monotonic() + 5, False)  # what it wrote before; one that cannot die (D state) keeps the pipes
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    sel.close()
    p.stdout.close()
    p.stderr.close()
    if pr is not None:
        os.close(pr)
    out, err = b"".join(bufs[ofd]), b"".join(bufs[efd])
    if not done:
        return enc(124, out, err + f"builder: timed out after {limit:g} s\n".encode())
    return enc(rc, out, err)
def sh(c):
    return child(["/bin/sh", "-c", c], False)
def py(script, arg):
    return child([sys.executable or "python3", "-I", "-S", "-c", script, arg], True)
items = json.loads(sys.argv[1])
res = {}
def put(i):
    if isinstance(i, str):
        res[i] = sh(i)
    else:
        res[i[1]] = py(i[2], i[3])
threads = [threading.Thread(target=put, args=(i,)) for i in items]
for t in threads:
    t.start()
for t in threads:
    t.join()
sys.stdout.write(json.dumps(res))
"""

#: the most characters of command lines sent in one BATCH_SCRIPT call: Linux caps one argument
#: at 128 KiB (MAX_ARG_STRLEN), and the list is quoted once more for the remote shell.
BATCH_MAX_CHARS = 60_000


def batch_groups(items: Iterable[Any], max_chars: int = BATCH_MAX_CHARS) -> list[list[Any]]:
    """Split BATCH_SCRIPT items into calls of at most `max_chars` (JSON-encoded). An item too long
    for any call is left out: the check that needs it runs it by itself."""
    groups: list[list[Any]] = []
    cur: list[Any] = []
    size = 2
    for item in items:
        n = len(json.dumps(item)) + 2  # json.dumps(list) separates items with ", "
        if n + 2 > max_chars:
            continue
        if cur and size + n > max_chars:
            groups.append(cur)
            cur, size = [], 2
        cur.append(item)
        size += n
    if cur:
        groups.append(cur)
    return groups


def parse_batch(text: str) -> dict[str, tuple[int, bytes, bytes]]:
    """BATCH_SCRIPT's output -> {command: (rc, stdout, stderr)}; ValueError when it is not that."""
    import base64

    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("batch output: not a JSON object")
    out: dict[str, tuple[int, bytes, bytes]] = {}
    for cmd, v in data.items():
        if not (isinstance(v, list) and len(v) == 3 and isinstance(v[0], int)):
            raise ValueError(f"batch output: bad entry for {cmd[:40]!r}")
        out[cmd] = (v[0], base64.b64decode(v[1]), base64.b64decode(v[2]))
    return out


def roce_v2_gid(ipv4: str) -> str:
    """The IPv4-mapped GID as sysfs writes it: 0000:0000:0000:0000:0000:ffff:c000:0201."""
    packed = ipaddress.IPv4Address(ipv4).packed
    return "0000:0000:0000:0000:0000:ffff:" + f"{packed[0]:02x}{packed[1]:02x}:{packed[2]:02x}{packed[3]:02x}"


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


def batches(items: list[str], max_chars: int = 60_000) -> Iterator[list[str]]:
    """Split paths so one remote command line stays well under ARG_MAX."""
    cur: list[str] = []
    size = 0
    for p in items:
        if cur and size + len(p) + 4 > max_chars:
            yield cur
            cur, size = [], 0
        cur.append(p)
        size += len(p) + 4
    if cur:
        yield cur


def mtime_ns(value: Any) -> int | None:
    """Normalise an apply record's mtime: int ns, or float/int seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int) and value > 10**12:
        return value
    return int(round(float(value) * 1e9))


def same_mtime(recorded: Any, found_ns: int) -> bool:
    want = mtime_ns(recorded)
    if want is None:
        return False
    return abs(want - found_ns) < 1_000_000  # 1 ms: float seconds lose precision


def shown(items: Iterable[str], limit: int = 3) -> str:
    items = list(items)
    head = ", ".join(items[:limit])
    return head + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


# ----------------------------------------------------------------- fabric evaluation


def rail_gid(
    facts: dict[str, Any], ipv4: str, gid_index: int | str = "auto", devices: list[str] | None = None
) -> tuple[str, str, str] | None:
    """The (device, port, index) holding a RoCE v2 GID for `ipv4`, or None.

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
    for name, info in sorted(facts.get("net", {}).items()):
        if ipv4 in (info.get("ipv4") or []):
            return name
    return None


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)
