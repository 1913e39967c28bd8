"""A rank's derivations on its host: make them, and check them (runs ON the host; standard library only).

The plan (``derive.json`` in the bundle, written by builder.launch.derivplan) lists each derivation's folder
(addressed by its inputs), and the ``docker run`` that fills it, ``{out}`` standing for the folder it
writes into. Ships in every bundle as ``derive.py``:

* ``derive.py make PLAN [full]``: each derivation whose folder is not complete, or differs from its
  record (what `check` finds: without ``full``, by the size, mtime and inode recorded when each file
  was hashed; with ``full``, by hashing every file, as ``builder deploy --repair`` asks), is made: its
  command runs in the lane's image (network off) into a temp folder beside it, its container under a fixed
  name (the plan's ``--name``, else one per derivation and rank) removed (``docker rm -f -v``) before the run
  and when the run passes its timeout (which ends the docker client only); every file it wrote is
  hashed into the record ``.builder-derived.json`` with its size, mtime and inode; the folder takes its
  address's place whole (a folder already there is renamed aside first and removed after; put back if
  the new one cannot go in), so a run killed half-way leaves nothing under its address, and the next
  run makes it again. The temp folder and the aside are named as builder.core.atomic names every temp
  (``.tmp-builder-NAME.`` then a tag, the pid and a random part), which a host script, sent as its
  source alone, cannot import. One JSON object on stdout (per derivation: ``made`` or ``held``, seconds, files,
  and what differed: with ``full``, a folder or record that is gone counts as differed, since the
  rank's release expects it), a line on stderr as each starts and ends; exit 1 when one failed.
* ``derive.py check PLAN [full]``, or the check's ``python3 -c SOURCE '{"plan": …, "mode": …}'``: per
  derivation, what differs from its record: not made, another address, a file missing, resized, changed
  (full mode hashes; fast mode compares the recorded mtime and inode, trusting the file system), added,
  or another rank's file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

RECORD = ".builder-derived.json"
RANK_TAG = re.compile(r"(?:^|[^a-z0-9])r(?:ank)?(\d{1,3})of(\d{1,3})(?![0-9])", re.IGNORECASE)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def walk(folder: str) -> list[str]:
    """Every file under folder (relative, sorted), the record left out."""
    out = []
    for dirpath, _dirs, files in os.walk(folder):
        for fn in files:
            rel = os.path.relpath(os.path.join(dirpath, fn), folder)
            if rel != RECORD:
                out.append(rel)
    return sorted(out)


def read_record(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, RECORD), "rb") as f:
            rec = json.loads(f.read(64 << 20).decode("utf-8"))
        return rec if isinstance(rec, dict) else None
    except (OSError, ValueError):
        return None


def tmp_stem(path: str) -> str:
    """The start of every temp name that stands in for path beside it (builder.core.atomic's rule)."""
    return f".tmp-builder-{os.path.basename(path)}."


def tmp_name(path: str, tag: str = "") -> str:
    """A fresh temp path beside path: its stem, tag, this process's id and a random part."""
    return os.path.join(os.path.dirname(path), f"{tmp_stem(path)}{tag}{os.getpid()}.{secrets.token_hex(4)}")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def other_rank(rel: str, rank: int, world: int) -> bool:
    m = RANK_TAG.search(os.path.basename(rel))
    return m is not None and (int(m.group(1)), int(m.group(2))) != (rank, world)


def make_one(d: dict[str, Any], rank: int, world: int, full: bool = False) -> dict[str, Any]:
    path, start = d["path"], time.monotonic()
    if d.get("address") is None:
        return {"name": d["name"], "result": "failed", "why": "an input of it is not locked"}
    held, drift = held_or_drift(d, rank, world, full)
    if held is not None:
        return held
    parent = os.path.dirname(path)
    tmp = fresh_tmp(path)
    argv = [a.replace("{out}", tmp) for a in d["argv"]]
    name = container_name(argv, d["name"], rank)
    if name:  # a killed run's container, still there under the same name
        remove_container(name)
    if argv[:2] == ["docker", "run"]:  # its files are the host user's, as if the command ran here
        argv[2:2] = ["--user", f"{os.getuid()}:{os.getgid()}"]
    sys.stderr.write(f"derive: {d['name']}: making {os.path.basename(path)} (rank {rank} of {world})\n")
    sys.stderr.flush()
    why = run_into(argv, name, tmp, float(d.get("timeout") or 3600))
    if why:
        return {"name": d["name"], "result": "failed", "why": why}
    files = write_record(d, tmp, rank, world)
    why = place(tmp, path)
    if why:
        shutil.rmtree(tmp, ignore_errors=True)
        return {"name": d["name"], "result": "failed", "why": why}
    fsync_path(parent)
    secs = round(time.monotonic() - start, 3)
    sys.stderr.write(f"derive: {d['name']}: made {len(files)} file(s) in {secs:g} s\n")
    out = {"name": d["name"], "result": "made", "path": path, "files": len(files), "seconds": secs}
    return {**out, "differed": drift} if drift else out


def held_or_drift(d: dict[str, Any], rank: int, world: int, full: bool) -> tuple[dict[str, Any] | None, list[str]]:
    """The ``held`` result of a derivation whose folder still matches its record; else None, and what
    differs (with ``full``, a folder or record that is gone or for another address differs too)."""
    path = d["path"]
    rec = read_record(path)
    drift: list[str] = []
    if rec is not None and rec.get("address") == d["address"]:
        drift = check_one(d, rank, world, full)
        if not drift:
            return {"name": d["name"], "result": "held", "path": path, "files": len(rec.get("files") or [])}, []
        sys.stderr.write(f"derive: {d['name']}: {drift[0]}{' …' if len(drift) > 1 else ''}: making it again\n")
    elif full:  # a repair: the rank's release expects it, so a lost folder or record is drift too
        drift = [f"{path}: no record" if rec is None else f"{path}: made for another address"]
    return None, drift


def fresh_tmp(path: str) -> str:
    """A new, empty temp folder beside path, after removing the temps a killed run left there."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    for stale in os.listdir(parent):  # what a killed run left: never under the address itself
        if stale.startswith(tmp_stem(path)):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    tmp = tmp_name(path)
    os.makedirs(tmp)
    return tmp


def run_into(argv: list[str], name: str, tmp: str, limit: float) -> str:
    """Run the derivation's command, which writes into tmp: "" when it passed, else why it failed (tmp and
    its container, if it has one, then removed)."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=limit)
    except Ended:
        # the step ended (its ssh channel gone: the watchdog's TERM): its container and folder go with it
        if name:
            remove_container(name)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except subprocess.TimeoutExpired:
        # the timeout ends the docker client only; the container runs on, writing, until it is removed
        gone = remove_container(name) if name else ""
        shutil.rmtree(tmp, ignore_errors=True)
        what = f"; its container {name} {gone or 'removed'}" if name else ""
        return f"no end within {limit:g} s{what}"
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return str(e)[:400]
    if p.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = " | ".join(ln.strip() for ln in (p.stdout + p.stderr).splitlines() if ln.strip())[-600:]
        return f"exit {p.returncode}: {tail}"
    return ""


