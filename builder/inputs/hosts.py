"""Host inventories under hosts/: fleets, their lane, and each host's rank, fabric, paths and expectations;
the host listing of `builder hosts` (its Ansible inventory: builder.inputs.ansible).

One TOML file per fleet. Everything is validated before any host is contacted: an
unknown lane, a host without a rank, two hosts with one rank, a missing head, a value
of the wrong type each give one line naming the file and key, and exit 2.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from builder.errors import ConfigError
from builder.foundation.ssh import parse_target
from builder.inputs.loader import did_you_mean, read_toml, validate
from builder.inputs.schema import Name, Strict


class Fabric(Strict):
    """The RoCE fabric of one host: one IPv4 per rail, RDMA device names, the GID index."""

    rails: list[str] = Field(default=[], description="one IPv4 address per RoCE rail of this host",
                             examples=[["192.0.2.110", "198.51.100.210"]])
    interfaces: list[str] = Field(default=[], description="the network interfaces of the rails, in rail order "
                                  "(`{interfaces}` and `{interface}` in a lane)", examples=[["enp1s0f0np0"]])
    rdma_devices: list[str] = Field(default=[], description="the RDMA devices the audit checks and a lane's "
                                    "`rdma` devices mount (`{rdma_devices}`)", examples=[["rocep1s0f0"]])
    gid_index: int | Literal["auto"] = Field(
        default="auto", description="the RoCE GID index (`{gid_index}`); `auto`: the lane gets no "
        "`NCCL_IB_GID_INDEX`", examples=[3])
    mtu: int = Field(default=9000, ge=576, le=9216, description="the rails' MTU the audit expects")

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
    """Where builder installs on the host (absolute paths; builder/store/placement.py places each file)."""

    models: str = Field(default="/srv/models", description="the model store: each model's files")
    engram: str = Field(default="/srv/engram", description="the Engram shards of the host's rank",
                        examples=["/nvme/engram"])
    bundles: str = Field(default="/var/lib/builder", description="releases, `current`, `previous`, the "
                         "apply record, derivations and the trusted key")

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
    command: list[str] = Field(min_length=1, description="the load's argv, run on the host; it prints one JSON "
                               "line with its `tflops`", examples=[["python3", "-c", "{matmul}", "{request}"]])
    seconds: float = Field(default=12.0, ge=1, le=60, description="the load's length (the GB10 recipe burns 10-15 s)")
    timeout_s: float = Field(default=120.0, ge=5, le=600, description="the load is killed past this")
    min_tflops: float | None = Field(default=None, gt=0, description="the floor, where the band's is not wanted")
    cleanup: list[str] | None = Field(
        default=None, min_length=1,
        description="run before the load and after a load killed at its timeout: a container outlives its killed CLI")


class Expect(Strict):
    """What the audit expects of the host (never read from the host itself)."""

    gpu_name: str | None = Field(default=None, description="every GPU's name as nvidia-smi gives it (unset: "
                                 "not checked)", examples=["NVIDIA GB10"])
    gpu_count: int = Field(default=1, ge=0, description="how many GPUs the host has (0: none, and the GPU "
                           "checks say so)")
    compute_cap: str | None = Field(default=None, description="every GPU's compute capability (unset: not "
                                    "checked)", examples=["12.1"])
    driver_version: str | None = Field(default=None, description="the NVIDIA driver version (unset: not "
                                       "checked)", examples=["580.159.04"])
    cuda_version: str | None = Field(default=None, description="the CUDA version the driver reports (unset: "
                                     "not checked)", examples=["13.0"])
    persistence_mode: bool | None = Field(default=True, description="every GPU's persistence mode")
    gpu_clock_mhz: int | None = Field(default=None, ge=0, description="sustained SM clock target: every GPU's "
                                      "max SM clock at least this (unset: not checked)", examples=[2100])
    min_free_memory_gib: float = Field(default=0, ge=0, description="the memory gate: MemAvailable at least "
                                       "this many GiB (0: not checked)", examples=[112])
    max_swap_used_gib: float | None = Field(default=None, ge=0, description="swap in use at most this many GiB "
                                            "(unset: not checked)")
    min_free_disk_gib: float = Field(default=0, ge=0, description="free disk under `paths.models` at least "
                                     "this many GiB (0: not checked)", examples=[530])
    nfs_mounts: list[str] = Field(default=[], description="NFS mount points the host must have mounted and "
                                  "in /etc/fstab", examples=[["/mnt/shared"]])
    docker: bool = Field(default=True, description="the host runs a Docker Engine the ssh user may use")
    nvidia_runtime: bool = Field(default=True, description="its Docker Engine has the NVIDIA runtime (GPU "
                                 "lanes' container options apply only then)")
    rdma: bool = Field(default=True, description="the host has RDMA devices (the fabric checks run; a lane's "
                       "`rdma` devices are mounted)")
    memory_wait_s: float = Field(
        default=0, ge=0, le=600,
        description="short of min_free_memory_gib: drop the page cache and wait this long for it (0: refuse at once)")
    burn: Burn | None = Field(default=None, description="the burn gate's load (unset: the burn check skips, "
                              "saying so)")


class Host(Strict):
    """One host of the fleet: how to reach it, its rank, and what the audit expects of it."""

    name: Name = Field(description="the host's name in builder (`builder ship FLEET/NAME`, the audit's "
                       "matrix); unique in the fleet", examples=["spark-1"])
    ssh: str = Field(
        min_length=1,
        description="ssh target: [user@]host[:port], [user@][v6addr]:port or an ssh_config alias "
        "(the container's name for connection = docker)",
        examples=["operator@192.0.2.10", "spark-1"],
    )
    connection: Literal["ssh", "docker", "local"] = Field(
        default="ssh", description="how the audit reaches the host: ssh, `docker exec` into a container, or "
        "this machine itself")
    rank: int = Field(ge=0, le=63, description="the host's rank in the lane; the ranks of a fleet are 0..N-1")
    role: Literal["head", "worker"] = Field(description="`head` for rank 0 (it serves the API), `worker` for "
                                            "every other rank")
    address: str | None = Field(default=None, description="the address other ranks use (rendezvous)")
    fabric: Fabric = Field(default=Fabric(), description="the host's RoCE fabric")
    paths: Paths = Field(default=Paths(), description="where builder installs on the host")
    expect: Expect = Field(default=Expect(), description="what the audit expects of the host")

    @field_validator("ssh")
    @classmethod
    def _ssh_target(cls, v: str) -> str:
        # (every connection kind: a docker container's name goes into argv and testinfra's URL too)
        parse_target(v)  # ValueError: one line, which the loader names hosts[i].ssh
        return v


class FleetInfo(Strict):
    """The fleet as a whole: its name, its lane, and the files every host shares. A relative path is taken
    from the fleet file's folder, wherever builder runs."""

    name: Name = Field(description="the fleet's name (`--fleet NAME`); unique among the fleet files of "
                       "`hosts/`", examples=["spark-tp4"])
    lane: Name = Field(description="the lane of `pins.toml` the fleet runs", examples=["tensorfold-tp4"])
    trusted_key: str | None = Field(default=None, description="the public key file (minisign format) the "
                                    "hosts trust bundles signed by: what `builder keygen --out keys` writes as "
                                    "`keys/builder.pub`", examples=["../keys/builder.pub"])
    ssh_config: str | None = Field(default=None, description="an ssh_config file that audit, ship and deploy "
                                   "give ssh (`ssh -F`)", examples=["../.cache/local-fleet/local/ssh_config"])
    registry: str | None = Field(default=None, description="https://host:port the hosts pull the image from",
                                 examples=["https://spark-head:5000"])
    registry_ca: str | None = Field(default=None, description="the CA file of the registry's TLS",
                                    examples=["ca.crt"])
    models_from: Literal["bundle", "registry"] = Field(
        default="bundle", description="where hosts get model files: `bundle` (carried by the bundle, shipped "
        "over ssh) or `registry` (`bundle --with-models` pushes each file the registry lacks, by its locked "
        "sha256, and each host pulls its files from `registry`, checked by digest); `registry` requires "
        "`registry`")
    registry_pull: str | None = Field(
        default=None, description="where the hosts pull model files from when it is not `registry` (pushes "
        "still go to `registry`): a pull-through front on each host, such as a P2P engine's registry mirror "
        "(Dragonfly's dfdaemon), or the registry's own plain-HTTP listener on the fabric; whatever serves "
        "them, each file is checked against its digest in the signed manifest; needs `models_from = "
        "\"registry\"`", examples=["http://127.0.0.1:65001"])
    note: str | None = Field(default=None, description="free text, for the reader")

    @model_validator(mode="after")
    def _models_need_registry(self) -> FleetInfo:
        if self.models_from == "registry" and self.registry is None:
            raise ValueError("models_from: \"registry\" needs fleet.registry (the registry's URL)")
        if self.registry_pull is not None and self.models_from != "registry":
            raise ValueError("registry_pull needs models_from = \"registry\"")
        return self

    @field_validator("registry", "registry_pull")
    @classmethod
    def _registry_url(cls, v: str | None) -> str | None:
        # scheme://host[:port] and nothing after it: the hosts append /v2/... to it
        u = urlsplit(v) if v is not None else None
        if u is not None and (u.scheme not in ("https", "http") or not u.hostname or u.path.strip("/")
                              or u.query or u.fragment):
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
    """A fleet file, `hosts/NAME.toml`: a `[fleet]` table and one `[[hosts]]` table per host."""

    fleet: FleetInfo = Field(description="the fleet as a whole")
    hosts: list[Host] = Field(min_length=1, description="one table per host, rank 0 (the head) and the "
                              "workers")

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
        raise ConfigError(
            f"fleet {self.fleet.name}: no host named {name!r}{did_you_mean(name, [h.name for h in self.hosts])}"
        )


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


