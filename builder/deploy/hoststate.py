"""One host of a deploy: what it runs (one remote call), and the steps a deploy takes on it.

Every step goes through the host's one connection (builder.ship.Remote: ssh with the fleet's
ssh_config, or docker exec, or local) and is bounded. Over ssh the host needs python3 and docker,
as the installer does; the facts and the wait are builder.hostscripts.lane, sent over stdin, never left
on the host.

- ``state``: the installer's links (``current``, ``previous``, ``staged``), the releases present, the
  apply record's bundle, lock and image, this lane's containers of this rank (by the labels start.sh
  gives them, so nothing else is ever looked at or touched) and, on the head, whether ``/health``
  answers on 127.0.0.1 (as the serving audit asks it).
- ``stage``/``switch``: the installer (this machine's install.pyz, builder.bundle.hostpkg), kept on the
  host as ``<paths.bundles>/incoming/install-<sha256[:16]>.pyz`` as ship keeps it
  (builder.ship.remote.installer_command).
- ``stop``: the release's own ``stop.sh`` (every container of this lane and rank, whatever bundle
  started it; only those); with no release installed, the same command from builder.launch.
- ``start``: ``current/start.sh`` with ``BUILDER_START_TIMEOUT`` set to the deploy's bound.
- ``wait``: until this rank's container answers (a worker: its serve or rendezvous port, start.sh's own
  rule; the head: ``/health``), bounded, and at once when the container exited (its last log lines
  say why).
"""

from __future__ import annotations

import base64
import json
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from builder.bundle import hostpkg
from builder.errors import BuilderError
from builder.foundation.answer import Answer
from builder.hostscripts import source
from builder.launch import LABEL_BUNDLE, LABEL_RANK, lane_filters, stop_lane_command

if TYPE_CHECKING:
    from builder.ship import Remote

@dataclass
class Container:
    id: str
    name: str
    state: str
    bundle: str
    image: str
    status: str
    exit_code: str = ""  # (a container that ended: its exit code, finish time and last log lines)
    finished_at: str = ""
    log: str = ""


@dataclass
class HostState:
    """What one host runs, as one remote call found it."""

    host: str
    current: str | None = None
    previous: str | None = None
    staged: str | None = None
    releases: list[str] = field(default_factory=list)
    applied: dict[str, Any] | None = None
    containers: list[Container] = field(default_factory=list)
    health: dict[str, Any] | None = None
    docker: str = ""  # why docker did not answer ("" when it did)

    @classmethod
    def from_json(cls, host: str, d: dict[str, Any]) -> HostState:
        return cls(
            host=host,
            current=d.get("current"),
            previous=d.get("previous"),
            staged=d.get("staged"),
            releases=list(d.get("releases") or []),
            applied=d.get("applied"),
            containers=[Container(**c) for c in d.get("containers") or []],
            health=d.get("health"),
            docker=str(d.get("docker") or ""),
        )

    @property
    def installed(self) -> str | None:
        """The installed release: current, when the apply record agrees."""
        if self.current and self.applied and self.applied.get("bundle_id") == self.current:
            return self.current
        return None

    @property
    def running(self) -> list[Container]:
        return [c for c in self.containers if c.state == "running"]

    def up_on(self, bundle_id: str | None) -> bool:
        """This rank runs bundle_id: exactly one container of the lane's rank, running it."""
        return bundle_id is not None and len(self.containers) == 1 and self.running == self.containers and (
            self.containers[0].bundle == bundle_id
        )

    @property
    def healthy(self) -> bool:
        return bool(self.health) and (self.health or {}).get("status") == 200


