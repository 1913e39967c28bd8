"""One host of a deploy: what it runs (one remote call), and the steps a deploy takes on it.

Every step goes through the host's one connection (builder.ship.Remote: ssh with the fleet's
ssh_config, or docker exec, or local) and is bounded. Over ssh the host needs python3 and docker,
as the installer does; the small scripts below are sent over stdin, never left on the host.

- ``state``: the installer's links (``current``, ``previous``, ``staged``), the releases present, the
  apply record's bundle, lock and image, this lane's containers of this rank (by the labels start.sh
  gives them, so nothing else is ever looked at or touched) and, on the head, whether ``/health``
  answers on 127.0.0.1 (as the serving audit asks it).
- ``stage``/``switch``: the installer (``builder/installer.py``, the operator's copy, over stdin).
- ``stop``: the release's own ``stop.sh`` (every container of this lane and rank, whatever bundle
  started it; only those); with no release installed, the same command from builder.launch.
- ``start``: ``current/start.sh`` with ``BUILDER_START_TIMEOUT`` set to the deploy's bound.
- ``wait``: until this rank's container answers (a worker: its serve or rendezvous port, start.sh's own
  rule; the head: ``/health``), bounded, and at once when the container exited (its last log lines
  say why).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.errors import BuilderError
from builder.hosts import Fleet, Host
from builder.ssh import ControlSockets

#: the facts of one host, in one remote python3 (standard library only)
STATE_SCRIPT = r"""
import json, os, re, socket, subprocess, sys, time
req = json.loads(sys.argv[1])
root = req["root"]
out = {"releases": [], "applied": None, "containers": [], "health": None, "docker": ""}
def link(name):
    try:
        bid = os.path.basename(os.readlink(os.path.join(root, name)).rstrip("/"))
    except OSError:
        return None
    return bid if re.match(r"^[0-9a-f]{64}$", bid) else None
for n in ("current", "previous", "staged"):
    out[n] = link(n)
try:
    out["releases"] = sorted(n for n in os.listdir(os.path.join(root, "releases"))
                             if re.match(r"^[0-9a-f]{64}$", n))
except OSError:
    pass
try:
    with open(os.path.join(root, "state", "applied.json"), "rb") as f:
        rec = json.loads(f.read(64 << 20).decode("utf-8"))
    img = rec.get("image") or {}
    out["applied"] = {k: rec.get(k) for k in ("bundle_id", "lock_hash", "action", "applied_at", "lane",
                                               "previous_bundle_id")}
    out["applied"]["image_id"] = img.get("image_id")
    out["applied"]["image"] = img.get("name")
except (OSError, ValueError, AttributeError):
    pass
