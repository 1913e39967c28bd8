"""On a host: run the burn gate's load and sample the GPUs while it runs.

argv[1] is a JSON request::

    {"command": [ARGV...],        # the load (the host profile's burn command, placeholders filled)
     "timeout": 60,               # seconds before the load is killed (a hung load is a finding)
     "interval": 0.5,             # seconds between samples
     "query": [ARGV...],          # the nvidia-smi --query-gpu call of one sample
     "fallback": [ARGV...],       # optional: the same with the older field names, where `query` is refused
     "cleanup": [ARGV...]}        # optional: run before the load and after a load killed at its timeout

Prints JSON::

    {"rc": N | null, "timed_out": bool, "seconds": S, "stdout": TAIL, "stderr": TAIL,
     "samples": [{"t": S, "rc": N, "out": TEXT}, ...], "fields": "query" | "fallback",
     "cleanup": [{"when": "before" | "after timeout", "rc": N, "out": TEXT}, ...]}   # [] without one

A container outlives its killed docker CLI: the profile's cleanup (``docker rm -f NAME``) removes it.
Its failure does not stop the burn (before the load, no container is the usual case); it is reported.

``t`` counts from the load's start; the first sample is taken just before it (t < 0), the GPU at
rest. nvidia-smi answers one query in about 0.03 s (lessons.md §9.1), so sampling costs the load
nothing. A sample that fails keeps its exit status and output: the operator's side says why. One
unknown field fails a whole query (lessons.md §9.1: ``Field "x" is not a valid field to query.``,
exit 2): where the first sample's query is refused so, every sample uses `fallback`, and ``fields``
says which list the samples answer.

Standard library only: it runs as ``python3 -I -S -c SOURCE ARG`` (builder.hostscripts.source).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

TAIL = 4000  # characters of the load's output kept


def sample(query: list[str], t: float) -> dict[str, Any]:
    try:
        p = subprocess.run(query, capture_output=True, text=True, errors="replace", timeout=5, check=False)
        return {"t": round(t, 3), "rc": p.returncode, "out": (p.stdout + p.stderr)[-TAIL:]}
    except subprocess.TimeoutExpired:
        return {"t": round(t, 3), "rc": 124, "out": "nvidia-smi: no answer within 5 s"}
    except OSError as e:
        return {"t": round(t, 3), "rc": 127, "out": f"{query[0]}: {e.strerror}"}


CLEANUP_TIMEOUT = 30.0  # seconds for the cleanup command (docker rm -f of a stuck container)


def clean(argv: list[str], when: str) -> dict[str, Any]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=CLEANUP_TIMEOUT,
                           stdin=subprocess.DEVNULL, check=False)
        return {"when": when, "rc": p.returncode, "out": (p.stdout + p.stderr)[-TAIL:]}
    except subprocess.TimeoutExpired:
        return {"when": when, "rc": 124, "out": f"{argv[0]}: no end within {CLEANUP_TIMEOUT:g} s"}
    except OSError as e:
        return {"when": when, "rc": 127, "out": f"{argv[0]}: {e.strerror}"}


def run(req: dict[str, Any]) -> dict[str, Any]:
    command, query = list(req["command"]), list(req["query"])
    timeout, interval = float(req.get("timeout", 60)), float(req.get("interval", 0.5))
    cleanup = list(req.get("cleanup") or [])
    cleaned = [clean(cleanup, "before")] if cleanup else []
    fields = "query"
    samples = [sample(query, -1.0)]  # the GPU at rest, just before the load
    if req.get("fallback") and samples[0]["rc"] != 0 and "is not a valid field to query" in samples[0]["out"]:
        query, fields = list(req["fallback"]), "fallback"
        samples = [sample(query, -1.0)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        try:
            # a session of its own: a timed-out load is killed with everything it started; and it gets
            # SIGKILL should this script die first (a KILL that came before its handler could run)
            p = subprocess.Popen([sys.executable, "-c", _WITH_PARENT, str(os.getpid()), *command], stdout=out,
                                 stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            return {"rc": 127, "timed_out": False, "seconds": 0.0, "stdout": "",
                    "stderr": f"{command[0]}: {e.strerror}", "samples": samples, "fields": fields,
                    "cleanup": cleaned}
        timed_out = False
        try:
            timed_out = _watch(p, t0, timeout, interval, query, samples)
        except Ended:
            # the step ended (its ssh channel gone: the host's watchdog TERMs its group, KILL 3 s later);
            # the load runs in a session of its own, so it is ended here, then the profile's cleanup
            _kill(p)
            if cleanup:
                clean(cleanup, "after a signal")
            raise
        if timed_out and cleanup:
            cleaned.append(clean(cleanup, "after timeout"))
        seconds = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        return {
            "rc": None if timed_out else p.returncode,
            "timed_out": timed_out,
            "seconds": round(seconds, 3),
            "stdout": out.read().decode(errors="replace")[-TAIL:],
            "stderr": err.read().decode(errors="replace")[-TAIL:],
            "samples": samples,
            "fields": fields,
            "cleanup": cleaned,
        }


#: set the parent-death signal (SIGKILL), check the parent still lives, become the load (the signal
#: survives exec; a missing program exits 127 as a shell's would)
_WITH_PARENT = (
    "import os,sys\n"
    "try:\n import ctypes;ctypes.CDLL(None).prctl(1,9,0,0,0)\n"
    "except Exception:pass\n"
    "if os.getppid()!=int(sys.argv[1]):os._exit(137)\n"
    "try:\n os.execvp(sys.argv[2],sys.argv[2:])\n"
    "except OSError as e:\n sys.stderr.write('%s: %s' % (sys.argv[2], e.strerror));os._exit(127)\n"
)


def _watch(p: subprocess.Popen[bytes], t0: float, timeout: float, interval: float, query: list[str],
           samples: list[dict[str, Any]]) -> bool:
    """Sample the GPUs every `interval` while the load runs; True when it ran past `timeout` (then killed)."""
    while True:
        nxt = time.monotonic() + interval
        if p.poll() is not None:
            return False
        if time.monotonic() - t0 > timeout:
            _kill(p)
            return True
        samples.append(sample(query, time.monotonic() - t0))
        time.sleep(max(0.0, nxt - time.monotonic()))


def _kill(p: subprocess.Popen[bytes]) -> None:
    """The load and everything it started (its session)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        pass
    p.wait()


# (derive.py and burnload.py each carry this: a host script is sent as one source text, importing
# nothing but the standard library)
class Ended(BaseException):
    """SIGTERM or SIGHUP while the load runs (a BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _end(signum: int, _frame: object) -> None:
    raise Ended(signum)


def main(argv: list[str]) -> int:
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _end)
    try:
        print(json.dumps(run(json.loads(argv[1]))))
    except Ended as e:
        sys.stderr.write(f"burnload: ended by signal {e.signum}\n")
        return 128 + e.signum
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
