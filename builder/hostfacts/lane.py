"""The lane on one host, for `builder deploy` and `builder status` (runs ON the host; standard library only).

The request (argv[1], JSON) names what to do:

* ``{"do": "state", "root", "lane", "rank", "health_port", "label_lane", "label_rank", "label_bundle"}``:
  the installer's links (``current``, ``previous``, ``staged``), the releases present, the apply record's
  bundle, lock and image, this lane's containers of this rank (by the labels start.sh gives them, so
  nothing else is looked at) and, with a ``health_port``, whether ``/health`` answers on 127.0.0.1;
* ``{"do": "wait", "container", "ports", "addrs", "health_port", "timeout"}``: wait until this rank
  answers (a worker: any of its ports on any of the addresses; the head: ``/health``), or its container
  ended, or the bound passed; the container's last log lines say why it ended.

It prints one JSON object. The Docker Engine is asked on its unix socket (HTTP/1.0: one request, the
answer until the peer closes) when DOCKER_HOST names one, as a docker CLI start per poll costs more;
any other engine through the docker CLI.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

RELEASE_ID = re.compile(r"^[0-9a-f]{64}$")
DOCKER_HOST = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")


def http_get(sock: socket.socket, path: str, host: str) -> tuple[int, bytes]:
    """One GET over a connected socket: (status, body)."""
    sock.settimeout(30)
    sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def engine_get(path: str) -> tuple[int, bytes]:
    """A GET of the Engine API on DOCKER_HOST's unix socket."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(DOCKER_HOST[len("unix://"):])
    return http_get(s, path, "docker")


# ----------------------------------------------------------------------------- state


def link(root: str, name: str) -> str | None:
    """The release id a link of the installer's points at (None: no link, or not a release)."""
    try:
        bid = os.path.basename(os.readlink(os.path.join(root, name)).rstrip("/"))
    except OSError:
        return None
    return bid if RELEASE_ID.match(bid) else None


def applied(root: str) -> dict[str, Any] | None:
    """What the apply record says of the installed release."""
    try:
        with open(os.path.join(root, "state", "applied.json"), "rb") as f:
            rec = json.loads(f.read(64 << 20).decode("utf-8"))
        img = rec.get("image") or {}
        out = {k: rec.get(k) for k in ("bundle_id", "lock_hash", "action", "applied_at", "lane", "previous_bundle_id")}
        out["image_id"] = img.get("image_id")
        out["image"] = img.get("name")
        return out
    except (OSError, ValueError, AttributeError):
        return None