def write_record(d: dict[str, Any], tmp: str, rank: int, world: int) -> list[dict[str, Any]]:
    """Hash every file the command wrote into tmp, with the stat fast mode trusts, into the record there
    (tmp then synced); the files' entries."""
    files = []
    for rel in walk(tmp):
        fp = os.path.join(tmp, rel)
        digest = sha256_file(fp)
        fsync_path(fp)
        st = os.stat(fp)  # (what fast mode trusts: the stat of the bytes just hashed; a rename keeps it)
        files.append({"path": rel, "size": st.st_size, "sha256": digest, "mtime": st.st_mtime_ns,
                      "inode": st.st_ino})
    record = {"format": 1, "name": d["name"], "address": d["address"], "rank": rank, "world_size": world,
              "files": files}
    with open(os.path.join(tmp, RECORD), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)
    return files


def container_name(argv: list[str], derivation: str, rank: int) -> str:
    """The name of the container a `docker run` argv starts ("" for another command): its own --name, else
    one given here (a fixed name per derivation and rank), so a container left running can be found."""
    if argv[:2] != ["docker", "run"]:
        return ""
    for i, a in enumerate(argv):
        if a == "--name" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--name="):
            return a.split("=", 1)[1]
    name = "builder-derive-" + re.sub(r"[^A-Za-z0-9_.-]", "-", derivation) + f"-r{rank}"
    argv[2:2] = ["--name", name]
    return name


#: seconds for `docker rm -f -v` of a container left running
REMOVE_TIMEOUT = 120.0


def remove_container(name: str) -> str:
    """`docker rm -f -v NAME` (none there is fine; -v: with the volumes an image's VOLUME made for it): ""
    when it is gone, else why it may not be."""
    try:
        p = subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True, text=True, errors="replace",
                           timeout=REMOVE_TIMEOUT, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return f"not removed: `docker rm -f -v {name}` had no end within {REMOVE_TIMEOUT:g} s"
    except OSError as e:
        return f"not removed: docker: {e.strerror}"
    said = (p.stdout + p.stderr).strip()
    if p.returncode != 0 and "No such container" not in said:
        return f"not removed: `docker rm -f -v {name}`: {said[-300:] or f'exit {p.returncode}'}"
    return ""


