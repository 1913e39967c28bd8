"""A fleet of local test hosts to try builder on without Sparks.

    python3 -m tests.fleet.local up [--lane demo] [--simulate] [--hosts N] [--name local]
    python3 -m tests.fleet.local down [--name local]

`up` starts N test hosts (by default as many as the lane has ranks) on a private Docker network: the
containers of tests/lib/fleetlib.py, from the image tests/fleet/build-testhost.sh builds, each with a
real sshd, its own dockerd and the user `spark`. On each it makes the folders builder installs into
(what an operator does once on a new Spark). It writes the fleet file `hosts/NAME.toml` (rank 0 the head,
the others workers, the lane named) and, under `.cache/local-fleet/NAME/`, its ssh key, known hosts and
ssh_config; git ignores both. It prints the fleet file's path on stdout and the commands to run next on
stderr. The hosts have no GPU and no RDMA, and their fleet file expects none: a lane whose image runs
without a GPU deploys onto them (the `demo` lanes).

A seed lane's image needs a GB10. With `--simulate`, `up` makes a copy of the project under
`.cache/local-fleet/NAME/project/` whose pins run the lane on the simulator engine, with small stand-ins
for its models and kit (tests/lib/simlane.py, as tests/test_seed_fleet.py runs every seed lane), and
writes the fleet file into that copy's `hosts/`: the tour runs there, on the lane's own launch files,
env, mounts, start order and derivations. Without it, a lane whose image does not run here is refused.

`down` removes exactly what `up` made: the containers and the network labelled with this project's
folder and the fleet's name, the fleet file (when `up` wrote it) and the folder under `.cache/` (with
the simulator's project and what the tour made in it).
Labelled so, the hosts are not test left-overs: `fleetlib.reap_stale()` leaves them alone.

Every failure is one line naming what failed, and exit 1.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

from builder.errors import ConfigError
from builder.foundation.canon import atomic_write
from builder.inputs.pins import expand_lanes
from builder.inputs.schema import NAME_RE
from tests.lib import factory, fleetlib, journeylib, simlane

ROOT = Path(__file__).resolve().parents[2]
#: the first line of a fleet file `up` writes; `down` removes only a file that starts with it
MARKER = "# Written by `python3 -m tests.fleet.local up`; `python3 -m tests.fleet.local down` removes it."
PROJECT_LABEL = "builder-local.project"
FLEET_LABEL = "builder-local.fleet"
#: what the test hosts are: no GPU, no RDMA, little free memory and disk
EXPECT = {"gpu_count": 0, "persistence_mode": False, "nvidia_runtime": False, "rdma": False,
          "min_free_memory_gib": 0.1, "min_free_disk_gib": 0.1}


class LocalFleetError(Exception):
    """One line for the user; exit 1."""


def state_dir(root: Path, name: str) -> Path:
    return root / ".cache" / "local-fleet" / name


def fleet_file(root: Path, name: str) -> Path:
    return root / "hosts" / f"{name}.toml"


def _filters(root: Path, name: str) -> list[str]:
    return ["--filter", f"label={PROJECT_LABEL}={root}", "--filter", f"label={FLEET_LABEL}={name}"]


def running(root: Path, name: str) -> tuple[list[str], list[str]]:
    """The containers and networks of the local fleet NAME of the project at ROOT (by their labels)."""
    containers = fleetlib.docker("ps", "-aq", *_filters(root, name)).stdout.split()
    networks = fleetlib.docker("network", "ls", "-q", *_filters(root, name)).stdout.split()
    return containers, networks


def lanes(root: Path) -> dict[str, dict[str, Any]]:
    """Each lane of the project's pins (a lane based on another: its whole table)."""
    pins = root / "pins.toml"
    try:
        with open(pins, "rb") as f:
            doc = tomllib.load(f)
        return dict(expand_lanes(doc, pins).get("lanes", {}))
    except (OSError, tomllib.TOMLDecodeError, ConfigError, KeyError) as e:
        raise LocalFleetError(f"{pins}: {e}") from None


