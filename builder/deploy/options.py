"""What a fleet command (`builder deploy`, `start`, `stop`, `status`) is asked to do: its options, made
once by the command line and read by every step, and the command a message tells the operator to run."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from builder.inputs.pins import default_lock, default_pins, default_store

#: where a fleet command says what it does (one line at a time, on stderr)
Say = Callable[[str], None]


@dataclass
class DeployOptions:
    root: Path
    pins: Path
    lock: Path
    store: Path
    fleet: str
    hosts_dir: Path | None = None  # the inventory folder (default: hosts/ under the root)
    checks_dir: Path | None = None
    key: Path | None = None  # the signing key (bundles made again are signed with it)
    allow_outside_key: bool = False  # a signing key found by default outside the project may sign
    with_image: bool = False
    with_models: bool = False
    part_size: str = "256MiB"  # (as `builder bundle --part-size` takes it)
    dry_run: bool = False
    plan: bool = False  # a dry run from the lock and the fleet file alone: no host is contacted
    parallel: int = 4  # hosts staged at once
    connect_timeout: int = 10
    timeout: float = 60.0  # base seconds of each remote call
    start_timeout: float = 0.0  # each rank's start, and the head's health (0: the lane's start_timeout)
    stop_timeout: int = 30
    audit_mode: str = "fast"
    ssh_persist: float = 0.0  # seconds each host's connection is kept after the command (0: closed)
    insecure: bool = False
    repair: bool = False  # reinstall the lock's release on hosts that run it but drifted (deploy --repair)
    #: a replay that differs from the running release's passes and becomes the baseline (deploy --accept-replay)
    accept_replay: bool = False


def command(opts: DeployOptions, verb: str, *args: str, mode: bool = False) -> str:
    """The exact `builder` command a message tells the operator to run, as they would type it here: the
    fleet, the pins, lock, store and inventory folder this command used where the same shell would not
    get them by default (from BUILDER_PINS, BUILDER_LOCK and BUILDER_STORE, else the project's own; the
    inventory folder when --hosts-dir named one), and, with `mode`, the audits' mode when it is not the
    default (a repair found by a full audit needs one)."""
    head = ["builder"]
    env = os.environ
    pins = Path(env["BUILDER_PINS"]) if env.get("BUILDER_PINS") else default_pins()
    lock = Path(env["BUILDER_LOCK"]) if env.get("BUILDER_LOCK") else default_lock(opts.pins)
    store = Path(env["BUILDER_STORE"]) if env.get("BUILDER_STORE") else default_store(opts.pins)
    if opts.pins.resolve() != pins.resolve():
        head += ["--pins", str(opts.pins)]
    if opts.lock.resolve() != lock.resolve():
        head += ["--lock", str(opts.lock)]
    if opts.store.resolve() != store.resolve():
        head += ["--store", str(opts.store)]
    tail = [verb, "--fleet", opts.fleet, *args]
    if opts.hosts_dir is not None:
        tail += ["--hosts-dir", str(opts.hosts_dir)]
    if mode and opts.audit_mode != "fast":
        tail += ["--mode", opts.audit_mode]
    return " ".join(shlex.quote(a) for a in head + tail)