@dataclass(frozen=True)
class Inventory:
    """Every fleet file of a hosts folder, each read on its own: the fleets that validate, by name, and
    the files that do not, each with its one-line error. A bad file fails only what uses it: the fleet
    it names (its ``fleet.name``, else its file name), a host it lists, or a command over every fleet."""

    hosts_dir: Path
    fleets: dict[str, tuple[Path, Fleet]]
    bad: dict[Path, ConfigError]

    def claimed_by_bad(self, fleet: str | None = None, host: str | None = None) -> ConfigError | None:
        """The error of the first bad file that names this fleet or lists this host, if any."""
        for path, err in self.bad.items():
            names, hosts = _claims(path)
            if (fleet is not None and fleet in names) or (host is not None and host in hosts):
                return err
        return None

    def require_all(self) -> None:
        """For what reads every fleet at once: the first bad file's error."""
        for err in self.bad.values():
            raise err

    def unknown(self, what: str, name: str, candidates: list[str]) -> ConfigError:
        """No such fleet or host: the closest name, what there is, and the files that could not be read."""
        unread = f"; unreadable: {', '.join(str(p) for p in self.bad)}" if self.bad else ""
        return ConfigError(
            f"{self.hosts_dir}: no {what} named {name!r}{did_you_mean(name, candidates)} "
            f"(have: {', '.join(sorted(set(candidates))) or 'none'}{unread})"
        )


