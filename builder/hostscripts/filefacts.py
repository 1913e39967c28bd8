"""On a host: stat (fast mode) or stat and sha256 (full mode) files, or list folders; JSON on stdout.

argv[1] is a JSON request, one of:

* ``{"paths": [...], "hash": bool, "jobs": int}``: ``{path: {"size", "mtime_ns", "inode"[, "sha256"]}}``,
  or ``{path: {"error": why}}``; with ``hash``, files are hashed in ``jobs`` threads (one thread
  when they hold less than ``THREADS_FROM`` bytes in all);
* ``{"roots": [...]}``: ``{root: [every regular file under it, relative, sorted]}``, ``null`` for a
  root that is not a folder;
* ``{"record": PATH, "under": DIR, "hash": bool, "jobs": int}``: as ``paths``, for ``DIR/<path>`` of
  each entry of the JSON file PATH's ``files`` list (an apply record's): the files a record names,
  found in the same call as the record, not in a second one after it was read. Exit status 1 when
  PATH is not such a record.

Progress goes to the file descriptor in $BUILDER_PROGRESS_FD, one byte per file, per 8 MiB hashed and
per folder listed: the batch (batch.py) restarts this fact's time bound on each, so a long hash goes
on while a read that hangs does not. Run on its own, without that variable, it reports nothing.

Standard library only: it runs as ``python3 -I -S -c SOURCE ARG`` (builder.hostscripts.source).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

CHUNK = 8 << 20


def progress() -> Callable[[], None]:
    """A function that reports one step of progress (a no-op without $BUILDER_PROGRESS_FD)."""
    fd_text = os.environ.get("BUILDER_PROGRESS_FD")
    if not fd_text:
        return lambda: None
    fd = int(fd_text)
    os.set_blocking(fd, False)

    def tick() -> None:
        try:
            os.write(fd, b".")
        except OSError:  # a full pipe (progress enough) or a closed one
            pass

    return tick


def stat_file(path: str, want_hash: bool, tick: Callable[[], None]) -> dict[str, object]:
    try:
        st = os.stat(path)
    except OSError as e:
        return {"error": e.strerror or str(e)}
    finally:
        tick()
    if not os.path.isfile(path):
        return {"error": "not a regular file"}
    out: dict[str, object] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    if want_hash:
        h = hashlib.sha256()
        try:
            with open(path, "rb", buffering=0) as f:
                while b := f.read(CHUNK):
                    h.update(b)
                    tick()
        except OSError as e:
            return {"error": e.strerror or str(e)}
        out["sha256"] = h.hexdigest()
    return out


#: the fewest bytes to hash for which threads pay: below it (a release's launch files, a few KiB)
#: starting the threads costs more CPU than the hashing they share
THREADS_FROM = 64 << 20


def total_size(paths: list[str]) -> int:
    """The bytes of the files among `paths` that can be stat'ed."""
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_size
        except OSError:
            pass
    return total


def stat_files(paths: list[str], want_hash: bool, jobs: int, tick: Callable[[], None]) -> dict[str, object]:
    if want_hash and jobs > 1 and len(paths) > 1 and total_size(paths) >= THREADS_FROM:
        with ThreadPoolExecutor(jobs) as ex:
            return dict(zip(paths, ex.map(lambda p: stat_file(p, True, tick), paths), strict=True))
    # stat only, or little to hash: no threads, which would cost more to start than they save
    return {p: stat_file(p, want_hash, tick) for p in paths}


def list_roots(roots: list[str], tick: Callable[[], None]) -> dict[str, list[str] | None]:
    out: dict[str, list[str] | None] = {}
    for root in roots:
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
    return out


def recorded_paths(record: str, under: str) -> list[str] | None:
    """``under/<path>`` for each entry of the record's ``files`` list, in its order; None when the
    record cannot be read or has no such list."""
    try:
        with open(record, "rb") as f:
            files = json.load(f).get("files")
        return [f"{under}/{e['path']}" for e in files]
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return None


def main(argv: list[str]) -> int:
    req = json.loads(argv[1])
    tick = progress()
    if "roots" in req:
        answer: object = list_roots(list(req["roots"]), tick)
    elif "record" in req:
        paths = recorded_paths(req["record"], req["under"])
        if paths is None:
            sys.stderr.write(f"{req['record']}: no apply record with a files list\n")
            return 1
        answer = stat_files(paths, bool(req.get("hash")), int(req.get("jobs", 4)), tick)
    else:
        answer = stat_files(list(req["paths"]), bool(req.get("hash")), int(req.get("jobs", 4)), tick)
    sys.stdout.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
