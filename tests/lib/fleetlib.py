"""The test fleet: containers that behave like DGX Spark hosts, for tests of ship, install, audit, faults.

Each test host is a container of the image that ``tests/fleet/build-testhost.sh`` builds (Debian bookworm,
real OpenSSH server, its own dockerd and image store). A fleet gets its own Docker bridge network, so its
hosts' IPs are reachable from this machine and concurrent test runs never share anything.

    from tests.lib.fleetlib import start_fleet

    with start_fleet(2, tmp_path) as fleet:
        h = fleet.hosts[0]                     # Host(name="spark-test-1", ip=..., user="spark", ...)
        fleet.ssh(h, "hostname")               # real ssh, StrictHostKeyChecking=yes, key from tmp_path
        fleet.exec(h, "docker images")         # docker exec (the back door, no network involved)
        fleet.cut(h); ...; fleet.restore(h)    # pull the cable, keep the IP

``fleet.ssh_config`` (Host entries by name and IP), ``fleet.known_hosts`` and ``fleet.identity`` are what a
builder inventory for the fleet points at; :meth:`Fleet.inventory` returns those fields.

pytest, from a fixture in conftest.py::

    @pytest.fixture
    def fleet2(request):
        return fleetlib.fleet_fixture(request, 2)

Every container and network carries the label ``builder-test=1`` (and ``builder-test.owner=HOST:PID``);
:func:`reap_stale` removes those left by runs whose process is gone.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

FLEET_DIR = Path(__file__).resolve().parents[1] / "fleet"
RECIPE_FILES = ("build-testhost.sh", "entrypoint.sh")
IMAGE_REPO = "builder-testhost"
LABEL = "builder-test"
SSH_USER = "spark"
CONNECT_TIMEOUT = 5
NFQUEUE_NUM = 7

# Linux capability names by bit number (for the bounding-set check, see _cap_drops).
_CAPS = (
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
    "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT "
    "SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE "
    "AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ "
    "PERFMON BPF CHECKPOINT_RESTORE"
).split()


class FleetError(RuntimeError):
    """The test fleet could not be started or driven (one line naming the host or step)."""


# --------------------------------------------------------------------------------------------- docker


def docker(
    *args: str, check: bool = True, timeout: float = 120, input: bytes | None = None, stdin: Any = None
) -> subprocess.CompletedProcess[str]:
    """Run the docker CLI; raise FleetError with its stderr on failure when check is set."""
    try:
        proc = subprocess.run(
            ["docker", *args],
            input=input.decode() if input is not None else None,
            stdin=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise FleetError(f"docker {' '.join(args[:2])}: timed out after {timeout}s") from exc
    except FileNotFoundError as exc:
        raise FleetError("docker CLI not found") from exc
    if check and proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise FleetError(f"docker {' '.join(args[:3])}: {last[0]}")
    return proc


def docker_available() -> bool:
    """True when the docker CLI is installed and the engine answers."""
    try:
        # (a bound on a hung engine, not a speed test: a machine busy with other suites answers slowly)
        return subprocess.run(["docker", "info"], capture_output=True, timeout=180).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def testhost_tag() -> str:
    """The tag build-testhost.sh gives the image of the current recipe: builder-testhost:<16 hex>."""
    h = hashlib.sha256()
    for name in RECIPE_FILES:
        h.update((FLEET_DIR / name).read_bytes())
    return f"{IMAGE_REPO}:{h.hexdigest()[:16]}"


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, check=False).returncode == 0


def ensure_testhost_image(build: bool = True) -> str:
    """Return the test host image tag; build it (root, a few minutes the first time) when missing and
    ``build`` is set, else raise FleetError naming the script to run."""
    tag = testhost_tag()
    if image_exists(tag):
        return tag
    script = FLEET_DIR / "build-testhost.sh"
    if not build:
        raise FleetError(f"{tag}: image missing; run {script}")
    proc = subprocess.run([str(script)], capture_output=True, text=True)
    if proc.returncode != 0 or not image_exists(tag):
        last = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise FleetError(f"{script}: failed: {last[0]}")
    return tag


def tiny_image(
    tag: str = "builder-test-tiny:1",
    *,
    files: dict[str, bytes] | None = None,
    labels: dict[str, str] | None = None,
) -> str:
    """Build (in this machine's engine, no pulls) an image FROM scratch holding a static busybox at
    /bin/busybox (entrypoint), plus ``files`` (path in image -> bytes) and ``labels``. Returns its ImageID.

    ``docker run --network host IMAGE httpd -f -p PORT -h DIR`` serves DIR over HTTP."""
    testhost = ensure_testhost_image(build=True)
    with tempfile.TemporaryDirectory(prefix="bt-tiny-") as tmp:
        ctx = Path(tmp)
        cid = docker("create", testhost).stdout.strip()
        try:
            docker("cp", f"{cid}:/bin/busybox", str(ctx / "busybox"))
        finally:
            docker("rm", "-f", "-v", cid, check=False)  # (-v: the image's VOLUME made one)
        lines = ["FROM scratch", "COPY busybox /bin/busybox"]
        for i, (dest, data) in enumerate(sorted((files or {}).items())):
            (ctx / f"f{i}").write_bytes(data)
            lines.append(f"COPY f{i} {dest}")
        for key, value in sorted((labels or {}).items()):
            lines.append(f"LABEL {key}={shlex.quote(value)}")
        lines.append('ENTRYPOINT ["/bin/busybox"]')
        (ctx / "Dockerfile").write_text("\n".join(lines) + "\n")
        # The engine's classic builder answers a step from its cache with an untagged image that other
        # tiny images share as their parent; a test removing its own tiny image removes that parent too
        # once it has no other child, and a build that took it from the cache then fails ("unknown
        # parent image ID"). Built again, the step finds no such image in the cache and makes its own.
        for attempt in range(3):
            proc = docker("build", "-q", "-t", tag, str(ctx), timeout=300, check=False)
            if proc.returncode == 0:
                break
            last = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            if attempt == 2 or not re.search(r"unknown parent image ID|No such image", proc.stderr):
                raise FleetError(f"docker build {tag}: {last[0]}")
    return docker("image", "inspect", "-f", "{{.Id}}", tag).stdout.strip()


def save_image(tag: str, path: Path) -> Path:
    """``docker save`` an image of this machine's engine to a tarball."""
    docker("save", "-o", str(path), tag, timeout=600)
    return path


def _cap_drops() -> list[str]:
    """Capabilities missing from this process's bounding set. ``--privileged`` asks runc for every
    capability and fails ("unable to apply caps") when the engine's bounding set lacks one (this machine
    lacks SYS_RESOURCE), so hosts run with ``--cap-add ALL`` minus these."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapBnd:"):
                bnd = int(line.split()[1], 16)
                return [name for bit, name in enumerate(_CAPS) if not bnd & (1 << bit)]
    except OSError:
        pass
    return []


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def reap_stale() -> list[str]:
    """Remove fleet containers and networks whose owning process (same machine) is gone. Returns what
    was removed. Safe while other runs are active: it only touches owners that no longer exist."""
    removed: list[str] = []
    me = socket.gethostname()

    def dead(owner: str) -> bool:
        host, _, pid = owner.rpartition(":")
        if host != me or not pid.isdigit():
            return False
        return not Path(f"/proc/{pid}").exists()

    out = docker(
        "ps",
        "-a",
        "--filter",
        f"label={LABEL}=1",
        "--format",
        '{{.ID}} {{.Label "builder-test.owner"}}',
        check=False,
    ).stdout
    stale = [cid for cid, _, owner in (ln.partition(" ") for ln in out.splitlines()) if dead(owner)]
    if stale:
        docker("rm", "-f", "-v", *stale, check=False)
        removed += stale
    out = docker(
        "network",
        "ls",
        "--filter",
        f"label={LABEL}=1",
        "--format",
        '{{.Name}} {{.Label "builder-test.owner"}}',
        check=False,
    ).stdout
    for name, _, owner in (ln.partition(" ") for ln in out.splitlines()):
        if dead(owner) and docker("network", "rm", name, check=False).returncode == 0:
            removed.append(name)
    return removed


# --------------------------------------------------------------------------------------------- fleet


@dataclass(frozen=True)
class Host:
    """One test host. ``name`` is what ssh_config and inventories use; ``ip`` is reachable from here."""

    name: str
    ip: str
    container: str  # container id
    container_name: str
    user: str = SSH_USER
    port: int = 22

    @property
    def ssh_target(self) -> str:
        """user@ip:port, the form an inventory's ssh target takes."""
        return f"{self.user}@{self.ip}:{self.port}"


HostRef = Host | str | int


@dataclass
class Fleet:
    """A running test fleet; use :func:`start_fleet`. A context manager: leaving it tears down."""

    __test__ = False  # not a pytest test class, whatever it is imported as

    workdir: Path
    network: str
    subnet: str
    hosts: list[Host]
    identity: Path
    ssh_config: Path
    known_hosts: Path
    control_dir: Path
    dockerd: bool = True
    _torn_down: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _delayed: set[str] = field(default_factory=set, repr=False)

    # ---- lookup

    @property
    def plain_ssh_config(self) -> Path:
        """The same Host entries as ssh_config without ControlMaster, ControlPath and ControlPersist,
        as an operator's ssh_config often is: a tool given it must keep to one connection per host
        by itself. The audit's tests and benchmark give `builder audit` this one."""
        return self.workdir / "ssh_config.plain"

    def host(self, ref: HostRef) -> Host:
        """A host by Host, name ('spark-test-2'), container name, or index (0-based)."""
        if isinstance(ref, Host):
            return ref
        if isinstance(ref, int):
            return self.hosts[ref]
        for h in self.hosts:
            if ref in (h.name, h.container_name, h.ip):
                return h
        raise FleetError(f"{ref}: no such host in fleet {self.network}")

    def __getitem__(self, ref: HostRef) -> Host:
        return self.host(ref)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def inventory(self, ref: HostRef) -> dict[str, str]:
        """The fields an inventory entry for this host needs."""
        h = self.host(ref)
        return {
            "name": h.name,
            "ssh": h.ssh_target,
            "identity_file": str(self.identity),
            "known_hosts": str(self.known_hosts),
            "ssh_config": str(self.ssh_config),
        }

    # ---- running things

    def exec(
        self,
        ref: HostRef,
        cmd: str | Sequence[str],
        *,
        user: str | None = None,
        check: bool = True,
        input: bytes | str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """``docker exec`` in the host (not via the network): a str runs through ``sh -c``."""
        h = self.host(ref)
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        opts = ["-i"] if input is not None else []
        if user:
            opts += ["-u", user]
        data = input.encode() if isinstance(input, str) else input
        proc = docker("exec", *opts, h.container, *argv, check=False, timeout=timeout, input=data)
        if check and proc.returncode != 0:
            raise FleetError(
                f"{h.name}: {shlex.join(argv)[:120]}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}"
            )
        return proc

    def ssh_argv(self, ref: HostRef, *extra: str) -> list[str]:
        """argv prefix for ssh to the host through the fleet's ssh_config."""
        return ["ssh", "-F", str(self.ssh_config), *extra, self.host(ref).name]

    def ssh(
        self,
        ref: HostRef,
        cmd: str,
        *,
        check: bool = False,
        timeout: float = 60,
        input: str | None = None,
        options: Sequence[str] = (),
    ) -> subprocess.CompletedProcess[str]:
        """Run cmd over real ssh (as the host's user). Returns the CompletedProcess (255 = ssh failed)."""
        argv = self.ssh_argv(ref, *[a for o in options for a in ("-o", o)]) + ["--", cmd]
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            input=input,
            stdin=subprocess.DEVNULL if input is None else None,
        )
        if check and proc.returncode != 0:
            raise FleetError(
                f"{self.host(ref).name}: ssh {cmd[:80]!r}: exit {proc.returncode}: "
                f"{proc.stderr.strip()[-300:]}"
            )
        return proc

    def close_connection(self, ref: HostRef) -> None:
        """Close the host's ssh ControlMaster, if any, so the next ssh connects afresh."""
        subprocess.run(self.ssh_argv(ref, "-O", "exit"), capture_output=True, timeout=10)

    # ---- images (the host's own dockerd)

    def wait_docker(self, ref: HostRef, timeout: float = 60) -> None:
        h = self.host(ref)
        deadline = time.monotonic() + timeout
        # (a dockerd that has written to its log and is no longer running has ended, and no wait brings
        # it up; an empty log: not yet started)
        probe = ("docker version -f '{{.Server.Version}}' >/dev/null 2>&1 || "
                 "{ pgrep -x dockerd >/dev/null || ! [ -s /var/log/dockerd.log ] || exit 3; exit 1; }")
        while True:
            rc = self.exec(h, probe, check=False).returncode
            if rc == 0:
                return
            if rc == 3 or time.monotonic() > deadline:
                log = self.exec(h, "tail -n 5 /var/log/dockerd.log", check=False).stdout.strip()
                why = "ended" if rc == 3 else f"not ready after {timeout}s"
                raise FleetError(f"{h.name}: inner dockerd {why}: {log[-300:]}")
            time.sleep(0.2)

    def docker_load(self, ref: HostRef, tarball: Path) -> str:
        """Load an image tarball into the host's own image store (streamed via docker exec)."""
        h = self.host(ref)
        with open(tarball, "rb") as f:
            proc = docker("exec", "-i", h.container, "docker", "load", stdin=f, check=False, timeout=600)
        if proc.returncode != 0:
            raise FleetError(f"{h.name}: docker load {tarball}: {proc.stderr.strip()[-300:]}")
        return proc.stdout.strip()

    def clear_engine(self, ref: HostRef, keep: Collection[str] | None = ()) -> None:
        """Remove every container of the host's own engine, and every image but the IDs in ``keep``
        (None: every image stays). A kept store (docker_stores) then holds what the next fleet needs
        and nothing of this one's."""
        self.exec(ref, 'ids=$(docker ps -aq) && { [ -z "$ids" ] || docker rm -f -v $ids >/dev/null; }', timeout=300)
        if keep is None:
            return
        drop = sorted(self.images(ref) - set(keep))
        if drop:
            self.exec(ref, ["docker", "rmi", "-f", *drop], timeout=300)

    def stop_engine(self, ref: HostRef, timeout: float = 60) -> None:
        """Stop the host's own engine (SIGTERM, as a host shutting down does) and wait until it has
        ended: a kept store is then left as the engine writes it on a clean stop."""
        self.exec(ref, f"pkill -TERM -x dockerd; timeout {timeout:g} sh -c 'while pgrep -x dockerd >/dev/null; "
                       "do sleep 0.2; done'", timeout=timeout + 30)

    def images(self, ref: HostRef) -> set[str]:
        """ImageIDs (sha256:...) in the host's own image store."""
        out = self.exec(ref, ["docker", "images", "-q", "--no-trunc"]).stdout
        return {line.strip() for line in out.splitlines() if line.strip()}

    # ---- faults

    def cut(self, ref: HostRef) -> None:
        """Disconnect the host from its network (the cable pulled); its IP is kept for restore()."""
        h = self.host(ref)
        self.close_connection(h)
        docker("network", "disconnect", "-f", self.network, h.container)

    def restore(self, ref: HostRef) -> None:
        """Reconnect a cut host with its old IP."""
        h = self.host(ref)
        docker("network", "connect", "--ip", h.ip, self.network, h.container)
        _wait_banner(h, 30)

    def stop_sshd(self, ref: HostRef, sessions: bool = True) -> None:
        """Stop the host's sshd (the listener; with ``sessions`` also live sessions). Port 22 then refuses."""
        h = self.host(ref)
        self.close_connection(h)
        cmd = "kill $(cat /run/sshd.pid) 2>/dev/null; rm -f /run/sshd.pid"
        if sessions:
            cmd += "; pkill -x sshd || true"  # inside the test container only
        self.exec(h, cmd, check=False)
        deadline = time.monotonic() + 10
        while _port_open(h.ip, h.port) and time.monotonic() < deadline:
            time.sleep(0.1)

    def start_sshd(self, ref: HostRef) -> None:
        h = self.host(ref)
        docker("exec", "-d", h.container, "sh", "-c", "/usr/sbin/sshd -D -e >>/var/log/sshd.log 2>&1")
        _wait_banner(h, 30)

    def pause(self, ref: HostRef) -> None:
        """Freeze every process of the host (``docker pause``): TCP still connects, nothing answers."""
        docker("pause", self.host(ref).container)

    def unpause(self, ref: HostRef) -> None:
        docker("unpause", self.host(ref).container)

    def iface(self, ref: HostRef) -> str:
        """The host's network interface holding its IP (eth0 at start; the name can change after
        cut() and restore())."""
        h = self.host(ref)
        for line in self.exec(h, ["ip", "-o", "-4", "addr", "show"]).stdout.splitlines():
            fields = line.split()
            if len(fields) > 3 and fields[3].split("/")[0] == h.ip:
                return fields[1]
        raise FleetError(f"{h.name}: no interface holds {h.ip} (cut?)")

    def netem(self, ref: HostRef, delay_ms: float = 0, loss_pct: float = 0) -> str:
        """Delay and/or drop the host's outgoing packets. Uses ``tc qdisc ... netem`` when the kernel has
        sch_netem; otherwise (as on kernels built without it) an NFQUEUE delayer in the host
        (tests/fleet/nfdelay.py) with the same effect on egress. Returns "netem" or "nfqueue"."""
        h = self.host(ref)
        self.clear_netem(h)
        tc = f"tc qdisc replace dev {self.iface(h)} root netem delay {delay_ms}ms loss {loss_pct}%"
        if self.exec(h, tc, check=False).returncode == 0:
            return "netem"
        docker("cp", str(FLEET_DIR / "nfdelay.py"), f"{h.container}:/usr/local/sbin/nfdelay.py")
        docker(
            "exec",
            "-d",
            h.container,
            "sh",
            "-c",
            f"echo $$ > /run/nfdelay.pid; exec python3 /usr/local/sbin/nfdelay.py "
            f"{NFQUEUE_NUM} {float(delay_ms)} {float(loss_pct)} >>/var/log/nfdelay.log 2>&1",
        )
        deadline = time.monotonic() + 10
        bound = f"grep -q '^ *{NFQUEUE_NUM} ' /proc/net/netfilter/nfnetlink_queue"
        while self.exec(h, bound, check=False).returncode != 0:
            if time.monotonic() > deadline:
                log = self.exec(h, "cat /var/log/nfdelay.log", check=False).stdout
                raise FleetError(f"{h.name}: nfqueue delayer did not start: {log.strip()[-300:]}")
            time.sleep(0.1)
        self.exec(h, f"iptables -I OUTPUT ! -o lo -j NFQUEUE --queue-num {NFQUEUE_NUM} --queue-bypass")
        self._delayed.add(h.name)
        return "nfqueue"

    def clear_netem(self, ref: HostRef) -> None:
        """Undo :meth:`netem`."""
        h = self.host(ref)
        try:
            dev = self.iface(h)
        except FleetError:
            dev = "eth0"
        self.exec(
            h,
            f"tc qdisc del dev {dev} root 2>/dev/null; "
            f"while iptables -D OUTPUT ! -o lo -j NFQUEUE --queue-num {NFQUEUE_NUM} --queue-bypass "
            "2>/dev/null; do :; done; "
            "[ -f /run/nfdelay.pid ] && kill $(cat /run/nfdelay.pid) 2>/dev/null; "
            "rm -f /run/nfdelay.pid; true",
            check=False,
        )
        self._delayed.discard(h.name)

    # ---- measurement and cleanup

    def memory(self) -> dict[str, int]:
        """Memory use (bytes, cgroup usage incl. page cache) of each host container, by host name."""
        out = docker(
            "stats", "--no-stream", "--format", "{{.ID}} {{.MemUsage}}", *[h.container for h in self.hosts]
        ).stdout
        by_id = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.strip()}
        units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "kB": 1000, "MB": 10**6, "GB": 10**9}
        result: dict[str, int] = {}
        for h in self.hosts:
            raw = next((v for k, v in by_id.items() if h.container.startswith(k)), "0B")
            num = raw.rstrip("KMGiBk")
            unit = raw[len(num) :]
            result[h.name] = int(float(num) * units.get(unit, 1))
        return result

    def teardown(self) -> None:
        """Remove the fleet's containers (with their volumes), network and ssh control sockets.
        Idempotent, and safe after a half-started fleet."""
        with self._lock:
            if self._torn_down:
                return
            self._torn_down = True
        for h in self.hosts:
            try:
                self.close_connection(h)
            except (OSError, subprocess.SubprocessError):
                pass
        _remove_fleet(self.network)
        shutil.rmtree(self.control_dir, ignore_errors=True)


