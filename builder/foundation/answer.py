"""What a command said, read one way: its exit status, the last JSON value it printed on stdout, and
why it failed in one line.

Every command builder runs, on a host over ssh or here (the installer, a host script, git, ssh itself),
prints its answer as its last stdout line and its reason as its last stderr line (an ``error: ``
line where it has one). Reading that in one place keeps the callers' messages alike and lets none of
them trip over an empty or undecodable output.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from typing import Any


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def _lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


@dataclass(frozen=True)
class Answer:
    """One finished command: exit status, stdout and stderr as text."""

    rc: int
    stdout: str
    stderr: str

    @classmethod
    def of(cls, p: subprocess.CompletedProcess[bytes] | subprocess.CompletedProcess[str]) -> Answer:
        return cls(p.returncode, _text(p.stdout), _text(p.stderr))

    @classmethod
    def from_parts(cls, rc: int, stdout: bytes | str | None, stderr: bytes | str | None) -> Answer:
        return cls(rc, _text(stdout), _text(stderr))

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def last_line(self) -> str:
        """The last non-empty line of stderr ("" when there is none)."""
        lines = _lines(self.stderr)
        return lines[-1] if lines else ""

    def error(self, prefixes: tuple[str, ...] = ("error: ",)) -> str:
        """Why it failed, one line: the last stderr line that starts with the first of ``prefixes`` that
        any line has (the prefix taken off), else the last stderr line, else the last stdout line, else
        its exit status."""
        lines = _lines(self.stderr)
        for prefix in prefixes:
            marked = [ln for ln in lines if ln.startswith(prefix)]
            if marked:
                return marked[-1][len(prefix):].strip()
        if lines:
            return lines[-1]
        out = _lines(self.stdout)
        return out[-1] if out else f"exit status {self.rc}"

    def last_json(self) -> Any:
        """The JSON value of the last non-empty stdout line; ValueError when there is none or it is not JSON."""
        lines = _lines(self.stdout)
        if not lines:
            raise ValueError("no answer")
        return json.loads(lines[-1])

    def json_object(self) -> dict[str, Any] | None:
        """The last stdout line as a JSON object; None when it is missing, not JSON or not an object."""
        try:
            out = self.last_json()
        except ValueError:
            return None
        return out if isinstance(out, dict) else None