def fleet_text(name: str, lane: str, fleet: fleetlib.Fleet, path: Path) -> str:
    """The fleet file at `path`: paths relative to its folder, the key `builder keygen --out keys` writes
    trusted, as the README's tour has it."""
    rows = [factory.host(h.name, rank, address=h.ip, paths=factory.HOST_PATHS, expect=EXPECT)
            for rank, h in enumerate(fleet.hosts)]
    doc = factory.fleet(name, lane, rows, ssh_config=os.path.relpath(fleet.ssh_config, path.parent),
                        trusted_key="../keys/builder.pub",
                        note=f"{len(rows)} local test hosts (containers); no GPU, no RDMA")
    return f"{MARKER}\n{factory.toml(doc)}"


def machine_platform() -> str:
    return "linux/arm64" if platform.machine() in ("aarch64", "arm64") else "linux/amd64"


def image_runs_here(root: Path, image: str) -> bool:
    """Whether `builder image` builds the lane's image for this machine's platform (a published image, or
    one for another platform, does not run on the test hosts)."""
    with open(root / "pins.toml", "rb") as f:
        spec = tomllib.load(f).get("images", {}).get(image, {})
    return "published" not in spec and spec.get("platform", machine_platform()) == machine_platform()


def simulator_project(root: Path, work: Path, lane: str, image: str) -> Path:
    """A copy of the project whose pins run the lane on the simulator engine (tests/lib/simlane.py)."""
    try:
        project = journeylib.project_copy(work / "project", root)
    except subprocess.CalledProcessError:
        raise LocalFleetError(f"{root}: not a git work tree (--simulate copies the files a clone holds)") from None
    simlane.substitute(project, lane, image, work / "stand-ins")
    return project


def up(root: Path, name: str, n: int | None, lane: str, simulate: bool = False) -> Path:
    """Start the hosts (n: the lane's tensor_parallel when None) and write their fleet file; returns its path.
    With `simulate` the fleet file is in a copy of the project that runs the lane on the simulator engine
    (`.cache/local-fleet/NAME/project/`)."""
    if not re.fullmatch(NAME_RE, name):
        raise LocalFleetError(f"--name {name!r}: a fleet name is lowercase letters, digits, '.', '_', '-'")
    known = lanes(root)
    if lane not in known:
        raise LocalFleetError(f"--lane {lane!r}: no such lane in {root / 'pins.toml'} "
                              f"(have: {', '.join(sorted(known))})")
    ranks = known[lane].get("serve", {}).get("tensor_parallel")
    n = n if n is not None else ranks or 2
    if not 1 <= n <= 16:
        raise LocalFleetError(f"--hosts {n}: between 1 and 16")
    if ranks is not None and n != ranks:
        raise LocalFleetError(f"--hosts {n}: lane {lane!r} runs {ranks} ranks (serve.tensor_parallel), "
                              "one a host")
    image = str(known[lane].get("image", ""))
    if not simulate and not image_runs_here(root, image):
        raise LocalFleetError(f"--lane {lane!r}: its image {image!r} does not run on the test hosts "
                              f"({machine_platform()}, no GPU); add --simulate to run the lane on the simulator "
                              "engine")
    path = fleet_file(root, name)
    if not fleetlib.docker_available():
        raise LocalFleetError("Docker Engine not reachable (docker info failed)")
    containers, _ = running(root, name)
    if containers:
        raise LocalFleetError(f"local fleet {name!r} is up ({len(containers)} containers): "
                              f"`python3 -m tests.fleet.local down --name {name}` first")
    if path.exists():
        raise LocalFleetError(f"{path}: exists; choose another --name, or remove it "
                              "(`python3 -m tests.fleet.local down` removes one it wrote)")
    tag = fleetlib.testhost_tag()
    if not fleetlib.image_exists(tag):
        raise LocalFleetError(f"{tag}: test host image missing; build it once with "
                              f"`sudo {fleetlib.FLEET_DIR / 'build-testhost.sh'}`")
    work = state_dir(root, name)  # (a fleet not up: what its folder held is gone with it)
    shutil.rmtree(work, ignore_errors=True)
    try:
        if simulate:
            path = fleet_file(simulator_project(root, work, lane, image), name)
        print(f"starting {n} test host(s) …", file=sys.stderr)
        # (on a failure start_fleet removes every host it started)
        fleet = fleetlib.start_fleet(
            n, work, image=tag, build=False, names=[f"spark-{i}" for i in range(1, n + 1)],
            owner=f"local-fleet/{name}", labels={PROJECT_LABEL: str(root), FLEET_LABEL: name},
        )
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    try:
        for h in fleet.hosts:
            # what an operator does once on a new Spark (README's tour): the folders builder installs into
            fleet.exec(h, f"install -d -o {h.user} -g {h.user} {' '.join(factory.HOST_PATHS.values())}")
            fleet.close_connection(h)
        # the fleet file's ssh_config: without ControlMaster (the control folder goes with this process)
        fleet.plain_ssh_config.replace(fleet.ssh_config)
        shutil.rmtree(fleet.control_dir, ignore_errors=True)
        atomic_write(path, fleet_text(name, lane, fleet, path).encode())
    except BaseException:
        fleet.teardown()
        shutil.rmtree(work, ignore_errors=True)
        raise
    return path


