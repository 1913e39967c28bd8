"""Helpers shared by the check modules (imported as `checklib`; checks/ is on sys.path under pytest)."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

APPLIED_CACHE: dict[str, tuple[dict[str, Any] | None, str]] = {}
EXISTS_CACHE: dict[str, bool] = {}
LIST_CACHE: dict[str, Any] = {}

#: the commands the checks look for, found with one remote command (one pytest process = one host)
KNOWN_COMMANDS = ("docker", "nvidia-smi")


def need(value: Any, reason: str) -> Any:
    """The expectation, or skip the check saying why it is absent."""
    if value is None or value == [] or value == {}:
        pytest.skip(reason or "no expectation for this check")
    return value


def remote_json(host: Any, script: str, arg: str) -> Any:
    """Run a python3 fact script on the host and parse its JSON output."""
    r = host.run("python3 -c %s %s", script, arg)
    if r.rc != 0:
        err = (r.stderr or r.stdout).strip().splitlines()
        raise RuntimeError(f"remote python3 failed (exit {r.rc}): {err[-1] if err else 'no output'}")
    return json.loads(r.stdout)


def read_applied(host: Any, expect: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The host's apply record (parsed), or None and why."""
    key = expect["applied_path"]
    if key in APPLIED_CACHE:
        return APPLIED_CACHE[key]
    r = host.run("cat %s", key)
    if r.rc != 0:
        out: tuple[dict[str, Any] | None, str] = (None, f"no apply record at {key} (nothing installed?)")
    else:
        try:
            rec = json.loads(r.stdout)
            out = (rec, "") if isinstance(rec, dict) else (None, f"{key}: not a JSON object")
        except ValueError as e:
            out = (None, f"{key}: malformed JSON ({e.msg})")
    APPLIED_CACHE[key] = out
    return out


def exists(host: Any, name: str) -> bool:
    """`command -v NAME` on the host, cached; the first call looks up every known command at once."""
    if name not in EXISTS_CACHE:
        names = sorted(set(KNOWN_COMMANDS) | {name})
        words = " ".join(shlex.quote(n) for n in names)
        r = host.run(f'for c in {words}; do command -v "$c" >/dev/null 2>&1 && echo "$c"; done; true')
        if r.rc == 0:
            found = set(r.stdout.split())
            for n in names:
                EXISTS_CACHE[n] = n in found
        else:  # an odd shell: ask testinfra, one name at a time
            EXISTS_CACHE[name] = bool(host.exists(name))
    return EXISTS_CACHE[name]


def listing(host: Any, expect: dict[str, Any], root: str) -> Any:
    """LIST_SCRIPT's answer for `root` (None: no such folder). One remote call lists every model
    root and the Engram folder together, the first time any of them is asked for."""
    if root not in LIST_CACHE:
        from builder.hostcheck import LIST_SCRIPT, dumps

        roots = [m["root"] for m in expect.get("models") or []] + [expect["paths"]["engram"].rstrip("/")]
        roots = list(dict.fromkeys(roots + [root]))
        LIST_CACHE.update(remote_json(host, LIST_SCRIPT, dumps(roots)))
    return LIST_CACHE[root]
