"""Host inventories under hosts/: fleets, their lane, and each host's rank, fabric, paths and expectations;
the host listing and the Ansible inventory written from them (`builder hosts`).

One TOML file per fleet. Everything is validated before any host is contacted: an
unknown lane, a host without a rank, two hosts with one rank, a missing head, a value
of the wrong type each give one line naming the file and key, and exit 2.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from builder.errors import ConfigError
from builder.foundation.canon import atomic_write
from builder.foundation.ssh import parse_target
from builder.inputs.loader import read_toml, validate
from builder.inputs.schema import Name, Strict


class Fabric(Strict):
    """The RoCE fabric of one host: one IPv4 per rail, RDMA device names, the GID index."""

    rails: list[str] = []
    interfaces: list[str] = []
    rdma_devices: list[str] = []
    gid_index: int | Literal["auto"] = "auto"
    mtu: int = Field(default=9000, ge=576, le=9216)

    @field_validator("rails")
    @classmethod
    def _ipv4(cls, v: list[str]) -> list[str]:
        for a in v:
            try:
                ipaddress.IPv4Address(a)
            except ValueError:
                raise ValueError(f"not an IPv4 address: {a!r}") from None
        return v


class Paths(Strict):
    models: str = "/srv/models"
    engram: str = "/srv/engram"
    bundles: str = "/var/lib/builder"

    @field_validator("models", "engram", "bundles")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or ".." in Path(v).parts:
            raise ValueError("must be an absolute path without '..'")
        return v


class Burn(Strict):
    """The burn gate of a host (checks/test_burn.py): a short bounded load on its GPU, sampled, judged
    against the GPU model's health band (builder.gpu.burn.BANDS, or `min_tflops` here).

    `command` is the load's argv, run on the host; it prints one JSON line with its ``tflops``
    (builder.hostscripts.matmul does). Placeholders: ``{matmul}`` that module's source, ``{request}``
    its JSON request (``seconds``), ``{image}`` the lane's image (its ID from the build record), so
    a Spark runs ``docker run --rm --name builder-burn --gpus all --entrypoint python3 {image} -c {matmul}
    {request}``. `cleanup` (there ``docker rm -f builder-burn``) runs before the load and after a load
    killed at its timeout: a container outlives its killed CLI."""

    enabled: bool = Field(default=True, description="false: the opt-out (the burn check skips, saying so)")
    command: list[str] = Field(min_length=1)
    seconds: float = Field(default=12.0, ge=1, le=60, description="the load's length (recipes.md §14 #5: 10-15 s)")
    timeout_s: float = Field(default=120.0, ge=5, le=600, description="the load is killed past this")
    min_tflops: float | None = Field(default=None, gt=0, description="the floor, where the band's is not wanted")
    cleanup: list[str] | None = Field(
        default=None, min_length=1,
        description="run before the load and after a load killed at its timeout: a container outlives its killed CLI")


class Expect(Strict):
    """What the audit expects of the host (never read from the host itself)."""

    gpu_name: str | None = None
    gpu_count: int = Field(default=1, ge=0)
    compute_cap: str | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    persistence_mode: bool | None = True
    gpu_clock_mhz: int | None = Field(default=None, ge=0, description="sustained SM clock target")
    min_free_memory_gib: float = Field(default=0, ge=0)
    max_swap_used_gib: float | None = Field(default=None, ge=0)
    min_free_disk_gib: float = Field(default=0, ge=0)
    nfs_mounts: list[str] = []
    docker: bool = True
    nvidia_runtime: bool = True
    rdma: bool = True
    memory_wait_s: float = Field(
        default=0, ge=0, le=600,
        description="short of min_free_memory_gib: drop the page cache and wait this long for it (0: refuse at once)")
    burn: Burn | None = None


class Host(Strict):
    name: Name
    ssh: str = Field(
        min_length=1,
        description="ssh target: [user@]host[:port], [user@][v6addr]:port or an ssh_config alias "
        "(the container's name for connection = docker)",
    )
    connection: Literal["ssh", "docker", "local"] = "ssh"
    rank: int = Field(ge=0, le=63)
    role: Literal["head", "worker"]
    address: str | None = Field(default=None, description="the address other ranks use (rendezvous)")
    fabric: Fabric = Fabric()
    paths: Paths = Paths()
    expect: Expect = Expect()

    @field_validator("ssh")
    @classmethod
    def _ssh_target(cls, v: str) -> str:
        # (every connection kind: a docker container's name goes into argv and testinfra's URL too)
        parse_target(v)  # ValueError: one line, which the loader names hosts[i].ssh
        return v


class FleetInfo(Strict):
    name: Name
    lane: Name
    trusted_key: str | None = Field(default=None, description="minisign public key file for bundles")
    ssh_config: str | None = Field(default=None, description="relative paths: from this file's folder")
    registry: str | None = Field(default=None, description="https://host:port the hosts pull the image from")
    registry_ca: str | None = Field(default=None, description="the CA file of its TLS (from this file's folder)")
    note: str | None = None

    @field_validator("registry")
    @classmethod
    def _registry_url(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("https://") or v.startswith("http://")):
            raise ValueError(f"not a registry URL (want https://host:port): {v}")
        return v


def fleet_relative(fleet_file: Path, value: str) -> Path:
    """A path the fleet file names (``fleet.ssh_config``, ``fleet.trusted_key``, ``fleet.registry_ca``):
    ``~`` expanded, and a relative one taken from the fleet file's folder, wherever builder runs."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else (fleet_file.parent / p).resolve()


