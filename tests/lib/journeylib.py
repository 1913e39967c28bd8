"""The operator's journey on the test fleet, through the CLI alone: lock, image, keygen, bundle, ship, start.

Each step is the `builder` command an operator types, run in a copy of this checkout's files (what a
fresh clone holds: `git ls-files`, plus files not yet committed and not ignored) with its own store,
keys and ssh folder. The hosts are test fleet containers (tests/lib/fleetlib.py) with a real sshd and
their own dockerd; the only thing done to them outside builder is the one-time host preparation an
operator does with sudo on a new Spark (the folders builder installs into, owned by the ssh user).

    with journey(tmp_path, 2) as j:   # shipped pins, demo lane, installed on both hosts, not started
        j.start()                     # current/start.sh on the workers, then the head
        rc, report = j.audit("--phase", "all")
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.lib import clirun, factory, fleetlib

ROOT = Path(__file__).resolve().parents[2]
BUILDER = clirun.SCRIPT
PATHS = factory.HOST_PATHS
#: what a test host is expected to be: no GPU, no RDMA, little free memory and disk
EXPECT: dict[str, Any] = {"gpu_count": 0, "persistence_mode": False, "nvidia_runtime": False, "rdma": False,
                          "min_free_memory_gib": 0.1, "min_free_disk_gib": 0.1}


def project_copy(dest: Path, source: Path = ROOT) -> Path:
    """The checkout's files (or those of the git work tree `source`) as a fresh clone would have them
    (tracked, and new files not ignored)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=source, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, out):
        src = source / rel
        if not src.is_file():  # deleted in the work tree, not yet in the index
            continue
        d = dest / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, d)
    return dest


def fleet_toml(name: str, lane: str, fleet: fleetlib.Fleet, keys: Path, expect: dict[str, Any] | None = None,
               **keys_: Any) -> str:
    """The inventory of a test fleet, a host per container (rank in start order), the fleet's key
    trusted; `keys_`: more `[fleet]` keys (registry, ...)."""
    rows = [factory.host(h.name, rank, address=h.ip, paths=PATHS, expect=EXPECT if expect is None else expect)
            for rank, h in enumerate(fleet.hosts)]
    return factory.toml(factory.fleet(name, lane, rows, ssh_config=fleet.plain_ssh_config,
                                      trusted_key=keys / "builder.pub", **keys_))


def prepare_host(fleet: fleetlib.Fleet, h: fleetlib.Host) -> None:
    """What an operator does once on a new Spark: the folders builder installs into, owned by its user."""
    fleet.exec(h, f"install -d -o {h.user} -g {h.user} {' '.join(PATHS.values())}")


#: the back door's file edits (a standalone script, run on a host as root)
HOSTEDIT = Path(__file__).resolve().parent / "hostedit.py"


def edit_on(fleet: fleetlib.Fleet, h: fleetlib.Host, **req: Any) -> dict[str, Any]:
    """One edit of a file on the host as root through `docker exec` (tests/lib/hostedit.py: its ops);
    `read` returns the file's bytes (base64) and mtime."""
    r = fleet.exec(h, ["python3", "-", json.dumps(req)], input=HOSTEDIT.read_text())
    return dict(json.loads(r.stdout)) if r.stdout.strip() else {}


