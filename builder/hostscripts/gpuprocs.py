"""On a host: whose the GPU's compute processes are, from the variables builder sets in every rank.

Every rank's container runs with ``BUILDER_LANE``, ``BUILDER_FLEET``, ``BUILDER_HOST`` and
``BUILDER_RANK`` in its environment (builder.launch.rank), and a container's process is a process of
the host too, so ``/proc/PID/environ`` names the lane of each process seen from the host, with or
without Docker (the H200 capture host has none). A process whose environment cannot be read (another
user's, as a non-root audit sees it) reads as unknown, never as the lane's.

argv[1] is a JSON request ``{"pids": [PID, ...]}``. Prints JSON::

    {"pids": {"PID": {"BUILDER_LANE": ..., "BUILDER_RANK": ..., ...} | null}, "why": {"PID": why}}

Standard library only: it runs as ``python3 -I -S -c SOURCE ARG`` (builder.hostscripts.source).
"""

from __future__ import annotations

import json
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

OWN = ("BUILDER_LANE", "BUILDER_FLEET", "BUILDER_HOST", "BUILDER_RANK")


def builder_env(environ: bytes) -> dict[str, str]:
    """The builder variables of a /proc/PID/environ (NUL-separated NAME=VALUE)."""
    out: dict[str, str] = {}
    for item in environ.split(b"\0"):
        name, sep, value = item.partition(b"=")
        key = name.decode(errors="replace")
        if sep and key in OWN:
            out[key] = value.decode(errors="replace")
    return out


def read(pids: list[int], proc: str = "/proc") -> dict[str, Any]:
    found: dict[str, Any] = {}
    why: dict[str, str] = {}
    for pid in pids:
        try:
            with open(f"{proc}/{int(pid)}/environ", "rb") as f:
                found[str(pid)] = builder_env(f.read())
        except OSError as e:
            found[str(pid)] = None
            why[str(pid)] = e.strerror or type(e).__name__
    return {"pids": found, "why": why}


def main(argv: list[str]) -> int:
    print(json.dumps(read([int(p) for p in json.loads(argv[1])["pids"]])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
