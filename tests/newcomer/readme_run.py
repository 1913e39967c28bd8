"""The README's newcomer path, run verbatim in a clean Debian 12 container.

    python3 -m tests.newcomer.readme_run [--keep]

What it does, in order:

1. The clean machine: a minimal Debian bookworm rootfs (``debootstrap --variant=minbase``, what a stock
   Debian image holds, its apt lists emptied as a stock image ships them), made into the local image
   ``builder-newcomer-debian:<key>`` with ``docker import``: no registry pulls. The mirror is the one this
   machine's apt uses (``tests/fleet/build-testhost.sh --print-mirror``); the rootfs tarball is cached
   in ``$BUILDER_TEST_CACHE`` (default /var/cache/builder-test) as the test host's is, and the image is
   kept, keyed by suite, variant and mirror.
2. A fresh clone: ``git clone`` of this project's committed HEAD into a tmp folder, copied into the
   container as ``/home/newcomer/builder``, owned by the user ``newcomer``.
3. The README's code blocks, read from README.md here (so the run stays true to it): every ``sh`` block of
   "Set-up and the two commands", then the "Without Sparks" tour block. Each line is one command, run in
   the clone with ``bash -e -o pipefail -c`` in its own ``docker exec`` (a new shell each: a line after
   command 1 gets ``. .venv/bin/activate`` first, as the README says every command runs with it active).

Who runs what. The set-up block's lines start with ``sudo``: a stock Debian image has no sudo and its
user is root, so they run as root with the leading ``sudo`` dropped and ``USER=newcomer`` (the user who
would have typed them). Everything after runs as ``newcomer``, a fresh ``docker exec`` each time (the
README's "log in again": the docker group then counts). The prose's ``sudo tests/fleet/build-testhost.sh``
runs as root the same way before the tour (it finds the test host image on the shared engine and exits).

Command 2 (``python3 -m pytest -n 4 --dist loadfile``, the whole suite) is left out: it collects the test that
runs this module, so inside it would start this run again; CI runs it (``.ci/run``).

What the container is given, the machine's part of "a Docker Engine that your user may use" and of the
package index:

* this machine's Docker Engine: its socket bind-mounted at /var/run/docker.sock, and a ``docker`` group
  made before the set-up with the socket's group id (the README's apt line then adds ``docker.io``'s
  CLI, and its ``usermod -aG docker`` grants the socket);
* the capabilities the engine gives (``--cap-add ALL`` less those this machine lacks, as the test
  hosts get): tests/lib/fleetlib.py gives its hosts what its own process may hold;
* ``--network host``: pip and apt reach the index as this machine does, and the tour's test hosts,
  which ``up`` starts as sibling containers on a private bridge network addressed by IP, are reachable
  from the host's network namespace exactly as from this machine;
* the ``PIP_*`` settings of this environment and ``/etc/pip.conf``, with a CA file they name copied in.

At the end the tour's ``down`` line always runs (also after a failure), and the container is removed
(``--keep`` keeps it). ``builder status --fleet local`` must report every rank up. Prints one line per
command with its exit code and seconds on stderr; exit 0 when all passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from builder.foundation import dockerbuild
from tests.lib import fleetlib

ROOT = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
VARIANT = "minbase"
IMAGE_REPO = "builder-newcomer-debian"
USER = "newcomer"
HOME = f"/home/{USER}"
CLONE = f"{HOME}/builder"
SETUP_SECTION = "## Set-up and the two commands"
TOUR_MARK = "**Without Sparks**"
#: the README's test command: it collects this run's own test, so it is not run inside (docstring)
SUITE_COMMAND = "python3 -m pytest -n 4 --dist loadfile"
LABEL = "builder-test.newcomer=1"


class RunError(Exception):
    """One line for the user; exit 1."""


# ------------------------------------------------------------------------------------------ the README


def _blocks(text: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S)


def section(readme: str, heading: str) -> str:
    if heading not in readme:
        raise RunError(f"README.md: no section {heading!r}")
    rest = readme.split(heading, 1)[1]
    return re.split(r"^## ", rest, maxsplit=1, flags=re.M)[0]


def commands(block: str) -> list[str]:
    """A block's commands: one a line, comments and blank lines dropped (the shell drops them too)."""
    out = []
    for line in block.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.rstrip())
    return out