def containers(req: dict[str, Any]) -> list[dict[str, str]]:
    """This lane's containers of this rank, running or not."""
    lane, rank = req["lane"], str(req["rank"])
    found: list[dict[str, str]] = []
    if DOCKER_HOST.startswith("unix://"):  # (as `docker ps -a` asks it)
        filters = json.dumps({"label": [f"{req['label_lane']}={lane}", f"{req['label_rank']}={rank}"]})
        q = "".join(c if c.isalnum() or c in "-_.~" else f"%{ord(c):02X}" for c in filters)
        code, body = engine_get("/containers/json?all=1&filters=" + q)
        if code != 200:
            raise OSError(f"docker engine answered HTTP {code}")
        for c in json.loads(body):
            labels = c.get("Labels") or {}
            found.append({"id": c["Id"][:12], "name": (c.get("Names") or ["?"])[0].lstrip("/"),
                          "state": c.get("State", ""), "bundle": labels.get(req["label_bundle"], ""),
                          "image": c.get("ImageID") or c.get("Image", ""), "status": c.get("Status", "")})
        return found
    label = '{{.Label "LABEL"}}'.replace
    fmt = "\t".join(["{{.ID}}", "{{.Names}}", "{{.State}}", label("LABEL", req["label_bundle"]),
                     label("LABEL", req["label_rank"]), "{{.Image}}", "{{.Status}}"])
    p = subprocess.run(["docker", "ps", "-a", "--no-trunc", "--filter", f"label={req['label_lane']}={lane}",
                        "--format", fmt], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise OSError((p.stderr.strip().splitlines() or ["docker ps failed"])[-1])
    for line in p.stdout.splitlines():
        parts = line.split("\t")
        if len(parts) == 7 and parts[4] == rank:
            found.append({"id": parts[0][:12], "name": parts[1], "state": parts[2], "bundle": parts[3],
                          "image": parts[5], "status": parts[6]})
    return found


def health(port: int, any_container: bool) -> dict[str, Any]:
    """Whether /health answers 200 on 127.0.0.1 (three tries: a busy engine may miss one answer)."""
    got: dict[str, Any] = {}
    for _ in range(3):
        try:
            code, _ = http_get(socket.create_connection(("127.0.0.1", port), timeout=5), "/health", "127.0.0.1")
            got = {"status": code}
            if code == 200:
                break
        except (OSError, ValueError, IndexError) as e:
            got = {"status": None, "error": str(e)[:200]}
        if not any_container:
            break
        time.sleep(0.5)
    return got


def state(req: dict[str, Any]) -> dict[str, Any]:
    root = req["root"]
    out: dict[str, Any] = {n: link(root, n) for n in ("current", "previous", "staged")}
    try:
        out["releases"] = sorted(n for n in os.listdir(os.path.join(root, "releases")) if RELEASE_ID.match(n))
    except OSError:
        out["releases"] = []
    out["applied"] = applied(root)
    out["containers"], out["docker"] = [], ""
    try:
        out["containers"] = containers(req)
    except (OSError, ValueError, KeyError, IndexError, subprocess.TimeoutExpired) as e:
        out["docker"] = f"docker: {e}"
    out["health"] = health(req["health_port"], bool(out["containers"])) if req.get("health_port") else None
    return out


# ----------------------------------------------------------------------------- wait


def container_state(name: str) -> tuple[str, Any]:
    """(status, exit code) of the container: ``missing`` when there is none, ``unknown`` when the engine
    did not answer."""
    try:
        if DOCKER_HOST.startswith("unix://"):
            status, body = engine_get(f"/containers/{name}/json")
            if status == 404:
                return "missing", None
            got = json.loads(body)["State"]
            return got["Status"], got.get("ExitCode")
        p = subprocess.run(["docker", "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", name],
                           capture_output=True, text=True, timeout=30)
    except (OSError, ValueError, KeyError, IndexError, subprocess.TimeoutExpired):
        return "unknown", None
    if p.returncode != 0:
        return "missing", None
    st, _, code = p.stdout.strip().partition(" ")
    return st, code


def answers(ports: list[int], addrs: list[str]) -> bool:
    for port in ports:
        for addr in addrs:
            try:
                socket.create_connection((addr, port), timeout=2).close()
                return True
            except OSError:
                pass
    return False


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as r:
            return bool(r.status == 200)
    except Exception:  # (any failure to answer is "not yet")
        return False


def logs(name: str) -> str:
    try:
        p = subprocess.run(["docker", "logs", "--tail", "5", name], capture_output=True, text=True, timeout=30)
        return " | ".join(ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.strip())[-600:]
    except (OSError, subprocess.TimeoutExpired):
        return ""


def wait(req: dict[str, Any]) -> dict[str, Any]:
    start = time.monotonic()
    deadline = start + req["timeout"]
    name = req["container"]
    while True:
        st, code = container_state(name)
        if st in ("exited", "dead", "missing"):
            why = f"container {name} " + ("is gone" if st == "missing" else f"exited (code {code})")
            return {"ok": False, "why": why, "log": logs(name)}
        if st == "running" and (healthy(req["health_port"]) if req.get("health_port")
                                else answers(req["ports"], req["addrs"])):
            return {"ok": True, "seconds": round(time.monotonic() - start, 3)}
        if time.monotonic() > deadline:
            what = "/health" if req.get("health_port") else "ports " + ",".join(map(str, req["ports"]))
            return {"ok": False, "why": f"{what} did not answer within {req['timeout']:g} s (container {st})",
                    "log": logs(name)}
        time.sleep(0.3)


def main(argv: list[str]) -> int:
    req = json.loads(argv[1])
    sys.stdout.write(json.dumps(state(req) if req["do"] == "state" else wait(req)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