def http(sock, path, host):
    # HTTP/1.0 by hand: one request, the answer until the peer closes (no http.client to import)
    sock.settimeout(30)
    sock.sendall(("GET %s HTTP/1.0\r\nHost: %s\r\n\r\n" % (path, host)).encode())
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body
lane, rank = req["lane"], str(req["rank"])
dh = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
try:
    if dh.startswith("unix://"):  # the Engine API on its socket (as `docker ps -a` asks it)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(dh[len("unix://"):])
        filters = json.dumps({"label": ["%s=%s" % (req["label_lane"], lane), "%s=%s" % (req["label_rank"], rank)]})
        q = "".join(c if c.isalnum() or c in "-_.~" else "%%%02X" % ord(c) for c in filters)
        code, body = http(s, "/containers/json?all=1&filters=" + q, "docker")
        if code != 200:
            raise OSError("docker engine answered HTTP %d" % code)
        for c in json.loads(body):
            labels = c.get("Labels") or {}
            out["containers"].append({"id": c["Id"][:12], "name": (c.get("Names") or ["?"])[0].lstrip("/"),
                                      "state": c.get("State", ""), "bundle": labels.get(req["label_bundle"], ""),
                                      "image": c.get("ImageID") or c.get("Image", ""), "status": c.get("Status", "")})
    else:  # another engine: the CLI knows how to reach it
        fmt = '{{.ID}}	{{.Names}}	{{.State}}	{{.Label "%s"}}	{{.Label "%s"}}	{{.Image}}	{{.Status}}' % (
            req["label_bundle"], req["label_rank"])
        p = subprocess.run(["docker", "ps", "-a", "--no-trunc", "--filter", "label=%s=%s" % (req["label_lane"], lane),
                            "--format", fmt], capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise OSError((p.stderr.strip().splitlines() or ["docker ps failed"])[-1])
        for line in p.stdout.splitlines():
            parts = line.split("	")
            if len(parts) == 7 and parts[4] == rank:
                out["containers"].append({"id": parts[0][:12], "name": parts[1], "state": parts[2],
                                          "bundle": parts[3], "image": parts[5], "status": parts[6]})
except (OSError, ValueError, KeyError, IndexError, subprocess.TimeoutExpired) as e:
    out["docker"] = "docker: %s" % e
for attempt in range(3 if req.get("health_port") else 0):  # (a busy engine may miss one answer)
    try:
        code, _ = http(socket.create_connection(("127.0.0.1", req["health_port"]), timeout=5), "/health",
                       "127.0.0.1")
        out["health"] = {"status": code}
        if code == 200:
            break
    except (OSError, ValueError, IndexError) as e:
        out["health"] = {"status": None, "error": str(e)[:200]}
    if not out["containers"]:
        break
    time.sleep(0.5)
sys.stdout.write(json.dumps(out))
"""

#: wait until this rank answers, or its container ended, or the bound passed (standard library only)
WAIT_SCRIPT = r"""
import json, os, socket, subprocess, sys, time, urllib.request
req = json.loads(sys.argv[1])
start = time.monotonic()
deadline = start + req["timeout"]
name = req["container"]
dh = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
def engine(path):
    # the Engine API on its socket, HTTP/1.0 by hand (a docker CLI start per poll costs more)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(dh[len("unix://"):])
    s.sendall(("GET %s HTTP/1.0\r\nHost: docker\r\n\r\n" % path).encode())
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body
def state():
    try:
        if dh.startswith("unix://"):
            code, body = engine("/containers/%s/json" % name)
            if code == 404:
                return "missing", None
            st = json.loads(body)["State"]
            return st["Status"], st.get("ExitCode")
        p = subprocess.run(["docker", "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", name],
                           capture_output=True, text=True, timeout=30)
    except (OSError, ValueError, KeyError, IndexError, subprocess.TimeoutExpired):
        return "unknown", None
    if p.returncode != 0:
        return "missing", None
    st, _, code = p.stdout.strip().partition(" ")
    return st, code
def answers():
    for port in req["ports"]:
        for addr in req["addrs"]:
            try:
                socket.create_connection((addr, port), timeout=2).close()
                return True
            except OSError:
                pass
    return False
def healthy():
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/health" % req["health_port"], timeout=3) as r:
            return r.status == 200
    except Exception:
        return False
def logs():
    try:
        p = subprocess.run(["docker", "logs", "--tail", "5", name], capture_output=True, text=True, timeout=30)
        return " | ".join(ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.strip())[-600:]
    except (OSError, subprocess.TimeoutExpired):
        return ""
while True:
    st, code = state()
    if st in ("exited", "dead", "missing"):
        why = "container %s %s" % (name, "is gone" if st == "missing" else "exited (code %s)" % code)
        sys.stdout.write(json.dumps({"ok": False, "why": why, "log": logs()}))
        break
    if st == "running" and (healthy() if req.get("health_port") else answers()):
        sys.stdout.write(json.dumps({"ok": True, "seconds": round(time.monotonic() - start, 3)}))
        break
    if time.monotonic() > deadline:
        what = "/health" if req.get("health_port") else "ports %s" % ",".join(map(str, req["ports"]))
        sys.stdout.write(json.dumps({"ok": False, "why": "%s did not answer within %g s (container %s)"
                                     % (what, req["timeout"], st), "log": logs()}))
        break
    time.sleep(0.3)
"""


@dataclass
class Container:
    id: str
    name: str
    state: str
    bundle: str
    image: str
    status: str


@dataclass
class HostState:
    """What one host runs, as one remote call found it."""

    host: str
    current: str | None = None
    previous: str | None = None
    staged: str | None = None
    releases: list[str] = field(default_factory=list)
    applied: dict[str, Any] | None = None
    containers: list[Container] = field(default_factory=list)
    health: dict[str, Any] | None = None
    docker: str = ""  # why docker did not answer ("" when it did)

    @classmethod
    def from_json(cls, host: str, d: dict[str, Any]) -> HostState:
        return cls(
            host=host,
            current=d.get("current"),
            previous=d.get("previous"),
            staged=d.get("staged"),
            releases=list(d.get("releases") or []),
            applied=d.get("applied"),
            containers=[Container(**c) for c in d.get("containers") or []],
            health=d.get("health"),
            docker=str(d.get("docker") or ""),
        )

    @property
    def installed(self) -> str | None:
        """The installed release: current, when the apply record agrees."""
        if self.current and self.applied and self.applied.get("bundle_id") == self.current:
            return self.current
        return None

    @property
    def running(self) -> list[Container]:
        return [c for c in self.containers if c.state == "running"]

    def up_on(self, bundle_id: str | None) -> bool:
        """This rank runs bundle_id: exactly one container of the lane's rank, running it."""
        return bundle_id is not None and len(self.containers) == 1 and self.running == self.containers and (
            self.containers[0].bundle == bundle_id
        )

    @property
    def healthy(self) -> bool:
        return bool(self.health) and (self.health or {}).get("status") == 200

    def to_json(self) -> dict[str, Any]:
        return {
            "current": self.current,
            "previous": self.previous,
            "staged": self.staged,
            "applied": self.applied,
            "containers": [c.__dict__ for c in self.containers],
            "health": self.health,
            "docker": self.docker,
        }


class HostOps:
    """The deploy's steps on one host, over its one connection (open it with ``with``)."""

    def __init__(
        self,
        fleet_file: Path,
        fleet: Fleet,
        host: Host,
        *,
        connect_timeout: int = 10,
        timeout: float = 60.0,
        sockets: ControlSockets | None = None,
    ) -> None:
        from builder.ship import Remote

        self.fleet, self.host = fleet, host
        # (sockets: the command's, so its audits and ships use this host's one connection too)
        self.remote = Remote(fleet_file, fleet, host, connect_timeout, sockets=sockets)
        self.timeout = timeout
        self.root = host.paths.bundles.rstrip("/") or "/"

    def __enter__(self) -> HostOps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.remote.close()

    # ------------------------------------------------------------------ facts

    def _script(self, script: str, req: dict[str, Any], *, timeout: float, what: str) -> dict[str, Any]:
        cmd = "python3 - " + shlex.quote(json.dumps(req, sort_keys=True))
        p = self.remote.run(cmd, timeout=timeout, stdin=script.encode(), what=what)
        text = p.stdout.decode("utf-8", "replace").strip()
        if p.returncode != 0 or not text:
            err = [ln for ln in p.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
            raise BuilderError(f"{self.host.name}: {what}: {err[-1] if err else f'exit status {p.returncode}'}")
        try:
            out = json.loads(text.splitlines()[-1])
        except ValueError:
            raise BuilderError(f"{self.host.name}: {what}: unreadable answer") from None
        if not isinstance(out, dict):
            raise BuilderError(f"{self.host.name}: {what}: unexpected answer")
        return out

    def state(self, lane: str, health_port: int | None) -> HostState:
        from builder.launch import LABEL_BUNDLE, LABEL_LANE, LABEL_RANK

        req = {
            "root": self.root,
            "lane": lane,
            "rank": self.host.rank,
            "health_port": health_port,
            "label_lane": LABEL_LANE,
            "label_rank": LABEL_RANK,
            "label_bundle": LABEL_BUNDLE,
        }
        return HostState.from_json(self.host.name, self._script(STATE_SCRIPT, req, timeout=self.timeout, what="state"))

    # ------------------------------------------------------------------ the installer

    def installer(self, args: list[str], what: str, timeout: float | None = None) -> dict[str, Any]:
        from builder import installer as inst

        return self.remote.run_installer(
            inst.assemble(), [*args, "--root", self.root], timeout=timeout or self.timeout + 120, what=what
        )

    def stage_installed(self, bundle_id: str) -> dict[str, Any]:
        return self.installer(["stage", "--release", bundle_id], "stage")

    def switch(self, bundle_id: str, *, rollback: bool = False) -> dict[str, Any]:
        return self.installer(["switch", "--to", bundle_id, *(["--rollback"] if rollback else [])], "switch")

    # ------------------------------------------------------------------ stop, start, wait

    def _shell(self, command: str, *, timeout: float, what: str) -> None:
        p = self.remote.run(command, timeout=timeout, what=what)
        if p.returncode != 0:
            err = [ln.strip() for ln in p.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
            raise BuilderError(f"{self.host.name}: {what}: {err[-1] if err else f'exit status {p.returncode}'}")

    def stop(self, lane: str, has_release: bool, stop_timeout: int = 30) -> None:
        """Stop and remove this lane's containers of this rank (only those)."""
        from builder.launch import stop_lane_command

        env = f"BUILDER_STOP_TIMEOUT={int(stop_timeout)}"
        if has_release:
            cmd = f"{env} {shlex.quote(self.root + '/current/stop.sh')}"
        else:
            cmd = stop_lane_command(lane, self.host.rank, stop_timeout)
        self._shell(cmd, timeout=self.timeout + 2 * stop_timeout, what="stop")

    def start(self, start_timeout: float) -> None:
        cmd = f"BUILDER_START_TIMEOUT={int(start_timeout)} {shlex.quote(self.root + '/current/start.sh')}"
        self._shell(cmd, timeout=self.timeout + start_timeout, what="start.sh")

    def wait(
        self, container: str, *, ports: list[int], addrs: list[str], health_port: int | None, timeout: float
    ) -> tuple[bool, str]:
        """(True, "") once this rank answers; else (False, why) within the bound."""
        req = {"container": container, "ports": ports, "addrs": addrs, "health_port": health_port,
               "timeout": timeout}
        out = self._script(WAIT_SCRIPT, req, timeout=timeout + self.timeout, what="wait")
        if out.get("ok"):
            return True, ""
        why = str(out.get("why") or "not ready")
        log = str(out.get("log") or "")
        return False, why + (f"; its log: {log}" if log else "")
