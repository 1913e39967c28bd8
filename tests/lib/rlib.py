"""Shared helpers for the reliability tests: one-line error checks, tree snapshots, the CLI, kill loops.

Imported by the modules of tests/reliability/ (`from tests.lib import rlib`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.lib import clirun
from tests.lib.bundlelib import snapshot  # noqa: F401 - the reliability tests' snapshot is the shared one

REPO = Path(__file__).resolve().parents[2]


def kill_runs() -> int:
    """How many times each kill loop runs: BUILDER_KILL_RUNS (default 10; the documented long run uses 50)."""
    return max(1, int(os.environ.get("BUILDER_KILL_RUNS", "10")))


def kill_seed(default: int) -> int:
    return int(os.environ.get("BUILDER_KILL_SEED", str(default)))


def assert_one_line(exc: BaseException) -> str:
    """An expected failure's message: non-empty, one line."""
    msg = str(exc)
    assert msg.strip(), f"{type(exc).__name__} with an empty message"
    assert "\n" not in msg and "\r" not in msg, f"{type(exc).__name__}: message spans lines: {msg!r}"
    return msg


def listing(root: Path) -> dict[str, tuple[str, int]]:
    """Every entry under root: relative path -> (kind, size); files by size, links by target length."""
    out: dict[str, tuple[str, int]] = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            full = Path(dirpath) / n
            rel = full.relative_to(root).as_posix()
            if full.is_symlink():
                out[rel] = ("link", len(os.readlink(full)))
            elif full.is_file():
                out[rel] = ("file", full.stat().st_size)
            else:
                out[rel] = ("dir", 0)
    return out


builder_env = clirun.environment


def run_builder(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`python3 -m builder ARGS` as a user runs it (tests.lib.clirun), with ``env`` on this environment."""
    return clirun.run(*args, cwd=cwd, env=clirun.environment(env), timeout=timeout)


def assert_clean_cli(p: subprocess.CompletedProcess[str], allowed: tuple[int, ...] = (0, 1, 2)) -> None:
    """No traceback; an allowed exit code; a failure says one `error:` line."""
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr[-2000:]
    assert p.returncode in allowed, (p.returncode, p.stderr[-2000:])
    if p.returncode != 0:
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        assert errors, p.stderr[-2000:]
        assert all(ln[len("error:") :].strip() for ln in errors), p.stderr


def start_killable(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        cwd=cwd,
        env=builder_env(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def killpg(proc: subprocess.Popen[bytes]) -> bool:
    """SIGKILL the process group (the command and whatever it started); True if it was still running."""
    running = proc.poll() is None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for _ in range(200):
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return running
        time.sleep(0.05)
    raise AssertionError("the killed process group is still there")


def timed(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> float:
    """Wall time of one full run (to spread the kill points over it); asserts it succeeds."""
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=cwd, env=builder_env(env), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return time.monotonic() - t0


def record_figures(name: str, figures: dict[str, Any]) -> None:
    """Print kill-loop figures (pytest -s shows them) and append them to $BUILDER_RELIABILITY_LOG if set."""
    line = json.dumps({"test": name, **figures}, sort_keys=True)
    print(f"reliability figures: {line}")
    log = os.environ.get("BUILDER_RELIABILITY_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(line + "\n")


# --------------------------------------------------------------------------- secrets


def secret_forms(secret: str | bytes) -> list[bytes]:
    """The raw secret and the forms it could leak in: base64 (at the three alignments), hex, url-safe b64."""
    raw = secret.encode() if isinstance(secret, str) else secret
    forms = {raw, raw.hex().encode()}
    for shift in range(3):
        chunk = raw[shift:]
        enc = base64.b64encode(chunk)
        # drop the characters that depend on the bytes around the chunk
        usable = enc[: (len(chunk) // 3) * 4]
        if len(usable) >= 16:
            forms.add(usable)
            forms.add(usable.replace(b"+", b"-").replace(b"/", b"_"))
    return sorted(f for f in forms if len(f) >= 12)


def scan_for(blobs: dict[str, bytes], secrets: dict[str, str | bytes]) -> list[str]:
    """Every (where, which secret, which form) hit; empty when nothing leaked."""
    hits = []
    for name, secret in secrets.items():
        for form in secret_forms(secret):
            for where, data in blobs.items():
                if form in data:
                    hits.append(f"{name} ({form[:12]!r}...) in {where}")
    return hits


def files_under(root: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    if not root.exists():
        return out
    for dirpath, _dirs, files in os.walk(root):
        for n in files:
            full = Path(dirpath) / n
            if full.is_file() and not full.is_symlink():
                with contextlib.suppress(OSError):
                    out[str(full)] = full.read_bytes()
    return out