def close_kept_connections(folder: Path, remove: bool = True) -> None:
    """Close the ssh connections that audits kept open (`--ssh-persist`) in `folder`, and remove it
    (unless `remove` is false)."""
    if not folder.is_dir():
        return
    for sock in (s for s in folder.iterdir() if s.is_socket()):
        subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "--", "unused"],
                       capture_output=True, stdin=subprocess.DEVNULL, timeout=30, check=False)
    if remove:
        shutil.rmtree(folder, ignore_errors=True)


def _remove_fleet(network: str) -> None:
    out = docker("ps", "-aq", "--filter", f"label=builder-test.fleet={network}", check=False).stdout.split()
    if out:
        docker("rm", "-f", "-v", *out, check=False, timeout=180)
    docker("network", "rm", network, check=False)


def _port_open(ip: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False


def _wait_banner(h: Host, timeout: float) -> None:
    """Wait until the host's sshd sends its SSH banner."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((h.ip, h.port), timeout=1) as s:
                s.settimeout(2)
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.05)
    raise FleetError(f"{h.name}: sshd at {h.ip}:{h.port} did not answer within {timeout}s ({last})")


def _create_network(name: str, labels: list[str]) -> str:
    """Create a bridge network with an explicit subnet (needed to reconnect with a fixed IP). Docker
    picks a free subnet first (it checks other networks and host routes); we then claim it explicitly."""
    for _ in range(5):
        docker("network", "create", *labels, name)
        subnet = docker("network", "inspect", "-f", "{{(index .IPAM.Config 0).Subnet}}", name).stdout.strip()
        docker("network", "rm", name)
        proc = docker("network", "create", "--subnet", subnet, *labels, name, check=False)
        if proc.returncode == 0:
            return subnet
    raise FleetError(f"{name}: could not create a fleet network")


def start_fleet(
    n: int,
    workdir: Path | str,
    *,
    dockerd: bool = True,
    image: str | None = None,
    build: bool = True,
    names: Sequence[str] | None = None,
    user: str = SSH_USER,
    timeout: float = 60,
    owner: str | None = None,
    labels: dict[str, str] | None = None,
    docker_stores: Sequence[str] | None = None,
) -> Fleet:
    """Start n test hosts in parallel and return the running Fleet (use it as a context manager, or call
    teardown()). ``workdir`` receives id_ed25519(.pub), known_hosts and ssh_config. ``dockerd=False``
    skips each host's own Docker Engine (faster, ~70 MiB less per host). ``owner`` replaces the
    ``builder-test.owner`` label (HOST:PID of this process, which :func:`reap_stale` removes once the
    process is gone): a fleet meant to outlive this process names an owner that is not a HOST:PID.
    ``labels`` are more labels for its containers and network. ``docker_stores`` names a Docker volume
    per host for its engine's store (/var/lib/docker), which outlives the fleet (the default: an
    anonymous volume, removed with the host). On any failure everything started is removed before
    FleetError is raised."""
    if n < 1:
        raise FleetError(f"n={n}: a fleet needs at least one host")
    if docker_stores is not None and len(docker_stores) != n:
        raise FleetError(f"docker_stores: {len(docker_stores)} volumes for {n} hosts")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    tag = image or ensure_testhost_image(build=build)
    host_names = list(names) if names else [f"spark-test-{i}" for i in range(1, n + 1)]
    if len(host_names) != n:
        raise FleetError(f"names: {len(host_names)} names for {n} hosts")
    network = f"bt-{secrets.token_hex(4)}"
    label_args = [
        "--label",
        f"{LABEL}=1",
        "--label",
        f"builder-test.fleet={network}",
        "--label",
        f"builder-test.owner={owner or _owner()}",
        *[a for k, v in sorted((labels or {}).items()) for a in ("--label", f"{k}={v}")],
    ]
    identity = workdir / "id_ed25519"
    # ssh control sockets need a short path (108 bytes); workdir (pytest tmp_path) may be long.
    control_dir = Path(tempfile.mkdtemp(prefix="bt-cm-", dir="/tmp"))
    fleet = Fleet(
        workdir=workdir,
        network=network,
        subnet="",
        hosts=[],
        identity=identity,
        ssh_config=workdir / "ssh_config",
        known_hosts=workdir / "known_hosts",
        control_dir=control_dir,
        dockerd=dockerd,
    )
    try:
        if identity.exists():
            identity.unlink()
            Path(f"{identity}.pub").unlink(missing_ok=True)
        subprocess.run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                f"builder-test@{network}",
                "-f",
                str(identity),
            ],
            check=True,
            capture_output=True,
        )
        pubkey = Path(f"{identity}.pub").read_text().strip()
        fleet.subnet = _create_network(network, label_args)
        drops = _cap_drops()
        sec = [
            "--security-opt",
            "seccomp=unconfined",
            "--security-opt",
            "apparmor=unconfined",
            "--security-opt",
            "systempaths=unconfined",
            "--device-cgroup-rule",
            "a *:* rwm",
        ]

        # Fixed addresses in name order: spark-test-1 gets the subnet's second address (the first is the
        # bridge's gateway), and so on.
        addrs = list(itertools.islice(ipaddress.ip_network(fleet.subnet).hosts(), 1, n + 1))
        ip_of = {name: str(addr) for name, addr in zip(host_names, addrs, strict=True)}

        store_of = dict(zip(host_names, docker_stores, strict=True)) if docker_stores is not None else {}

        def run(name: str) -> str:
            left = list(drops)
            store = ["-v", f"{store_of[name]}:/var/lib/docker"] if name in store_of else []
            while True:
                caps = ["--cap-add", "ALL", *[a for c in left for a in ("--cap-drop", c)]]
                proc = docker(
                    "run",
                    "-d",
                    "--name",
                    f"{network}-{name}",
                    "--hostname",
                    name,
                    "--network",
                    network,
                    "--ip",
                    ip_of[name],
                    *label_args,
                    "--label",
                    f"builder-test.host={name}",
                    *caps,
                    *sec,
                    *store,
                    "-e",
                    f"TESTHOST_AUTHORIZED_KEY={pubkey}",
                    "-e",
                    f"TESTHOST_DOCKERD={1 if dockerd else 0}",
                    tag,
                    timeout=120,
                    check=False,
                )
                if proc.returncode == 0:
                    return proc.stdout.strip()
                # an engine that does not know a capability (Debian 12's 20.10 and CAP_PERFMON, CAP_BPF,
                # CAP_CHECKPOINT_RESTORE) refuses to drop it, and its ALL never held it: leave it out
                unknown = re.search(r'unknown capability: "CAP_(\w+)"', proc.stderr)
                if unknown is None or unknown.group(1) not in left:
                    said = [ln for ln in proc.stderr.splitlines() if ln.strip()][:1] or [f"exit {proc.returncode}"]
                    raise FleetError(f"docker run {network}-{name}: {said[0]}")
                left.remove(unknown.group(1))

        with ThreadPoolExecutor(max_workers=min(n, 8)) as pool:
            ids = list(pool.map(run, host_names))
        fmt = "{{.Id}} {{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
        ips = dict(line.split() for line in docker("inspect", "-f", fmt, *ids).stdout.splitlines())
        fleet.hosts = [
            Host(name=nm, ip=ips[cid], container=cid, container_name=f"{network}-{nm}", user=user)
            for nm, cid in zip(host_names, ids, strict=True)
        ]

        def ready(h: Host) -> str:
            _wait_banner(h, timeout)
            key = fleet.exec(h, ["cat", "/etc/ssh/ssh_host_ed25519_key.pub"]).stdout.split()
            if dockerd:
                fleet.wait_docker(h, timeout)
            return f"{h.name},{h.ip} {key[0]} {key[1]}\n"

        with ThreadPoolExecutor(max_workers=min(n, 8)) as pool:
            entries = list(pool.map(ready, fleet.hosts))
        fleet.known_hosts.write_text("".join(entries))
        fleet.ssh_config.write_text("".join(_ssh_block(h, fleet) for h in fleet.hosts))
        fleet.plain_ssh_config.write_text("".join(_ssh_block(h, fleet, control=False) for h in fleet.hosts))
        with ThreadPoolExecutor(max_workers=min(n, 8)) as pool:
            list(pool.map(lambda h: fleet.ssh(h, "true", check=True, timeout=timeout), fleet.hosts))
    except BaseException:
        fleet.teardown()
        raise
    return fleet


def start_on_stores(n: int, workdir: Path | str, stores: Sequence[str] | None,
                    on_remade: Callable[[str], None] | None = None) -> Fleet:
    """start_fleet with each host's engine store on the kept volume of ``stores`` (None: fresh ones),
    every container in them removed. A store whose engine does not start, or whose containers cannot be
    removed (a run killed half-way through a pull, say), is removed and made again, ``on_remade`` told
    why: one bad run must not fail every run after it."""
    if stores is None:
        return start_fleet(n, workdir)
    try:
        fleet = start_fleet(n, workdir, docker_stores=stores)
        try:
            for h in fleet.hosts:
                fleet.clear_engine(h, keep=None)
        except FleetError:
            fleet.teardown()
            raise
        return fleet
    except FleetError as e:
        if on_remade is not None:
            on_remade(f"the kept engine stores are made again: {e}")
        docker("volume", "rm", "-f", *stores, check=False, timeout=600)
        return start_fleet(n, workdir, docker_stores=stores)


def _ssh_block(h: Host, fleet: Fleet, control: bool = True) -> str:
    mux = (
        "  ControlMaster auto\n"
        f"  ControlPath {fleet.control_dir}/%C\n"
        "  ControlPersist 60\n"
    ) if control else ""
    return (
        f"Host {h.name} {h.ip}\n"
        f"  HostName {h.ip}\n"
        f"  Port {h.port}\n"
        f"  User {h.user}\n"
        f"  IdentityFile {fleet.identity}\n"
        "  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {fleet.known_hosts}\n"
        "  GlobalKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking yes\n"
        "  CheckHostIP no\n"
        "  BatchMode yes\n"
        f"{mux}"
        f"  ConnectTimeout {CONNECT_TIMEOUT}\n"
        "  ServerAliveInterval 2\n"
        "  ServerAliveCountMax 3\n"
        "  LogLevel ERROR\n\n"
    )


def fleet_fixture(request: Any, n: int, *, skip_if_unavailable: bool = False, **kwargs: Any) -> Fleet:
    """For a pytest fixture: start n hosts in a fresh tmp dir and tear them down when the fixture's scope
    ends. ``request`` is the fixture's pytest request (any scope). With ``skip_if_unavailable`` the test
    is skipped (not failed) when Docker or the test host image is missing."""
    if skip_if_unavailable:
        if not docker_available():
            pytest.skip("Docker Engine not reachable")
        if not image_exists(testhost_tag()):
            pytest.skip(f"{testhost_tag()} missing: run tests/fleet/build-testhost.sh")
        kwargs.setdefault("build", False)
    workdir = request.getfixturevalue("tmp_path_factory").mktemp("fleet")
    fleet = start_fleet(n, workdir, **kwargs)
    request.addfinalizer(fleet.teardown)
    return fleet
