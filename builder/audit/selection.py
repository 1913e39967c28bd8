"""What one audit is asked to do: its options, the concerns they select (of those the check modules
declare: builder.audit.concerns), and the hosts."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from builder.audit.concerns import Concern, declared
from builder.errors import ConfigError
from builder.inputs.hosts import Fleet, FleetHost, find_host, fleet_hosts, hosts_folder, read_inventory
from builder.inputs.pins import Pins
from builder.lock.lockfile import Lock

MODES = ("fast", "full")
PHASES = ("preflight", "serving", "all")
BACKENDS = ("native", "ansible")
#: the releases an audit can check (AuditOptions.release)
RELEASES = ("current", "staged")


@dataclass
class Loaded:
    """What a command loaded already (a deploy, start or status): the fleet it runs on, from its fleet
    file, and the pins and lock. The audit takes them as they are and reads none of them from disk
    again. ``pins`` and ``lock`` None: the audit reads its own (a rolled-back release's audit, against
    the pins and lock kept with it)."""

    fleet_file: Path
    fleet: Fleet
    pins: Pins | None = None
    lock: Lock | None = None


@dataclass
class AuditOptions:
    root: Path
    pins: Path
    lock: Path
    store: Path
    hosts_dir: Path | None = None
    names: list[str] = field(default_factory=list)
    fleet: str | None = None
    mode: str = "fast"
    phase: str = "preflight"
    only: list[str] | None = None
    backend: str = "native"
    inventory: Path | None = None
    checks_dir: Path | None = None
    connect_timeout: float = 8.0
    host_timeout: float = 900.0
    hash_jobs: int = 4
    workdir: Path | None = None  # keep expectations/results here (default: a temp folder)
    #: seconds each host's ssh connection stays open after the audit, for a later one to reuse
    #: (0: each connection is this audit's own, closed when its host is done)
    ssh_persist: float = 0.0
    #: where kept connections' control sockets live (default: builder.foundation.ssh.control_folder())
    control_dir: Path | None = None
    #: which release the checks read: "current" (the installed one), or "staged" (the one
    #: `builder deploy` staged: <bundles>/staged and state/staged.json; the lane's running release,
    #: which the deploy stops before it switches, counts as the lane's own)
    release: str = "current"
    #: the fleet (and the pins and lock) a command loaded already; None: each read from disk
    loaded: Loaded | None = None
    #: the bundle whose serving record the replay is compared with (a deploy: the release that ran
    #: before); None: the record of the release the head runs (a restart must answer as it did)
    baseline: str | None = None
    #: a replay that differs from the baseline passes, and becomes the baseline (`--accept-replay`)
    accept_replay: bool = False

    def concerns(self, have: tuple[Concern, ...]) -> list[Concern]:
        """The concerns selected of those the checks folder declares (`have`), in their order."""
        if self.only is None:
            return [c for c in have if self.phase in ("all", c.phase)]
        return [c for c in have if c.name in self.only]

    def validate(self) -> tuple[list[Concern], Path]:
        """The selected concerns and the checks folder; ConfigError (exit 2) for a bad option."""
        if self.mode not in MODES:
            raise ConfigError(f"--mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        if self.phase not in PHASES:
            raise ConfigError(f"--phase: expected one of {', '.join(PHASES)}, got {self.phase!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend: expected one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.release not in RELEASES:
            raise ConfigError(f"release: expected current or staged, got {self.release!r}")
        checks_dir = (self.checks_dir or default_checks_dir(self.root)).resolve()
        have = declared(checks_dir)
        names = [c.name for c in have]
        for c in self.only or []:
            if c not in names:
                raise ConfigError(f"--only: unknown concern {c!r} (have: {', '.join(names)})")
        concerns = self.concerns(have)
        if not concerns:
            raise ConfigError(f"--only selects no check for --phase {self.phase}")
        return concerns, checks_dir

    def check_backend(self) -> None:
        if self.backend != "ansible":
            return
        if self.inventory is None or not self.inventory.is_file():
            raise ConfigError(
                f"--inventory: no Ansible inventory file at {self.inventory} "
                f"(write one with `builder hosts --ansible FILE`)"
            )
        if shutil.which("ansible-inventory") is None:
            raise ConfigError("--backend ansible: ansible-inventory is not installed (pip install ansible-core)")


def parse_only(value: str | None) -> list[str] | None:
    """--only's comma-separated concerns, each once (None: all of the phase's). Which names exist is
    the checks folder's to say (AuditOptions.validate)."""
    if value is None or value.strip() == "":
        return None
    return list(dict.fromkeys(part.strip() for part in value.split(",")))


#: the checks folder beside this package (a source checkout's, or an editable install's)
PACKAGE_CHECKS = Path(__file__).resolve().parents[2] / "checks"


def default_checks_dir(root: Path) -> Path:
    """checks/ of the project, else the one beside this package."""
    for cand in (root / "checks", PACKAGE_CHECKS):
        if (cand / "conftest.py").is_file():
            return cand
    raise ConfigError(f"{root / 'checks'}: no checks folder (conftest.py not found)")


def audit_targets(opts: AuditOptions) -> list[FleetHost]:
    """The hosts the audit reaches: of the fleet loaded already (`opts.loaded`), else of the fleet
    files in the inventory folder."""
    if opts.loaded is None:
        return select_targets(hosts_folder(opts.root, opts.hosts_dir), opts.names, opts.fleet)
    path, f = opts.loaded.fleet_file, opts.loaded.fleet
    name = f.fleet.name
    if opts.fleet is not None and opts.fleet != name:
        raise ConfigError(f"{path}: fleet {name!r}, not {opts.fleet!r}")
    if opts.fleet is not None or not opts.names:
        return [FleetHost(path, f, h) for h in f.by_rank()]
    by_name = {h.name: h for h in f.hosts}
    out: list[FleetHost] = []
    for n in dict.fromkeys(opts.names):
        fname, _, hname = n.rpartition("/")
        if fname not in ("", name) or hname not in by_name:
            raise ConfigError(f"{path}: no host named {n!r} in fleet {name!r}")
        out.append(FleetHost(path, f, by_name[hname]))
    return out


def select_targets(hosts_dir: Path, names: list[str], fleet: str | None) -> list[FleetHost]:
    """The hosts named (each once), or every host of the fleet, in rank order."""
    if fleet and names:
        raise ConfigError("give host names or --fleet, not both")
    if fleet:
        return fleet_hosts(hosts_dir, fleet)
    if not names:
        fleets = read_inventory(hosts_dir).fleets
        have = ", ".join(sorted(fleets)) or "none"
        raise ConfigError(f"say which hosts to audit: HOST... or --fleet NAME (fleets: {have})")
    out: list[FleetHost] = []
    for n in names:
        path, f, h = find_host(hosts_dir, n)
        if any(t.fleet.fleet.name == f.fleet.name and t.name == h.name for t in out):
            continue
        out.append(FleetHost(path, f, h))
    return out