def fleet_file_named(fleet_file: Path, key: str, value: str | None) -> Path | None:
    """`fleet_relative`, when the fleet file names one; ConfigError naming the file and key when it is
    not a file."""
    if value is None:
        return None
    p = fleet_relative(fleet_file, value)
    if not p.is_file():
        raise ConfigError(f"{fleet_file}: {key}: no such file: {p}")
    return p


def ssh_config_file(fleet_file: Path, value: str | None) -> Path | None:
    """The fleet's ``ssh_config`` (the same file for audit, ship and deploy)."""
    return fleet_file_named(fleet_file, "fleet.ssh_config", value)


def fleet_registry_ca(fleet_file: Path, fleet: Fleet) -> Path | None:
    """The fleet's ``registry_ca``: the CA file of its registry's TLS."""
    return fleet_file_named(fleet_file, "fleet.registry_ca", fleet.fleet.registry_ca)


def fleet_trusted_key(fleet_file: Path, fleet: Fleet) -> Path | None:
    """The fleet's ``trusted_key``, the public key its hosts trust (read, and refused when missing or
    malformed, by whoever reads it)."""
    value = fleet.fleet.trusted_key
    return fleet_relative(fleet_file, value) if value else None


class Fleet(Strict):
    fleet: FleetInfo
    hosts: list[Host] = Field(min_length=1)

    @model_validator(mode="after")
    def _ranks(self) -> Fleet:
        names: set[str] = set()
        ranks: dict[int, str] = {}
        for i, h in enumerate(self.hosts):
            if h.name in names:
                raise ValueError(f"hosts[{i}].name: two hosts named {h.name!r}")
            names.add(h.name)
            if h.rank in ranks:
                raise ValueError(f"hosts[{i}].rank: rank {h.rank} is also host {ranks[h.rank]!r}")
            ranks[h.rank] = h.name
        n = len(self.hosts)
        if sorted(ranks) != list(range(n)):
            raise ValueError(f"hosts: ranks must be 0..{n - 1}, got {sorted(ranks)}")
        for i, h in enumerate(self.hosts):
            if (h.rank == 0) != (h.role == "head"):
                raise ValueError(f"hosts[{i}].role: rank 0 is the head and only rank 0 (got rank {h.rank} "
                                 f"as {h.role})")
        return self

    def by_rank(self) -> list[Host]:
        return sorted(self.hosts, key=lambda h: h.rank)

    def head(self) -> Host:
        return self.by_rank()[0]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ConfigError(f"fleet {self.fleet.name}: no host named {name!r}")