class HostOps:
    """The deploy's steps on one host, over its one connection (open it with ``with``)."""

    def __init__(self, remote: Remote, *, timeout: float = 60.0) -> None:
        """`remote`: the host's connection (its own, or one shared with the command's audits and ships)."""
        self.remote = remote
        self.host = remote.host
        self.timeout = timeout
        self.root = self.host.paths.bundles.rstrip("/") or "/"

    def __enter__(self) -> HostOps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.remote.close()

    # ------------------------------------------------------------------ facts

    def _lane(self, req: dict[str, Any], *, timeout: float, what: str) -> dict[str, Any]:
        """builder.hostscripts.lane on the host, with `req`: its JSON answer."""
        cmd = "python3 - " + shlex.quote(json.dumps(req, sort_keys=True))
        a = Answer.of(self.remote.run(cmd, timeout=timeout, stdin=source("lane").encode(), what=what))
        if not a.ok or not a.stdout.strip():
            raise BuilderError(f"{self.host.name}: {what}: {a.error(())}")
        out = a.json_object()
        if out is None:
            raise BuilderError(f"{self.host.name}: {what}: unreadable answer")
        return out

    def state(self, lane: str, health_port: int | None) -> HostState:
        req = {
            "do": "state",
            "root": self.root,
            "lane": lane,
            "rank": self.host.rank,
            "health_port": health_port,
            "filters": lane_filters(lane),
            "label_rank": LABEL_RANK,
            "label_bundle": LABEL_BUNDLE,
        }
        return HostState.from_json(self.host.name, self._lane(req, timeout=self.timeout, what="state"))

    # ------------------------------------------------------------------ the installer

    def installer(self, args: list[str], what: str, timeout: float | None = None) -> dict[str, Any]:
        return self.remote.run_installer(
            hostpkg.zipapp(), [*args, "--root", self.root], timeout=timeout or self.timeout + 120, what=what
        )

    def derive(self, release: str, timeout: float, *, full: bool = False) -> dict[str, Any] | None:
        """Make this rank's derivations of the ``staged`` or ``current`` release (its derive.py and
        derive.json; None when the lane has none): {"ok", "derivations": [{name, result, …}]}.
        `full`: every file hashed against its record (a repair), not its recorded stat trusted."""
        rel = f"{self.root}/{release}"
        cmd = (f"if [ -f {shlex.quote(rel + '/derive.json')} ]; then python3 {shlex.quote(rel + '/derive.py')} make "
               f"{shlex.quote(rel + '/derive.json')}{' full' if full else ''}; else echo none; fi")
        a = Answer.of(self.remote.run(cmd, timeout=timeout + self.timeout, what="derive"))
        if a.stdout.strip() == "none":
            return None
        out = a.json_object()
        if out is None:
            why = a.error(()) if a.stderr.strip() or not a.ok else "unreadable answer"
            raise BuilderError(f"{self.host.name}: derive: {why}")
        return out

    def keep_serving(self, bundle_id: str, record: dict[str, Any]) -> dict[str, Any]:
        """The release's serving record kept beside it on the host (installer keep-serving)."""
        data = base64.b64encode(json.dumps(record, sort_keys=True).encode()).decode()
        return self.installer(["keep-serving", "--release", bundle_id, "--record-base64", data], "keep-serving")

    def stage_installed(self, bundle_id: str) -> dict[str, Any]:
        return self.installer(["stage", "--release", bundle_id], "stage")

    def switch(self, bundle_id: str, *, rollback: bool = False, force: bool = False) -> dict[str, Any]:
        return self.installer(
            ["switch", "--to", bundle_id, *(["--rollback"] if rollback else []), *(["--force"] if force else [])],
            "switch",
        )

    # ------------------------------------------------------------------ stop, start, wait

    def _shell(self, command: str, *, timeout: float, what: str) -> None:
        a = Answer.of(self.remote.run(command, timeout=timeout, what=what))
        if not a.ok:
            raise BuilderError(f"{self.host.name}: {what}: {Answer(a.rc, '', a.stderr).error(())}")

    def stop(self, lane: str, has_release: bool, stop_timeout: int = 30) -> None:
        """Stop and remove this lane's containers of this rank (only those)."""
        env = f"BUILDER_STOP_TIMEOUT={int(stop_timeout)}"
        if has_release:
            cmd = f"{env} {shlex.quote(self.root + '/current/stop.sh')}"
        else:
            cmd = stop_lane_command(lane, self.host.rank, stop_timeout)
        self._shell(cmd, timeout=self.timeout + 2 * stop_timeout, what="stop")

    def start(self, start_timeout: float) -> None:
        cmd = f"BUILDER_START_TIMEOUT={int(start_timeout)} {shlex.quote(self.root + '/current/start.sh')}"
        self._shell(cmd, timeout=self.timeout + start_timeout, what="start.sh")

    def wait(self, container: str, *, ready: dict[str, Any], timeout: float) -> tuple[bool, str]:
        """(True, "") once this rank meets `ready` (builder.launch.rank.ready_spec); else (False, why)."""
        req = {"do": "wait", "container": container, "ready": ready, "timeout": timeout}
        out = self._lane(req, timeout=timeout + self.timeout, what="wait")
        if out.get("ok"):
            return True, ""
        why = str(out.get("why") or "not ready")
        log = str(out.get("log") or "")
        return False, why + (f"; its log: {log}" if log else "")
