"""What a ship is asked to do (ShipOptions) and what it did (ShipResult)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from builder.foundation.ssh import ControlSockets

MiB = 1024 * 1024


@dataclass
class ShipOptions:
    bundle: Path | None = None
    hosts_dir: Path | None = None  # the inventory folder (default: hosts/ under the project root)
    to: Path | None = None
    key: Path | None = (
        None  # the public key the host trusts (default: fleet.trusted_key, else --signing-key's)
    )
    signing_key: Path | None = None
    allow_outside_key: bool = False  # a signing key found by default outside the project may serve
    timeout: float = 60.0  # base seconds of every remote call
    connect_timeout: int = 10
    min_rate: float = 1 * MiB  # bytes/s below which a transfer counts as stalled
    hash_rate: float = 50 * MiB  # bytes/s the host is assumed to hash at least
    insecure: bool = False
    #: install up to the switch only (``install --stage``: ``staged`` and state/staged.json; for
    #: ``builder deploy``, which switches every host once every host is staged and audited)
    stage: bool = False
    #: hash every file the host holds for the bundle instead of trusting its records (``receive
    #: --rehash``: ``builder deploy --repair`` places again what changed in place)
    rehash: bool = False
    #: the run's control sockets, when the ship is one step of a larger run (``builder deploy``)
    sockets: ControlSockets | None = None
    #: progress: what will be sent, once the host has said what it lacks ([(file, bytes)]) ...
    on_plan: Callable[[list[tuple[str, int]]], None] | None = None
    #: ... and then (the bundle file being sent, bytes just sent)
    on_bytes: Callable[[str, int], None] | None = None


@dataclass
class ShipResult:
    host: str
    fleet: str
    bundle_id: str
    result: str  # installed | staged | unchanged | copied
    sent: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    dest: str = ""
    bytes_sent: int = 0
    #: what the host held that differed from the manifest and was placed again (model files by their
    #: host path, launch files by their release path; receive's ``differed``)
    differed: list[str] = field(default_factory=list)
    #: model bytes the host pulled from the fleet registry, and the seconds that pull took (receive's
    #: ``pulled``; 0 where the bundle carries its model files)
    bytes_pulled: int = 0
    pull_seconds: float = 0.0
