"""Helpers shared by the check modules (imported as `checklib`; checks/ is on sys.path under pytest)."""

from __future__ import annotations

import json
from typing import Any

import pytest

APPLIED_CACHE: dict[str, tuple[dict[str, Any] | None, str]] = {}


def need(value: Any, reason: str) -> Any:
    """The expectation, or skip the check saying why it is absent."""
    if value is None or value == [] or value == {}:
        pytest.skip(reason or "no expectation for this check")
    return value


def run(host: Any, command: str, *args: str) -> Any:
    """host.run with its args shell-quoted by testinfra."""
    return host.run(command, *args)


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
