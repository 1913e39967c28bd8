"""On a host: who holds its memory. Each running container's memory from its cgroup, the processes of
each container, and the biggest processes outside any container.

argv[1] is a JSON request ``{"processes": N}`` (how many of the biggest processes outside containers
to name; default 5). Prints JSON::

    {"cgroup": "v1" | "v2" | "",          # the memory hierarchy read ("": none found)
     "docker": "" | why,                  # why the running containers are unknown
     "containers": {ID: {"name", "held", "pids", "why"}},
     "processes": [{"pid", "name", "held"}, ...]}

``held`` is in bytes: for a container, what its cgroup holds that the kernel's MemAvailable does
not already count as available and that stopping the container frees: its charge less the file
pages on the LRU lists (page cache, which MemAvailable counts) and reclaimable slab, so anonymous
memory, tmpfs/shm and unreclaimable kernel memory (None when its cgroup is not readable, with
``why``). For a process outside containers it is its anonymous resident memory (RssAnon).

The running containers are the docker CLI's (``docker ps``); each one's cgroup is found from the
cgroup of its processes (/proc/PID/cgroup: a path component naming the container's full ID, as both
of docker's cgroup drivers name it), read under the memory hierarchy's mount point, cgroup v1
(memory.usage_in_bytes, memory.stat's total_* keys) or v2 (memory.current, memory.stat). The path
is matched from its end when the mount's root is not the hierarchy's (a host that is a container).

Standard library only: it runs as ``python3 -I -S -c SOURCE ARG`` (builder.hostscripts.source).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ID_RE = re.compile(r"[0-9a-f]{64}")


def read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def memory_mount(mounts: str) -> tuple[str, str]:
    """("v1" or "v2", mount point) of the memory controller's hierarchy in /proc/self/mounts' text,
    or ("", "") when there is none. A v1 memory mount wins over a v2 one (a hybrid host's cgroup2
    mount holds no controller)."""
    v2 = ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        where, kind, opts = parts[1].replace("\\040", " "), parts[2], parts[3].split(",")
        if kind == "cgroup" and "memory" in opts:
            return "v1", where
        if kind == "cgroup2" and not v2:
            controllers = read(os.path.join(where, "cgroup.controllers")) or ""
            if "memory" in controllers.split():
                v2 = where
    return ("v2", v2) if v2 else ("", "")


def memory_path(version: str, text: str) -> str | None:
    """The memory cgroup path in a /proc/PID/cgroup text (v1: the line naming the memory controller;
    v2: the ``0::`` line)."""
    for line in text.splitlines():
        num, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if version == "v1" and "memory" in controllers.split(","):
            return path
        if version == "v2" and num == "0" and controllers == "":
            return path
    return None


def container_of(path: str, ids: set[str]) -> tuple[str, str] | None:
    """(container ID, the container's cgroup path) when a component of `path` names one of `ids`
    (``docker-ID.scope`` or ``ID``); the last such component counts (a container in a container)."""
    parts = path.split("/")
    for i in range(len(parts) - 1, -1, -1):
        for found in ID_RE.findall(parts[i]):
            if found in ids:
                return found, "/".join(parts[: i + 1])
    return None


def cgroup_dir(mount: str, path: str) -> str | None:
    """The folder of cgroup `path` under the hierarchy's mount point: the whole path, or else its
    longest tail that exists there (the mount's root is then a cgroup below the hierarchy's root)."""
    parts = [p for p in path.split("/") if p and p != ".."]
    for i in range(len(parts)):
        d = os.path.join(mount, *parts[i:])
        if os.path.isdir(d):
            return d
    return None


def parse_stat(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def held_bytes(version: str, usage: int, stat: dict[str, int]) -> int:
    """What a cgroup holds that MemAvailable does not count: its charge less its file LRU pages
    (and, v2, its reclaimable slab). v1 counts the hierarchy's (``total_*``) where it has them."""
    if version == "v1":
        def key(k: str) -> int:
            return stat.get("total_" + k, stat.get(k, 0))

        free = key("active_file") + key("inactive_file")
    else:
        free = stat.get("active_file", 0) + stat.get("inactive_file", 0) + stat.get("slab_reclaimable", 0)
    return max(0, usage - free)


def cgroup_held(version: str, d: str) -> tuple[int | None, str]:
    usage_file = "memory.usage_in_bytes" if version == "v1" else "memory.current"
    usage, stat = read(os.path.join(d, usage_file)), read(os.path.join(d, "memory.stat"))
    if usage is None or stat is None or not usage.strip().isdigit():
        return None, f"{d}: no readable {usage_file} and memory.stat"
    return held_bytes(version, int(usage), parse_stat(stat)), ""


def running_containers() -> tuple[dict[str, str], str]:
    """{full ID: name} of the running containers, or {} and why not."""
    try:
        p = subprocess.run(["docker", "ps", "--no-trunc", "--format", "{{.ID}}\t{{.Names}}"],
                           capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        return {}, "docker: not found"
    except (OSError, subprocess.SubprocessError) as e:
        return {}, f"docker ps: {e}"
    if p.returncode != 0:
        return {}, "docker ps: " + ((p.stderr or p.stdout).strip().splitlines() or [f"exit {p.returncode}"])[-1]
    out = {}
    for line in p.stdout.splitlines():
        cid, _, name = line.partition("\t")
        if ID_RE.fullmatch(cid.strip()):
            out[cid.strip()] = name.strip()
    return out, ""


def status_fields(text: str) -> tuple[str, int | None]:
    """(Name, RssAnon in bytes or None: a kernel thread) from a /proc/PID/status text."""
    name, anon = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "Name":
            name = value.strip()
        elif key == "RssAnon":
            words = value.split()
            anon = int(words[0]) * 1024 if words and words[0].isdigit() else None
    return name, anon


def facts(req: dict[str, Any], proc: str = "/proc", mounts: str | None = None) -> dict[str, Any]:
    version, mount = memory_mount(mounts if mounts is not None else read(f"{proc}/self/mounts") or "")
    names, why = running_containers()
    ids = set(names)
    containers: dict[str, dict[str, Any]] = {
        cid: {"name": name, "held": None, "pids": [], "why": "no process of it seen in " + proc}
        for cid, name in names.items()
    }
    paths: dict[str, str] = {}
    others: list[dict[str, Any]] = []
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        pid = int(entry)
        text = read(f"{proc}/{entry}/cgroup")
        if text is None:  # gone meanwhile
            continue
        path = memory_path(version, text) if version else None
        found = None
        for candidate in [path] if path is not None else [ln.split(":", 2)[-1] for ln in text.splitlines()]:
            found = found or (container_of(candidate, ids) if ids else None)
        if found is not None:
            containers[found[0]]["pids"].append(pid)
            paths.setdefault(found[0], found[1])
            continue
        status = read(f"{proc}/{entry}/status")
        name, anon = status_fields(status or "")
        if anon:
            others.append({"pid": pid, "name": name, "held": anon})
    for cid, c in containers.items():
        c["pids"].sort()
        if not version:
            c["why"] = "no cgroup memory hierarchy mounted"
        elif cid in paths:
            d = cgroup_dir(mount, paths[cid])
            c["held"], c["why"] = cgroup_held(version, d) if d else (None, f"cgroup {paths[cid]} not under {mount}")
    others.sort(key=lambda p: (-p["held"], p["pid"]))
    return {"cgroup": version, "docker": why, "containers": containers,
            "processes": others[: int(req.get("processes", 5))]}


def main(argv: list[str]) -> int:
    req = json.loads(argv[1]) if len(argv) > 1 else {}
    sys.stdout.write(json.dumps(facts(req)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
