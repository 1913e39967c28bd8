"""The lane on one host, for `builder deploy` and `builder status` (runs ON the host; standard library only).

The request (argv[1], JSON) names what to do:

* ``{"do": "state", "root", "lane", "rank", "health_port", "filters", "label_rank", "label_bundle"}``:
  the installer's links (``current``, ``previous``, ``staged``: the layout install.pyz keeps, see
  builder/installer/__init__.py), the releases present, the apply record's bundle, lock and image, this
  lane's containers of this rank (by the labels start.sh gives them, so nothing else is looked at:
  ``filters``, docker's --filter arguments, builder.core.labels.lane_filters)
  and, with a ``health_port``, whether ``/health`` answers on 127.0.0.1;
* ``{"do": "wait", "container", "ready", "timeout"}``: wait until this rank meets its readiness
  (``ready``, as builder.launch.rank renders it: its health path, a port, a log line, or running), or
  its container ended, or the bound passed; the container's last log lines say why it ended (each
  secret-named value masked: `redact`). A container that runs but is not ready in time is said to be
  "waiting for a peer" only where ``ready`` has ``peer`` (builder.launch.rank sets it on a worker of a
  lane that starts its workers before its head, whose rule is a port or running).

It prints one JSON object. start.sh, which ships this module in the bundle as lane.py, calls it with
plain arguments instead (see `cli`). The Docker Engine is asked through the docker CLI (whatever engine
DOCKER_HOST names), the rank's /health through urllib.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

RELEASE_ID = re.compile(r"^[0-9a-f]{64}$")
#: what the docker CLI says of a name that is no container (its exit status is 1 for any failure)
NO_SUCH = ("No such object", "No such container")


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
        out = {k: rec.get(k) for k in ("bundle_id", "lock_hash", "action", "applied_at", "lane", "previous_bundle_id",
                                       "manifest_sha256", "files")}  # (the last two: a repair checks them)
        out["image_id"] = img.get("image_id")
        out["image"] = img.get("name")
        return out
    except (OSError, ValueError, AttributeError):
        return None


def containers(req: dict[str, Any]) -> list[dict[str, str]]:
    """This lane's containers of this rank, running or not."""
    rank = str(req["rank"])
    label = '{{.Label "LABEL"}}'.replace
    fmt = "\t".join(["{{.ID}}", "{{.Names}}", "{{.State}}", label("LABEL", req["label_bundle"]),
                     label("LABEL", req["label_rank"]), "{{.Image}}", "{{.Status}}"])
    p = subprocess.run(["docker", "ps", "-a", "--no-trunc", *req["filters"],
                        "--format", fmt], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise OSError((p.stderr.strip().splitlines() or ["docker ps failed"])[-1])
    found: list[dict[str, str]] = []
    for line in p.stdout.splitlines():
        parts = line.split("\t")
        if len(parts) == 7 and parts[4] == rank:
            c = {"id": parts[0][:12], "name": parts[1], "state": parts[2], "bundle": parts[3],
                 "image": parts[5], "status": parts[6]}
            if c["state"] in ("exited", "dead"):  # how and when it ended, and what it said last
                c["exit_code"], c["finished_at"] = ended(c["id"])
                c["log"] = logs(c["id"])
            found.append(c)
    return found


def ended(container: str) -> tuple[str, str]:
    """(exit code, finish time) of a container that ended ("" each when the engine does not say)."""
    try:
        p = subprocess.run(["docker", "inspect", "--type", "container", "-f",
                            "{{.State.ExitCode}} {{.State.FinishedAt}}", container],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "", ""
    code, _, when = p.stdout.strip().partition(" ")
    return (code, when) if p.returncode == 0 else ("", "")


#: urllib without proxies: a host's http_proxy must not carry a request for its own 127.0.0.1
LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def health_status(port: int, timeout: float, path: str = "/health") -> dict[str, Any]:
    """One GET of `path` on 127.0.0.1: ``{"status": code}``, or ``{"status": None, "error": why}``."""
    try:
        with LOCAL.open(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return {"status": r.status}
    except urllib.error.HTTPError as e:
        return {"status": e.code}
    except (OSError, ValueError) as e:
        return {"status": None, "error": str(e)[:200]}


def health(port: int, any_container: bool) -> dict[str, Any]:
    """Whether /health answers 200 on 127.0.0.1 (three tries: a busy engine may miss one answer)."""
    got: dict[str, Any] = {}
    for _ in range(3):
        got = health_status(port, 5)
        if got["status"] == 200 or not any_container:
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
        p = subprocess.run(["docker", "inspect", "--type", "container", "-f", "{{.State.Status}} {{.State.ExitCode}}",
                            name], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown", None
    if p.returncode != 0:
        return ("missing" if any(n in p.stderr for n in NO_SUCH) else "unknown"), None
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


#: a secret's name: a word of its own (split at "_" or "-") that is token, key, secret or password
_SECRET_NAME = r"(?:[A-Za-z0-9]+[_-])*(?:token|key|secret|password|passwd|apikey)(?:[_-][A-Za-z0-9]+)*(?![A-Za-z0-9])"
_VALUE = r"[^\s\"',;|})\]]+"
#: ``--api-key X``, ``--hf-token=X``; ``HF_TOKEN=X``, ``"api_key": "X"``, ``password: X``
_SECRETS = re.compile(
    rf"(?<![A-Za-z0-9])(--{_SECRET_NAME}(?:=|\s+))({_VALUE})"
    rf"|(?<![A-Za-z0-9-])([\"']?{_SECRET_NAME}[\"']?\s*[:=]\s*[\"']?)({_VALUE})",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """text with the value of every secret-named argument, variable or key masked: engines print their
    arguments and environment, and their last log lines go into audit reports, status and deploy
    reasons (the checks use this too)."""
    return _SECRETS.sub(lambda m: (m.group(1) or m.group(3)) + "***", text)


def logs(name: str) -> str:
    try:
        p = subprocess.run(["docker", "logs", "--tail", "5", name], capture_output=True, text=True, timeout=30)
        return redact(" | ".join(ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.strip()))[-600:]
    except (OSError, subprocess.TimeoutExpired):
        return ""


def log_matches(name: str, pattern: str) -> bool:
    try:
        p = subprocess.run(["docker", "logs", name], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return re.search(pattern, p.stdout + p.stderr, re.MULTILINE) is not None


#: a rank whose readiness is its container running must have run this long without exiting
SETTLE_SECONDS = 3.0
#: a rank's readiness is asked at once, again after FIRST_POLL seconds, then each time 1.5 times later, at
#: most every LAST_POLL seconds: a quick rank is seen at once, and an engine that loads for minutes is not
#: asked (a `docker inspect`, and its log or health) three times a second all that while
FIRST_POLL, LAST_POLL = 0.3, 2.0


def ready_now(name: str, ready: dict[str, Any], running_since: float) -> bool:
    """Whether a running container meets its rank's readiness (builder.launch.rank.ready_spec)."""
    kind = ready["kind"]
    if kind == "health":
        return bool(health_status(int(ready["port"]), 3, str(ready.get("path") or "/health"))["status"] == 200)
    if kind == "port":
        return answers([int(ready["port"])], ["127.0.0.1"])
    if kind == "log":
        return log_matches(name, str(ready["pattern"]))
    return time.monotonic() - running_since >= SETTLE_SECONDS


def describe(ready: dict[str, Any]) -> str:
    kind = ready["kind"]
    if kind == "health":
        return f"{ready.get('path') or '/health'} on port {ready['port']}"
    if kind == "port":
        return f"port {ready['port']}"
    if kind == "log":
        return f"a log line matching {ready['pattern']!r}"
    return "a running container"


def wait(req: dict[str, Any]) -> dict[str, Any]:
    """Wait until the container meets ``ready``, or it ended, or the bound passed."""
    start = time.monotonic()
    deadline = start + float(req["timeout"])
    name = req["container"]
    ready = req["ready"]
    since: float | None = None
    pause = FIRST_POLL
    while True:
        st, code = container_state(name)
        if st in ("exited", "dead", "missing"):
            when = ended(name)[1] if st != "missing" else ""
            why = f"container {name} " + ("is gone" if st == "missing" else
                                          f"exited (code {code}{' at ' + when if when else ''})")
            return {"ok": False, "state": "exited", "why": why, "log": logs(name)}
        if st == "running":
            since = since if since is not None else time.monotonic()
            if ready_now(name, ready, since):
                return {"ok": True, "seconds": round(time.monotonic() - start, 3)}
        else:
            since = None
        if time.monotonic() >= deadline:
            if st == "running":  # up, but not ready; a worker started before its head (``peer``) waits for it
                peer = ": waiting for a peer" if ready.get("peer") else ""
                return {"ok": False, "state": "running", "why": f"container {name} runs but is not ready "
                        f"({describe(ready)} did not answer within {float(req['timeout']):g} s){peer}",
                        "log": logs(name)}
            return {"ok": False, "state": st, "why": f"{describe(ready)} did not answer within "
                    f"{float(req['timeout']):g} s (container {st})", "log": logs(name)}
        nap = min(pause, deadline - time.monotonic())
        if since is not None and ready["kind"] == "running":  # (ready the moment it has settled)
            nap = min(nap, since + SETTLE_SECONDS - time.monotonic())
        time.sleep(max(0.0, nap))
        pause = min(pause * 1.5, LAST_POLL)


def bundle_id(manifest: str) -> str:
    with open(manifest, "rb") as f:
        return str(json.load(f)["bundle_id"])


def cli(argv: list[str]) -> int:
    """start.sh's calls: ``bundle-id MANIFEST``; ``answers ADDR PORT...`` (exit 0 when any port
    accepts a connection); ``wait NAME READY_JSON TIMEOUT`` (exit 0 once ready, else 1 saying why)."""
    cmd, args = argv[1], argv[2:]
    if cmd == "bundle-id":
        print(bundle_id(args[0]))
        return 0
    if cmd == "answers":
        return 0 if answers([int(p) for p in args[1:]], [args[0]]) else 1
    if cmd == "wait":
        out = wait({"container": args[0], "ready": json.loads(args[1]), "timeout": float(args[2])})
        if out["ok"]:
            return 0
        log = out.get("log") or ""
        sys.stderr.write(f"{out['why']}" + (f"; its log: {log}" if log else "") + "\n")
        return 1
    sys.stderr.write(f"lane.py: unknown command {cmd!r}\n")
    return 2


def main(argv: list[str]) -> int:
    if not argv[1].startswith("{"):
        return cli(argv)
    req = json.loads(argv[1])
    sys.stdout.write(json.dumps(state(req) if req["do"] == "state" else wait(req)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