def load_fleet(path: Path) -> Fleet:
    raw = read_toml(path)
    try:
        return validate(Fleet, raw, path)
    except ConfigError as e:
        msg = str(e).replace(": (top level): Value error, ", ": ").replace(": Value error, ", ": ")
        raise ConfigError(msg) from None


def hosts_folder(root: Path, given: Path | None = None) -> Path:
    """The inventory folder, where the fleet files are: `given` (``--hosts-dir``), else ``hosts/`` under
    the project root."""
    return given if given is not None else root / "hosts"


def bundles_folder(root: Path, fleet: str, host: str | None = None) -> Path:
    """Where a bundle is written and looked for by default: ``out/bundles/<fleet>/<host>`` under the
    project root (without a host: the fleet's folder of them)."""
    base = root / "out" / "bundles" / fleet
    return base / host if host is not None else base


def fleet_files(hosts_dir: Path) -> list[Path]:
    if not hosts_dir.is_dir():
        raise ConfigError(f"{hosts_dir}: no hosts folder")
    return sorted(p for p in hosts_dir.glob("*.toml") if p.is_file())


def load_fleets(hosts_dir: Path) -> dict[str, tuple[Path, Fleet]]:
    out: dict[str, tuple[Path, Fleet]] = {}
    for p in fleet_files(hosts_dir):
        f = load_fleet(p)
        if f.fleet.name in out:
            raise ConfigError(f"{p}: fleet.name: {f.fleet.name!r} is also defined in {out[f.fleet.name][0]}")
        out[f.fleet.name] = (p, f)
    return out


def find_fleet(hosts_dir: Path, name: str) -> tuple[Path, Fleet]:
    fleets = load_fleets(hosts_dir)
    if name not in fleets:
        raise ConfigError(f"{hosts_dir}: no fleet named {name!r} (have: {', '.join(sorted(fleets)) or 'none'})")
    return fleets[name]


def find_host(hosts_dir: Path, name: str) -> tuple[Path, Fleet, Host]:
    """A host by name across every fleet; `fleet/host` disambiguates."""
    fleets = load_fleets(hosts_dir)
    if "/" in name:
        fname, hname = name.split("/", 1)
        if fname not in fleets:
            raise ConfigError(f"{hosts_dir}: no fleet named {fname!r}")
        p, f = fleets[fname]
        return p, f, f.host(hname)
    found = [(p, f, h) for p, f in fleets.values() for h in f.hosts if h.name == name]
    if not found:
        raise ConfigError(f"{hosts_dir}: no host named {name!r}")
    if len(found) > 1:
        names = ", ".join(f"{f.fleet.name}/{name}" for _, f, _ in found)
        raise ConfigError(f"{hosts_dir}: host {name!r} is in several fleets; say which: {names}")
    return found[0]


def check_against_pins(path: Path, fleet: Fleet, lanes: set[str], lock_lanes: set[str] | None = None) -> None:
    """The fleet's lane must exist in the pins (and in the lock, when given)."""
    if fleet.fleet.lane not in lanes:
        raise ConfigError(f"{path}: fleet.lane: unknown lane {fleet.fleet.lane!r} (pins has: "
                          f"{', '.join(sorted(lanes)) or 'none'})")
    if lock_lanes is not None and fleet.fleet.lane not in lock_lanes:
        raise ConfigError(f"{path}: fleet.lane: lane {fleet.fleet.lane!r} is not in the lock (run `builder lock`)")


# ----------------------------------------------------------------------------- hosts with their fleet


@dataclass(frozen=True)
class FleetHost:
    """A host with its fleet and the inventory file both came from."""

    path: Path
    fleet: Fleet
    host: Host

    @property
    def name(self) -> str:
        return self.host.name

    def ssh_config(self) -> Path | None:
        """The fleet's ssh_config (a relative path: from the fleet file's folder, as ship takes it)."""
        return ssh_config_file(self.path, self.fleet.fleet.ssh_config)