@dataclass
class Plan:
    setup: list[str]  # run as root, sudo dropped
    commands: list[str]  # the section's other blocks, as the user
    tour: list[str]  # the "Without Sparks" block, as the user
    build_testhost: str  # the prose's test host image build, as root


def plan(readme: str) -> Plan:
    """The commands of README.md's set-up section and its local-fleet tour, in order."""
    blocks = _blocks(section(readme, SETUP_SECTION))
    if len(blocks) < 2:
        raise RunError(f"README.md: {SETUP_SECTION!r} has {len(blocks)} sh blocks, expected the set-up and command 1")
    setup = commands(blocks[0])
    if not setup or not all(c.startswith("sudo ") for c in setup):
        raise RunError("README.md: the set-up block's lines are expected to start with `sudo `")
    rest = [c for b in blocks[1:] for c in commands(b) if c != SUITE_COMMAND]
    tour_text = section(readme, "## The operator's journey")
    if TOUR_MARK not in tour_text:
        raise RunError(f"README.md: no {TOUR_MARK} tour")
    after = tour_text.split(TOUR_MARK, 1)[1]
    m = re.search(r"`(sudo tests/fleet/build-testhost\.sh)`", after)
    tour_blocks = _blocks(after)
    if m is None or not tour_blocks:
        raise RunError("README.md: the Without Sparks tour lacks its build-testhost.sh line or its sh block")
    tour = commands(tour_blocks[0])
    if not tour or "tests.fleet.local down" not in tour[-1] or "tests.fleet.local up" not in tour[0]:
        raise RunError("README.md: the tour block is expected to start with `up` and end with `down`")
    return Plan(setup=setup, commands=rest, tour=tour, build_testhost=m.group(1))


def drop_sudo(command: str) -> str:
    """`sudo X && sudo Y` -> `X && Y`: each command of a line that starts with sudo, run by root."""
    return re.sub(r"(^|&&\s*|;\s*|\|\|\s*)sudo\s+", r"\1", command)


# ----------------------------------------------------------------------------------------- the machine