def _claims(path: Path) -> tuple[set[str], set[str]]:
    """The fleet names and host names a fleet file that does not validate still says it holds: its
    `fleet.name` (else its file name) and its `hosts[].name` strings, as far as its TOML reads."""
    try:
        raw = read_toml(path)
    except ConfigError:
        return {path.stem}, set()
    fleet = raw.get("fleet")
    name = fleet.get("name") if isinstance(fleet, dict) else None
    hosts = raw.get("hosts")
    host_names = {h["name"] for h in hosts if isinstance(h, dict) and isinstance(h.get("name"), str)} \
        if isinstance(hosts, list) else set()
    return ({name} if isinstance(name, str) else {path.stem}), host_names


def read_inventory(hosts_dir: Path) -> Inventory:
    fleets: dict[str, tuple[Path, Fleet]] = {}
    bad: dict[Path, ConfigError] = {}
    for p in fleet_files(hosts_dir):
        try:
            f = load_fleet(p)
        except ConfigError as e:
            bad[p] = e
            continue
        if f.fleet.name in fleets:
            bad[p] = ConfigError(f"{p}: fleet.name: {f.fleet.name!r} is also defined in {fleets[f.fleet.name][0]}")
            continue
        fleets[f.fleet.name] = (p, f)
    return Inventory(hosts_dir, fleets, bad)


def load_fleets(hosts_dir: Path) -> dict[str, tuple[Path, Fleet]]:
    """Every fleet; the first file that does not validate fails it (for what uses every fleet)."""
    inv = read_inventory(hosts_dir)
    inv.require_all()
    return inv.fleets


def find_fleet(hosts_dir: Path, name: str) -> tuple[Path, Fleet]:
    """The fleet named ``name``; a bad file fails it only where that file names this fleet."""
    inv = read_inventory(hosts_dir)
    err = inv.claimed_by_bad(fleet=name)
    if err is not None:
        raise err
    if name not in inv.fleets:
        raise inv.unknown("fleet", name, list(inv.fleets))
    return inv.fleets[name]


def find_host(hosts_dir: Path, name: str) -> tuple[Path, Fleet, Host]:
    """A host by name across every fleet; `fleet/host` disambiguates. A bad file fails it only where
    that file names the fleet or lists the host."""
    if "/" in name:
        fname, hname = name.split("/", 1)
        p, f = find_fleet(hosts_dir, fname)
        return p, f, f.host(hname)
    inv = read_inventory(hosts_dir)
    err = inv.claimed_by_bad(host=name)
    if err is not None:
        raise err
    found = [(p, f, h) for p, f in inv.fleets.values() for h in f.hosts if h.name == name]
    if not found:
        raise inv.unknown("host", name, [h.name for _, f in inv.fleets.values() for h in f.hosts])
    if len(found) > 1:
        names = ", ".join(f"{f.fleet.name}/{name}" for _, f, _ in found)
        raise ConfigError(f"{hosts_dir}: host {name!r} is in several fleets; say which: {names}")
    return found[0]


def check_against_pins(path: Path, fleet: Fleet, lanes: set[str], lock_lanes: set[str] | None = None) -> None:
    """The fleet's lane must exist in the pins (and in the lock, when given)."""
    if fleet.fleet.lane not in lanes:
        raise ConfigError(f"{path}: fleet.lane: unknown lane {fleet.fleet.lane!r}"
                          f"{did_you_mean(fleet.fleet.lane, lanes)} (pins has: "
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


def host_rows(hosts_dir: Path, fleet: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """`builder hosts`: one row per host, and one error line per fleet file that does not validate
    (without --fleet, the other fleets are still listed; with it, only that fleet's file counts)."""
    if fleet:
        targets, errors = fleet_hosts(hosts_dir, fleet), []
    else:
        inv = read_inventory(hosts_dir)
        targets = [FleetHost(p, f, h) for _, (p, f) in sorted(inv.fleets.items()) for h in f.by_rank()]
        errors = [str(e) for e in inv.bad.values()]
    rows = [
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
        for t in targets
    ]
    return rows, errors