def fleet_hosts(hosts_dir: Path, fleet: str | None) -> list[FleetHost]:
    """Every host of one fleet, or of every fleet (by fleet name), in rank order."""
    if fleet:
        path, f = find_fleet(hosts_dir, fleet)
        fleets = {f.fleet.name: (path, f)}
    else:
        fleets = load_fleets(hosts_dir)
    return [FleetHost(p, f, h) for _, (p, f) in sorted(fleets.items()) for h in f.by_rank()]


def host_rows(hosts_dir: Path, fleet: str | None) -> list[dict[str, Any]]:
    """`builder hosts`: one row per host."""
    return [
        {
            "fleet": t.fleet.fleet.name,
            "lane": t.fleet.fleet.lane,
            "name": t.name,
            "rank": t.host.rank,
            "role": t.host.role,
            "connection": t.host.connection,
            "target": t.host.ssh,
            "address": t.host.address,
            "file": str(t.path),
        }
        for t in fleet_hosts(hosts_dir, fleet)
    ]


# ----------------------------------------------------------------------------- the Ansible inventory


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return json.dumps(str(v))  # a JSON string is a valid YAML double-quoted scalar


def ansible_hostvars(t: FleetHost) -> dict[str, Any]:
    h = t.host
    v: dict[str, Any] = {}
    if h.connection == "local":
        v["ansible_connection"] = "local"
        v["ansible_host"] = "localhost"
    elif h.connection == "docker":
        v["ansible_connection"] = "docker"
        v["ansible_host"] = h.ssh
    else:
        user, hostpart, port = parse_target(h.ssh)
        v["ansible_connection"] = "ssh"
        v["ansible_host"] = hostpart
        if user:
            v["ansible_user"] = user
        if port is not None:
            v["ansible_port"] = port
        # the path, whether or not the file is there yet: an inventory describes the fleet, as `builder
        # hosts` lists it (the test fleet's ssh_config is written when its hosts start); ssh reads it
        # when Ansible connects, and names it then if it is missing
        if t.fleet.fleet.ssh_config:
            cfg = fleet_relative(t.path, t.fleet.fleet.ssh_config)
            v["ansible_ssh_common_args"] = f"-F {shlex.quote(str(cfg))}"
    v["rank"] = h.rank
    v["role"] = h.role
    v["builder_fleet"] = t.fleet.fleet.name
    v["builder_lane"] = t.fleet.fleet.lane
    return v


def ansible_inventory(targets: list[FleetHost], fmt: str = "yaml") -> str:
    """An Ansible inventory (YAML or INI): one group per fleet, rank and role as host vars."""
    groups: dict[str, list[FleetHost]] = {}
    for t in targets:
        groups.setdefault(t.fleet.fleet.name.replace("-", "_").replace(".", "_"), []).append(t)
    if fmt == "ini":
        lines = ["# generated by `builder hosts --ansible FILE`; do not edit (edit hosts/*.toml)"]
        for g, ts in sorted(groups.items()):
            lines.append(f"[{g}]")
            for t in ts:
                kv = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in ansible_hostvars(t).items())
                lines.append(f"{t.name} {kv}")
            lines.append("")
        return "\n".join(lines)
    out = ["# generated by `builder hosts --ansible FILE`; do not edit (edit hosts/*.toml)", "all:", "  children:"]
    for g, ts in sorted(groups.items()):
        out += [f"    {g}:", "      hosts:"]
        for t in ts:
            out.append(f"        {t.name}:")
            for k, v in ansible_hostvars(t).items():
                out.append(f"          {k}: {_yaml_scalar(v)}")
    return "\n".join(out) + "\n"


def write_ansible_inventory(hosts_dir: Path, fleet: str | None, path: Path) -> int:
    """Write the Ansible inventory of one fleet (or all) to `path` (*.yml, *.yaml or *.ini)."""
    targets = fleet_hosts(hosts_dir, fleet)
    if path.suffix.lower() not in (".ini", ".cfg", ".yml", ".yaml"):
        raise ConfigError(f"{path}: name the inventory *.yml, *.yaml or *.ini")
    fmt = "ini" if path.suffix.lower() in (".ini", ".cfg") else "yaml"
    atomic_write(path, ansible_inventory(targets, fmt).encode())
    return len(targets)