@dataclass
class Journey:
    root: Path  # the project copy
    fleet: fleetlib.Fleet
    name: str  # the fleet's name in hosts/
    env: dict[str, str]
    keys: Path
    last_stderr: str = ""

    def builder(
        self, *args: str, check: bool = True, timeout: float = 600, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return clirun.run(*args, cwd=self.root, env={**self.env, **self.ssh_dir(), **(env or {})}, check=check,
                          timeout=timeout, argv0=(BUILDER,))

    @staticmethod
    def ssh_dir() -> dict[str, str]:
        """The folder the audit keeps connections in: the running test's own (tests/conftest.py gives
        each test one and closes what is left in it), else the journey's."""
        return {"BUILDER_SSH_DIR": os.environ["BUILDER_SSH_DIR"]} if os.environ.get("BUILDER_SSH_DIR") else {}

    def audit(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        p = self.builder("audit", "--fleet", self.name, "--json", *args, check=False, env=env)
        self.last_stderr = p.stderr
        try:
            data = json.loads(p.stdout)
        except ValueError:
            raise AssertionError(f"audit gave no JSON (exit {p.returncode}): {p.stderr[-3000:]}") from None
        return p.returncode, data

    def host_ref(self, h: fleetlib.Host) -> str:
        return f"{self.name}/{h.name}"

    @property
    def workers_then_head(self) -> list[fleetlib.Host]:
        return list(reversed(self.fleet.hosts))

    def ship_all(self) -> None:
        for h in self.workers_then_head:
            self.builder("ship", self.host_ref(h))

    def start_order(self) -> list[fleetlib.Host]:
        """The hosts in the lane's start order, as `builder launch` shows it."""
        order = json.loads(self.builder("launch", "--fleet", self.name, "--json").stdout)["start_order"]
        by = {h.name: h for h in self.fleet.hosts}
        return [by[n] for n in order]

    def derive(self) -> None:
        """Each host's derivations of its installed release, as an operator makes them by hand."""
        cur = f"{PATHS['bundles']}/current"
        for h in self.fleet.hosts:
            r = self.fleet.ssh(h, f"if [ -f {cur}/derive.json ]; then python3 {cur}/derive.py make {cur}/derive.json; "
                                  "fi", timeout=600)
            assert r.returncode == 0, f"{h.name}: derive.py exit {r.returncode}: {r.stdout[-800:]} {r.stderr[-800:]}"

    def start(self) -> None:
        """start.sh on each host in the lane's start order (each returns once its rank is ready)."""
        self.derive()
        for h in self.start_order():
            r = self.fleet.ssh(h, f"{PATHS['bundles']}/current/start.sh", timeout=600)
            assert r.returncode == 0, f"{h.name}: start.sh exit {r.returncode}: {r.stderr[-1500:]}"

    def stop(self) -> None:
        for h in self.fleet.hosts:
            r = self.fleet.ssh(h, f"{PATHS['bundles']}/current/stop.sh", timeout=120)
            assert r.returncode == 0, f"{h.name}: stop.sh exit {r.returncode}: {r.stderr[-1500:]}"

    def set_serve(self, lane: str = "demo", relock: bool = True, **values: Any) -> None:
        """Change keys of `[lanes.LANE.serve]` in the copy's pins.toml (TOML values: `context=8192`;
        `args=[...]` sets what every rank runs, in `[lanes.LANE.roles.head]` and `.worker`), then
        `builder lock --offline LANE`: a new release of the lane."""
        path = self.root / "pins.toml"
        lines = path.read_text().split("\n")
        for key, value in values.items():
            text = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
            tables = [f"[lanes.{lane}.roles.head]", f"[lanes.{lane}.roles.worker]"] if key == "args" else [
                f"[lanes.{lane}.serve]"]
            for head in tables:
                start = lines.index(head) + 1
                end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
                at = [i for i in range(start, end) if lines[i].split("=", 1)[0].strip() == key]
                if at:
                    lines[at[0]] = f"{key} = {text}"
                else:
                    lines.insert(end, f"{key} = {text}")
        path.write_text("\n".join(lines))
        if relock:
            self.builder("lock", "--offline", lane)

    def set_lane(self, lane: str = "demo", relock: bool = True, **values: Any) -> None:
        """Change top-level keys of `[lanes.LANE]` (`start="head-first"`), then relock the lane."""
        path = self.root / "pins.toml"
        lines = path.read_text().split("\n")
        start = lines.index(f"[lanes.{lane}]") + 1
        end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
        for key, value in values.items():
            text = json.dumps(value)
            at = [i for i in range(start, end) if lines[i].split("=", 1)[0].strip() == key]
            if at:
                lines[at[0]] = f"{key} = {text}"
            else:
                lines.insert(start, f"{key} = {text}")
                end += 1
        path.write_text("\n".join(lines))
        if relock:
            self.builder("lock", "--offline", lane)

    def deploy(self, *args: str, env: dict[str, str] | None = None, timeout: float = 900) -> tuple[int, dict[str, Any]]:
        """`builder deploy --fleet NAME --json ARGS`: (exit code, its JSON report)."""
        p = self.builder("deploy", "--fleet", self.name, "--json", *args, check=False, env=env, timeout=timeout)
        self.last_stderr = p.stderr
        try:
            return p.returncode, json.loads(p.stdout)
        except ValueError:
            raise AssertionError(f"deploy gave no JSON (exit {p.returncode}): {p.stderr[-3000:]}") from None


def failing(report: dict[str, Any]) -> set[tuple[str, str]]:
    """(host, check id) of every check that did not pass or skip."""
    return {
        (h, cid)
        for h, hr in report["hosts"].items()
        for cid, c in hr["checks"].items()
        if c["status"] not in ("pass", "skip")
    }


def builder_env(workdir: Path, store: Path | None = None) -> dict[str, str]:
    """The environment a journey's `builder` commands run in: this checkout's builder, the store, ssh
    folder, Hugging Face home and config under `workdir` (the ssh folder made), offline, no colour."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("BUILDER_", "HF_", "SSH_AUTH"))
    }
    env.update(
        # the builder under test is this checkout's, whichever one the `builder` script was installed from
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        BUILDER_STORE=str(store or workdir / "store"),
        BUILDER_SSH_DIR=str(workdir / "ssh"),
        HF_HUB_OFFLINE="1",
        HF_HOME=str(workdir / "hf-home"),
        XDG_CONFIG_HOME=str(workdir / "config"),
        NO_COLOR="1",
    )
    if os.environ.get("BUILDER_WHEELHOUSE"):
        env["BUILDER_WHEELHOUSE"] = os.environ["BUILDER_WHEELHOUSE"]
    elif (ROOT / ".cache" / "wheelhouse").is_dir():
        env["BUILDER_WHEELHOUSE"] = str(ROOT / ".cache" / "wheelhouse")
    (workdir / "ssh").mkdir(mode=0o700, parents=True, exist_ok=True)
    return env


@contextmanager
def journey(
    workdir: Path, n: int, *, lane: str = "demo", name: str = "journey", store: Path | None = None,
    expect: dict[str, Any] = EXPECT, prepare: Callable[[fleetlib.Fleet, fleetlib.Host], None] | None = None,
    bundle: bool = True, ship: bool = True, image: str = "demo",
    before_lock: Callable[[Path], None] | None = None,
) -> Iterator[Journey]:
    """n test hosts with the lane installed by the CLI from the shipped pins (not started).
    ``bundle=False`` stops after `builder keygen` (no bundle, nothing installed: `builder deploy` makes
    the bundles); ``ship=False`` after `builder bundle` (nothing installed). ``before_lock`` changes the
    copy (its root) before the lock (its pins through tests.lib.factory.edit_pins); ``image`` is the
    lane's image `builder image` builds."""
    workdir.mkdir(parents=True, exist_ok=True)
    root = project_copy(workdir / "project")
    if before_lock is not None:
        before_lock(root)
    keys = workdir / "keys"
    env = builder_env(workdir, store)
    fleet = fleetlib.start_fleet(n, workdir / "fleet")
    try:
        (root / "hosts" / f"{name}.toml").write_text(fleet_toml(name, lane, fleet, keys, expect))
        for h in fleet.hosts:
            prepare_host(fleet, h)
            if prepare is not None:
                prepare(fleet, h)
        j = Journey(root=root, fleet=fleet, name=name, env=env, keys=keys)
        j.builder("lock", "--offline", lane)
        j.builder("fetch", lane, "--offline")
        j.builder("image", image, "--offline")
        j.builder("keygen", "--out", str(keys))
        if bundle:
            j.builder("bundle", "--fleet", name, "--with-image", "--with-models", "--key", str(keys / "builder.key"))
            if ship:
                j.ship_all()
        yield j
    finally:
        fleetlib.close_kept_connections(workdir / "ssh")
        fleet.teardown()
