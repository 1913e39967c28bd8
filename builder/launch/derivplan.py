"""Derivations: per-rank inputs a lane makes on each host (seed 000's rank caches and token map, seed
002's packed Engram), addressed by their inputs like an image.

A derivation's **address** is the sha256 of the canonical JSON of what makes its output: the lane
image's input address, the command as this rank runs it, the rank and world size, and the sha256 of
every input file this rank mounts into it (its own rank's files only). Its folder on the host is
``<paths.bundles>/derived/<name>-<address[:16]>``: made once (by builder.hostscripts.derive, on the
host, in the lane's image with the network off), then held while the address holds; a new model
revision, image, rank or command gives a new folder, and the old one stays for a rollback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from builder.errors import ConfigError
from builder.foundation.canon import address
from builder.inputs.hosts import Fleet, Host
from builder.inputs.pins import Pins
from builder.launch.rank import fill, substitutions
from builder.lock.lockfile import Lock
from builder.store.placement import mount_path, place_models

DERIVE_FORMAT = 1
#: the label a derivation's container carries (its address)
LABEL_DERIVE = "io.builder.derive"
#: start.sh and the derivation's host side put the output folder here in the argv
OUT = "{out}"


@dataclass(frozen=True)
class DerivationRun:
    """One derivation as this rank makes it: where its folder is, and the ``docker run`` that fills it
    (``{out}`` stands for the temporary folder it writes into)."""

    name: str
    address: str | None  # None: an input is not locked yet
    path: str
    output: str
    argv: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "address": self.address, "path": self.path, "output": self.output,
                "argv": self.argv}


def root(host: Host) -> str:
    return f"{host.paths.bundles.rstrip('/')}/derived"


def _input_hashes(pins: Pins, lock: Lock | None, lane_name: str, host: Host, source: str) -> list[list[str]] | None:
    """[path, sha256] of every file of a mount source this rank holds; None when not locked."""
    kind, _, name = source.partition(":")
    if lock is None:
        return None
    if kind == "model":
        try:
            placed = place_models(pins, lock, lane_name, host)
        except ConfigError:
            return None
        return [[f.file, f.sha256] for m in placed if m.name == name for f in m.files]
    kits = getattr(lock, "kits", {}) or {}
    if name in kits:
        return [[f.path, f.sha256] for f in kits[name].files]
    if name in lock.files:
        return [["", lock.files[name].sha256]]
    return None


def derivation_runs(
    pins: Pins, lock: Lock | None, fleet: Fleet, host: Host, lane_name: str, image_ref: str,
    image_address: str | None,
) -> list[DerivationRun]:
    """The lane's derivations as this host makes them, in the lane's order."""
    lane = pins.lanes[lane_name]
    subs = substitutions(fleet, host, lane_name, lane)
    out = []
    for name, d in lane.derivations.items():
        where = f"lanes.{lane_name}.derivations.{name}"
        command = [fill(a, subs, f"{where}.command") for a in d.command]
        inputs: dict[str, Any] = {}
        for m in d.mounts:
            inputs[m.source] = _input_hashes(pins, lock, lane_name, host, m.source)
        addr = None
        if image_address is not None and all(v is not None for v in inputs.values()):
            addr = address({"format": DERIVE_FORMAT, "image": image_address, "command": command,
                            "rank": host.rank, "world_size": len(fleet.hosts), "inputs": inputs})
        path = f"{root(host)}/{name}-{addr[:16] if addr else '(unlocked)'}"
        argv = ["docker", "run", "--rm", "--network", "none",
                "--name", f"builder-derive-{lane_name}-{name}-r{host.rank}", "--label", f"{LABEL_DERIVE}={addr or ''}"]
        for m in d.mounts:
            argv += ["-v", f"{mount_path(pins, lane_name, host, m)}:{m.target}:ro"]
        argv += ["-v", f"{OUT}:{d.output}", "--entrypoint", command[0], image_ref, *command[1:]]
        out.append(DerivationRun(name=name, address=addr, path=path, output=d.output, argv=argv))
    return out


def derived_paths(runs: list[DerivationRun]) -> dict[str, str]:
    """name -> host folder, for the lane's ``derived:NAME`` mounts."""
    return {r.name: r.path for r in runs}


def render_plan(runs: list[DerivationRun], rank: int, world_size: int) -> dict[str, Any]:
    """derive.json: what the host side (builder.hostscripts.derive) makes and checks for this rank."""
    return {"format": DERIVE_FORMAT, "rank": rank, "world_size": world_size,
            "derivations": [r.to_json() for r in runs]}