def down(root: Path, name: str) -> list[str]:
    """Remove what `up` made; returns what was removed (nothing: an empty list)."""
    if not fleetlib.docker_available():
        raise LocalFleetError("Docker Engine not reachable (docker info failed)")
    removed: list[str] = []
    containers, networks = running(root, name)
    if containers:
        fleetlib.docker("rm", "-f", "-v", *containers, timeout=300)
        removed.append(f"{len(containers)} container(s)")
    for net in networks:
        fleetlib.docker("network", "rm", net)
        removed.append(f"network {net}")
    path = fleet_file(root, name)
    try:
        if path.read_text().startswith(MARKER):
            path.unlink()
            removed.append(str(path))
    except FileNotFoundError:
        pass
    work = state_dir(root, name)
    if work.exists():
        shutil.rmtree(work)
        removed.append(str(work))
    return removed


def next_steps(root: Path, name: str, path: Path, lane: str) -> str:
    project = path.parent.parent  # (hosts/NAME.toml of the project the tour runs in)
    cfg = state_dir(root, name) / "ssh_config"
    image = lanes(root)[lane].get("image", "…")
    where = [f"  cd {os.path.relpath(project)}   # the simulator's copy of the project"] if project != root else []
    return "\n".join([
        f"{os.path.relpath(path)}: fleet {name!r}, lane {lane!r}. Next:",
        *where,
        f"  builder lock --offline {lane} && builder fetch --offline {lane} && builder image {image}",
        "  builder keygen --out keys        # once; the fleet trusts keys/builder.pub",
        f"  builder deploy --fleet {name} --key keys/builder.key --with-image --with-models",
        f"  builder status --fleet {name}",
        f"  ssh -F {cfg} spark-1             # a host, as its user",
        *([f"  cd {os.path.relpath(root, project)}"] if project != root else []),
        f"  python3 -m tests.fleet.local down{'' if name == 'local' else f' --name {name}'}",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.fleet.local", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    u = sub.add_parser("up", help="start N local test hosts and write hosts/NAME.toml")
    u.add_argument("--hosts", type=int, default=None, help="how many hosts (default: the lane's ranks)")
    u.add_argument("--lane", default="demo", help="the fleet's lane (default demo)")
    u.add_argument("--simulate", action="store_true",
                   help="run the lane on the simulator engine, in a copy of the project under .cache/local-fleet/")
    d = sub.add_parser("down", help="remove what `up` made")
    for p in (u, d):
        p.add_argument("--name", default="local", help="the fleet's name (default local)")
        p.add_argument("--root", type=Path, default=ROOT, help="the project folder (default this checkout)")
    a = ap.parse_args(argv)
    root = a.root.resolve()
    try:
        if a.command == "up":
            path = up(root, a.name, a.hosts, a.lane, a.simulate)
            print(next_steps(root, a.name, path, a.lane), file=sys.stderr)
            print(path)
        else:
            removed = down(root, a.name)
            print(f"removed: {', '.join(removed)}" if removed else f"local fleet {a.name!r}: nothing to remove",
                  file=sys.stderr)
    except (LocalFleetError, fleetlib.FleetError, OSError, subprocess.SubprocessError) as e:
        print(f"tests.fleet.local: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