def place(tmp: str, path: str) -> str:
    """Put the whole folder tmp at path: a folder already there (one without its record, or one that
    differs from it) is renamed aside, tmp renamed into its place, then the old one removed, so path
    never holds a half-made folder. "" when done, else why not."""
    aside = tmp_name(path, "old-")
    if os.path.lexists(path):
        try:
            os.rename(path, aside)
        except OSError as e:
            return f"cannot move {path} aside to make it again: {e}"
    try:
        os.rename(tmp, path)
    except OSError as e:
        if os.path.lexists(aside) and not os.path.lexists(path):
            os.rename(aside, path)  # the old folder back: never lost because the new one could not go in
        return f"cannot put {path} in place: {e}"
    shutil.rmtree(aside, ignore_errors=True)
    return ""


def make(plan: dict[str, Any], full: bool = False) -> dict[str, Any]:
    rank, world = int(plan["rank"]), int(plan["world_size"])
    results = [make_one(d, rank, world, full) for d in plan["derivations"]]
    return {"ok": all(r["result"] != "failed" for r in results), "derivations": results}


def check_one(d: dict[str, Any], rank: int, world: int, full: bool) -> list[str]:
    path = d["path"]
    rec = read_record(path)
    if rec is None:
        return [f"{path}: not made (no {RECORD}; `builder deploy --repair` or `builder start` on its fleet makes it)"]
    if rec.get("address") != d["address"]:
        return [f"{path}: made for address {str(rec.get('address'))[:16]}, expected {str(d['address'])[:16]}"]
    problems = []
    want = {f["path"]: f for f in rec.get("files") or []}
    present = walk(path)
    for rel in present:
        if other_rank(rel, rank, world):
            problems.append(f"{path}/{rel}: another rank's file (this host is rank {rank} of {world})")
        elif rel not in want:
            problems.append(f"{path}/{rel}: not in the derivation's record")
    for rel, f in sorted(want.items()):
        full_path = os.path.join(path, rel)
        if rel not in present:
            problems.append(f"{full_path}: missing")
            continue
        st = os.stat(full_path)
        if st.st_size != f["size"]:
            problems.append(f"{full_path}: expected {f['size']} bytes, found {st.st_size}")
        elif full:
            if sha256_file(full_path) != f["sha256"]:
                problems.append(f"{full_path}: content differs from the record (sha256)")
        elif "inode" in f and f["inode"] != st.st_ino:
            problems.append(f"{full_path}: expected inode {f['inode']}, found {st.st_ino} (replaced; fast mode)")
        elif "mtime" in f and f["mtime"] != st.st_mtime_ns:
            problems.append(f"{full_path}: expected mtime {f['mtime']}, found {st.st_mtime_ns} (modified; fast mode)")
    return problems


def check(plan: dict[str, Any], full: bool) -> dict[str, Any]:
    rank, world = int(plan["rank"]), int(plan["world_size"])
    return {d["name"]: check_one(d, rank, world, full) for d in plan["derivations"]}


# (derive.py and burnload.py each carry this: a host script is sent as one source text, importing
# nothing but the standard library)
class Ended(BaseException):
    """SIGTERM or SIGHUP while a derivation is made (a BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _end(signum: int, _frame: object) -> None:
    raise Ended(signum)


def main(argv: list[str]) -> int:
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _end)
    try:
        return _main(argv)
    except Ended as e:
        sys.stderr.write(f"derive: ended by signal {e.signum}\n")
        return 128 + e.signum


def _main(argv: list[str]) -> int:
    if argv[1].startswith("{"):
        req = json.loads(argv[1])
        sys.stdout.write(json.dumps(check(req["plan"], req.get("mode") == "full")))
        return 0
    with open(argv[2], "rb") as f:
        plan = json.load(f)
    if argv[1] == "make":
        out = make(plan, len(argv) > 3 and argv[3] == "full")
        sys.stdout.write(json.dumps(out))
        return 0 if out["ok"] else 1
    if argv[1] == "check":
        res = check(plan, len(argv) > 3 and argv[3] == "full")
        sys.stdout.write(json.dumps(res))
        return 0 if not any(res.values()) else 1
    sys.stderr.write(f"derive.py: unknown command {argv[1]!r}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
