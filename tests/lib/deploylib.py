"""Helpers for the deploy tests: what a test host runs, a deploy run in the background and killed at a
line of its progress, and the bystander containers a deploy must never touch."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from typing import Any

from tests.lib import fleetlib
from tests.lib.journeylib import BUILDER, PATHS, Journey

LANE_LABEL = "io.builder.lane"
BYSTANDER = "bystander"


def current(j: Journey, h: fleetlib.Host) -> str | None:
    r = j.fleet.exec(h, f"readlink {PATHS['bundles']}/current", check=False)
    return r.stdout.strip().rsplit("/", 1)[-1] or None if r.returncode == 0 else None


def lane_containers(j: Journey, h: fleetlib.Host, lane: str = "demo") -> list[dict[str, str]]:
    """This lane's containers on the host: name, state, bundle label, id, started at."""
    r = j.fleet.exec(h, f"docker ps -aq --filter label={LANE_LABEL}={lane}")
    ids = r.stdout.split()
    if not ids:
        return []
    fmt = '{{.Name}} {{.State.Status}} {{index .Config.Labels "io.builder.bundle-id"}} {{.Id}} {{.State.StartedAt}}'
    out = []
    for line in j.fleet.exec(h, ["docker", "inspect", "-f", fmt, *ids]).stdout.splitlines():
        name, state, bundle, cid, started = line.split()
        out.append({"name": name.lstrip("/"), "state": state, "bundle": bundle, "id": cid, "started": started})
    return out


def bundle_ids(j: Journey) -> dict[str, str]:
    """host -> the bundle id in the project copy's out/bundles (what a deploy ships)."""
    out = {}
    for h in j.fleet.hosts:
        m = json.loads((j.root / "out" / "bundles" / j.name / h.name / "manifest.json").read_bytes())
        out[h.name] = m["bundle_id"]
    return out


def assert_on(j: Journey, want: dict[str, str]) -> None:
    """Every host has `want[host]` current and runs exactly it (one running container of the lane)."""
    for h in j.fleet.hosts:
        assert current(j, h) == want[h.name], (h.name, current(j, h), want[h.name])
        cs = lane_containers(j, h)
        assert [(c["state"], c["bundle"]) for c in cs] == [("running", want[h.name])], (h.name, cs)


def start_bystanders(j: Journey) -> None:
    """A container on every host that is not the lane's (another lane's label, the same rank label):
    no deploy, start or stop may touch it."""
    for rank, h in enumerate(j.fleet.hosts):
        if j.fleet.exec(h, f"docker ps -q --filter name=^{BYSTANDER}$").stdout.strip():
            continue
        image = j.fleet.exec(h, "docker images -q --no-trunc | head -1").stdout.strip()
        j.fleet.exec(h, f"docker rm -f {BYSTANDER} >/dev/null 2>&1; docker run -d --name {BYSTANDER} "
                        f"--label {LANE_LABEL}=other --label io.builder.rank={rank} --network host {image} "
                        "serve --port 9999 --served-name other")


def bystanders_running(j: Journey) -> dict[str, bool]:
    return {
        h.name: j.fleet.exec(h, f"docker inspect -f '{{{{.State.Running}}}}' {BYSTANDER}", check=False).stdout.strip()
        == "true"
        for h in j.fleet.hosts
    }


class Background:
    """`builder ARGS` in its own process group, its stderr read line by line as it comes."""

    def __init__(self, j: Journey, *args: str) -> None:
        env = {**j.env, **j.ssh_dir(), "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(
            [BUILDER, *args], cwd=j.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.out = ""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_out, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.lines.append("")  # (EOF)
            self.cond.notify_all()

    def _read_out(self) -> None:
        assert self.p.stdout is not None
        self.out = self.p.stdout.read()

    def wait_line(self, pattern: str, timeout: float = 300) -> str:
        """The first stderr line matching pattern (a regex); AssertionError when the process ended first."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for line in self.lines[seen:]:
                    if rx.search(line):
                        return line
                seen = len(self.lines)
                if self.p.poll() is not None and self.lines and self.lines[-1] == "":
                    raise AssertionError(f"no line {pattern!r} before exit {self.p.returncode}: "
                                         + "\n".join(self.lines[-30:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line {pattern!r} within {timeout} s: " + "\n".join(self.lines[-30:]))
                self.cond.wait(min(left, 1.0))

    def pause(self) -> None:
        """SIGSTOP the command and everything in its process group: it holds what it holds, and does
        nothing more, however long the caller takes (a loaded machine makes the caller slow)."""
        os.killpg(self.p.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.p.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the command and everything in its process group."""
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait(timeout=60)

    def wait(self, timeout: float = 600) -> tuple[int, dict[str, Any]]:
        rc = self.p.wait(timeout=timeout)
        deadline = time.monotonic() + 10
        while not self.out and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            return rc, json.loads(self.out)
        except ValueError:
            return rc, {}

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)