def docker(*args: str, check: bool = True, timeout: float = 600, input: bytes | None = None,
           capture: bool = True) -> subprocess.CompletedProcess[bytes]:
    try:
        proc = subprocess.run(["docker", *args], input=input, capture_output=capture, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RunError(f"docker {' '.join(args[:2])}: timed out after {timeout:.0f}s") from None
    if check and proc.returncode != 0:
        err = (proc.stderr or b"").decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise RunError(f"docker {' '.join(args[:2])}: {err[0]}")
    return proc


def log(msg: str) -> None:
    print(f"readme_run: {msg}", file=sys.stderr, flush=True)


def mirror() -> str:
    """The Debian mirror this machine's apt uses (build-testhost.sh's rule, one place)."""
    proc = subprocess.run([str(ROOT / "tests" / "fleet" / "build-testhost.sh"), "--print-mirror"],
                          capture_output=True, text=True, check=True)
    return proc.stdout.strip()


def debian_image() -> str:
    """The clean Debian image's tag, made when missing (root: debootstrap)."""
    url = mirror()
    key = hashlib.sha256(f"{SUITE}\n{VARIANT}\n{url}\n".encode()).hexdigest()[:16]
    tag = f"{IMAGE_REPO}:{key}"
    if docker("image", "inspect", tag, check=False).returncode == 0:
        return tag
    cache = Path(os.environ.get("BUILDER_TEST_CACHE", "/var/cache/builder-test"))
    cache.mkdir(parents=True, exist_ok=True)
    tar = cache / f"rootfs-{SUITE}-{VARIANT}-{key}.tar"
    if not tar.is_file() or tar.stat().st_size == 0:
        if shutil.which("debootstrap") is None:
            raise RunError("debootstrap not found (apt-get install debootstrap)")
        if os.geteuid() != 0:
            raise RunError("making the Debian rootfs needs root (debootstrap, chroot)")
        with tempfile.TemporaryDirectory(prefix="builder-newcomer-") as work:
            root = Path(work) / "root"
            log(f"debootstrap --variant={VARIANT} {SUITE} from {url} (a few minutes)")
            proc = subprocess.run(["debootstrap", f"--variant={VARIANT}", SUITE, str(root), url],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                tail = proc.stdout.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
                raise RunError(f"debootstrap failed: {tail[0]}")
            # as a stock Debian image ships: no package lists, no downloaded .debs
            for sub in ("var/lib/apt/lists", "var/cache/apt/archives"):
                for p in (root / sub).glob("*"):
                    if p.is_file():
                        p.unlink()
            subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", f"{tar}.tmp", "."], check=True)
            os.replace(f"{tar}.tmp", tar)
    log(f"importing {tag}")
    with open(tar, "rb") as f:
        imported = subprocess.run(["docker", "import", "--change", 'CMD ["sleep", "infinity"]',
                                   "--change", "LABEL builder-test.newcomer-image=1", "-", tag],
                                  stdin=f, capture_output=True)
    if imported.returncode != 0:
        raise RunError(f"docker import: {imported.stderr.decode(errors='replace').strip()}")
    return tag


def pip_env() -> tuple[dict[str, str], Path | None]:
    """The PIP_* settings of this environment, and the CA file they (or /etc/pip.conf) name, if any."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    ca = env.get("PIP_CERT")
    conf = Path("/etc/pip.conf")
    if ca is None and conf.is_file():
        m = re.search(r"^\s*cert\s*=\s*(\S+)", conf.read_text(), re.M)
        ca = m.group(1) if m else None
    return env, (Path(ca) if ca and Path(ca).is_file() else None)


CA_IN = "/usr/local/share/newcomer-pip-ca.crt"


@dataclass
class Step:
    command: str
    user: str
    rc: int
    seconds: float
    stdout: str = ""


@dataclass
class Run:
    container: str
    env: dict[str, str]
    steps: list[Step] = field(default_factory=list)

    def exec(self, command: str, user: str, timeout: float = 1800) -> Step:
        """One README line in a new shell in the clone; output streams to stderr, stdout is kept."""
        env = [f"--env={k}={v}" for k, v in {**self.env, "USER": USER, "HOME": HOME if user != "root"
                                             else "/root", "LOGNAME": user}.items()]
        argv = ["docker", "exec", "-u", user, "-w", CLONE, *env, self.container,
                "bash", "-e", "-o", "pipefail", "-c", command]
        log(f"[{user}] $ {command}")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=None, timeout=timeout)
            rc, out = proc.returncode, proc.stdout.decode(errors="replace")
        except subprocess.TimeoutExpired:
            rc, out = 124, ""
        step = Step(command, user, rc, time.monotonic() - t0, out)
        if out:
            sys.stderr.write(out)
        log(f"[{user}] exit {rc} in {step.seconds:.0f}s: {command}")
        self.steps.append(step)
        return step


def start(image: str, clone: Path) -> Run:
    sock = Path("/var/run/docker.sock")
    gid = sock.stat().st_gid
    env, ca = pip_env()
    if ca is not None:
        env["PIP_CERT"] = CA_IN
    name = f"builder-newcomer-{os.getpid()}"
    # the capabilities the engine gives (what the test hosts get): fleetlib derives its hosts' set from
    # its own process's bounding set, so the runner's must be the engine's, not a default container's
    caps = ["--cap-add", "ALL", *[a for c in fleetlib._cap_drops() for a in ("--cap-drop", c)]]
    # and the folder of the engine's build turns (dockerbuild.TURN_DIR): the README's builds take their
    # turns with this machine's others, on the same engine
    turns = dockerbuild.turn_dir()
    docker("run", "-d", "--name", name, "--label", LABEL, "--network", "host", *caps,
           "-v", f"{sock}:/var/run/docker.sock", "-v", f"{turns}:{turns}", image)
    run = Run(name, env)

    def root(cmd: str) -> None:
        docker("exec", name, "sh", "-c", cmd)

    # the machine, before the README: a user, and a docker group whose id is the socket's
    root(f"groupadd --system --gid {gid} docker && useradd -m -s /bin/bash {USER}")
    if ca is not None:
        docker("cp", str(ca), f"{name}:{CA_IN}")
    pipconf = Path("/etc/pip.conf")
    if pipconf.is_file():
        text = pipconf.read_text()
        if ca is not None:
            text = re.sub(r"^(\s*cert\s*=\s*)\S+", rf"\g<1>{CA_IN}", text, flags=re.M)
        docker("exec", "-i", name, "sh", "-c", "cat > /etc/pip.conf", input=text.encode())
    tar = subprocess.run(["tar", "-C", str(clone), "-cf", "-", "."], capture_output=True, check=True).stdout
    docker("exec", "-i", name, "sh", "-c", f"mkdir -p {CLONE} && tar -C {CLONE} -xf - && chown -R {USER}: {CLONE}",
           input=tar)
    return run


def clone_head(dest: Path) -> Path:
    """A fresh clone of this project's committed HEAD."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", "--detach", head], check=True)
    return dest


def ranks_down(status: str, hosts: int = 2) -> list[str]:
    """What `builder status`'s table (stdout) says against every rank up: a host row whose `up` column is
    not `yes`, or fewer host rows than the tour's hosts. Empty when all is well (its exit 0 says the same)."""
    rows = [ln for ln in status.splitlines() if re.search(r"\bspark-\d+\b", ln)]
    if len(rows) < hosts:
        return [f"{len(rows)} host rows in the status table, expected {hosts}"]
    return [r.strip() for r in rows if not re.search(r"\byes\b", r)]


def run_readme(keep: bool = False) -> list[Step]:
    """The whole run; raises RunError on the first failing command (after the tour's `down`)."""
    p = plan((ROOT / "README.md").read_text())
    image = debian_image()
    with tempfile.TemporaryDirectory(prefix="builder-newcomer-") as tmp:
        clone = clone_head(Path(tmp) / "builder")
        run = start(image, clone)
        try:
            return _steps(run, p)
        finally:
            if not keep:
                docker("rm", "-f", run.container, check=False)
            else:
                log(f"kept container {run.container}")


def _check(step: Step) -> None:
    if step.rc != 0:
        raise RunError(f"exit {step.rc}: {step.command}")


ACTIVATE = ". .venv/bin/activate && "


def _steps(run: Run, p: Plan) -> list[Step]:
    for c in p.setup:
        _check(run.exec(drop_sudo(c), "root"))
    for c in p.commands:
        _check(run.exec(c if c.startswith("python3 -m venv") else ACTIVATE + c, USER))
    _check(run.exec(drop_sudo(p.build_testhost), "root"))
    try:
        for c in p.tour:
            step = run.exec(ACTIVATE + c, USER)
            _check(step)
            if c.startswith("builder status"):
                bad = ranks_down(step.stdout)
                if bad:
                    raise RunError(f"{c}: not every rank up: {'; '.join(bad)}")
    finally:
        if not run.steps[-1].command.endswith(p.tour[-1]):
            run.exec(ACTIVATE + p.tour[-1], USER)
    return run.steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.newcomer.readme_run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the container at the end")
    ap.add_argument("--image-only", action="store_true", help="make the clean Debian image and print its tag")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        if a.image_only:
            print(debian_image())
            return 0
        steps = run_readme(a.keep)
    except (RunError, OSError, subprocess.SubprocessError) as e:
        print(f"readme_run: {e}", file=sys.stderr)
        return 1
    for s in steps:
        log(f"ok {s.seconds:6.0f}s [{s.user}] {s.command}")
    log(f"all {len(steps)} commands passed in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
