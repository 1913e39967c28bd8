#!/usr/bin/env python3
"""Edits of one file on a test host, run there as root through `docker exec` (the back door): they stand
for what goes wrong on a real Spark (bit rot, a hand edit, a copy over the wrong file).

A standalone script (standard library only), sent as `python3 - REQUEST` with its source on stdin by
tests.lib.journeylib.edit_on; REQUEST is JSON: {"op": ..., "path": ...} and the op's own keys. `read`
prints the file's bytes (base64) and mtime as JSON; the others print nothing. Tests on this machine
import ``flip_in_place`` from it too.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from typing import Any


def flip_in_place(p: str | os.PathLike[str]) -> None:
    """One byte in the middle of the file changed in place, its size and mtime put back (bit rot: what
    fast mode cannot see)."""
    st = os.stat(p)
    at = st.st_size // 2
    with open(p, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def main(req: dict[str, Any]) -> None:
    p = req["path"]
    st = os.stat(p)
    op = req["op"]
    if op == "read":
        with open(p, "rb") as f:
            data = f.read()
        print(json.dumps({"data": base64.b64encode(data).decode(), "mtime_ns": st.st_mtime_ns}))
    elif op == "write_in_place":  # same inode, same size, mtime put back (or set to req's)
        with open(p, "r+b") as f:
            f.write(base64.b64decode(req["data"]))
        os.utime(p, ns=(st.st_atime_ns, req.get("mtime_ns", st.st_mtime_ns)))
    elif op == "replace":  # the whole file, in place
        with open(p, "wb") as f:
            f.write(base64.b64decode(req["data"]))
    elif op == "flip":  # one byte in place, size and mtime kept
        flip_in_place(p)
    elif op == "touch":  # five seconds later, bytes unchanged
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    elif op == "set_mtime":
        os.utime(p, ns=(st.st_atime_ns, req["mtime_ns"]))
    elif op == "json_set":  # one top-level key of a JSON file
        with open(p) as f:
            doc = json.load(f)
        doc[req["key"]] = req["value"]
        with open(p, "w") as f:
            json.dump(doc, f)
    else:
        raise SystemExit(f"hostedit: unknown op {op!r}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
