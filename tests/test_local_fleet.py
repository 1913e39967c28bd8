"""`python3 -m tests.fleet.local up` and `down` (tests/fleet/local.py), typed as the README's tour types
them, in a copy of the project: the fleet file builder reads, real ssh to every host as its user, the
tour's `builder deploy --fleet local` of the demo lane, and nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder.inputs.hosts import fleet_trusted_key, load_fleet, ssh_config_file
from tests.fleet import local
from tests.lib import fleetlib, journeylib


def _run(root: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.fleet.local", *args], cwd=root, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(root), "NO_COLOR": "1"})


def _builder(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([journeylib.BUILDER, *args], cwd=root, capture_output=True, text=True, timeout=600,
                       env=journeylib.builder_env(root.parent / "work"))
    assert p.returncode == 0, f"builder {' '.join(args)}: exit {p.returncode}: {p.stderr[-3000:]}"
    return p


@pytest.mark.parametrize(("args", "says"), [
    (["--lane", "no-such-lane"], "--lane 'no-such-lane': no such lane in "),
    (["--hosts", "0"], "--hosts 0: between 1 and 16"),
    (["--hosts", "3"], "--hosts 3: lane 'demo' runs 2 ranks (serve.tensor_parallel), one a host"),
    (["--name", "Local"], "--name 'Local': a fleet name is lowercase"),
    (["--lane", "vllm-mia-tp2"], "--lane 'vllm-mia-tp2': its image 'vllm-mia' does not run on the test hosts"),
])
def test_up_refuses_bad_input_in_one_line_and_writes_nothing(tmp_path: Path, args: list[str], says: str) -> None:
    root = journeylib.project_copy(tmp_path / "project")
    p = _run(root, "up", *args)
    assert p.returncode == 1 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    assert p.stderr.startswith(f"tests.fleet.local: {says}") and p.stderr.count("\n") == 1, p.stderr
    assert not (root / "hosts" / "local.toml").exists() and not (root / ".cache").exists()


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_up_gives_a_fleet_the_tour_deploys_onto_and_down_removes_all_of_it(tmp_path: Path) -> None:
    if not fleetlib.docker_available():
        pytest.fail("Docker Engine not reachable: the local fleet needs it")
    root = journeylib.project_copy(tmp_path / "project").resolve()
    path = root / "hosts" / "local.toml"
    up = _run(root, "up", "--lane", "demo-tp3")
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout == f"{path}\n"
        assert "builder deploy --fleet local --key keys/builder.key" in up.stderr
        fleet = load_fleet(path)
        assert (fleet.fleet.name, fleet.fleet.lane) == ("local", "demo-tp3")
        assert [(h.name, h.rank, h.role) for h in fleet.by_rank()] == [
            ("spark-1", 0, "head"), ("spark-2", 1, "worker"), ("spark-3", 2, "worker")]
        # the key the tour's `builder keygen --out keys` writes
        assert fleet_trusted_key(path, fleet) == root / "keys" / "builder.pub"
        cfg = ssh_config_file(path, fleet.fleet.ssh_config)
        assert cfg is not None and cfg.is_relative_to(root / ".cache" / "local-fleet" / "local")
        # ignored by git: a fresh clone's `git status` stays clean
        ignored = subprocess.run(["git", "check-ignore", str(path.relative_to(root)), str(cfg.relative_to(root))],
                                 cwd=journeylib.ROOT, capture_output=True, text=True)
        assert ignored.returncode == 0 and len(ignored.stdout.splitlines()) == 2, ignored.stdout

        listed = _builder(root, "hosts", "--fleet", "local", "--json")
        assert [r["name"] for r in json.loads(listed.stdout)] == ["spark-1", "spark-2", "spark-3"]
        for h in fleet.hosts:
            r = subprocess.run(["ssh", "-F", str(cfg), h.name, "id -un; stat -c %U /var/lib/builder /srv/models "
                                "/srv/engram; docker info -f '{{.ServerVersion}}'; hostname -i"],
                               capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            assert r.returncode == 0, (h.name, r.stderr)
            lines = r.stdout.split()
            assert lines[:4] == ["spark"] * 4, (h.name, lines)  # its user, owning the folders builder installs into
            assert lines[5] == h.address, (h.name, lines)  # its own dockerd answered; the address is its IP

        # the tour, as the README types it
        for step in (["lock", "--offline", "demo-tp3"], ["fetch", "--offline", "demo-tp3"],
                     ["image", "demo", "--offline"], ["keygen", "--out", "keys"]):
            _builder(root, *step)
        deploy = _builder(root, "deploy", "--fleet", "local", "--key", "keys/builder.key", "--with-image",
                          "--with-models", "--json")
        assert json.loads(deploy.stdout)["result"] == "deployed", deploy.stdout[-2000:]
        status = json.loads(_builder(root, "status", "--fleet", "local", "--json").stdout)
        assert status["exit"] == 0 and [(h, s["up"], s["on_lock"]) for h, s in sorted(status["hosts"].items())] == [
            ("spark-1", True, True), ("spark-2", True, True), ("spark-3", True, True)], status

        # the hosts outlive `up`'s process, and are not a killed test's left-overs
        fleetlib.reap_stale()
        containers, networks = local.running(root, "local")
        assert len(containers) == 3 and len(networks) == 1

        again = _run(root, "up")
        assert again.returncode == 1 and "local fleet 'local' is up (3 containers)" in again.stderr, again.stderr
        assert again.stderr.count("\n") == 1
    finally:
        down = _run(root, "down")
    assert down.returncode == 0, down.stderr
    assert down.stderr.startswith("removed: 3 container(s), network "), down.stderr
    assert local.running(root, "local") == ([], [])
    assert not path.exists() and not (root / ".cache" / "local-fleet" / "local").exists()
    again = _run(root, "down")
    assert again.returncode == 0 and again.stderr == "local fleet 'local': nothing to remove\n", again.stderr


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_up_simulate_gives_a_seed_lane_in_a_copy_the_tour_deploys_and_down_removes_it(tmp_path: Path) -> None:
    if not fleetlib.docker_available():
        pytest.fail("Docker Engine not reachable: the local fleet needs it")
    root = journeylib.project_copy(tmp_path / "project").resolve()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)  # (a clone: --simulate copies what git holds)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    shipped = sorted(p.name for p in (root / "hosts").iterdir())
    pins = (root / "pins.toml").read_bytes()
    up = _run(root, "up", "--lane", "tensorfold-tp2", "--simulate")
    project = root / ".cache" / "local-fleet" / "local" / "project"
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout == f"{project / 'hosts' / 'local.toml'}\n"
        assert "cd .cache/local-fleet/local/project" in up.stderr, up.stderr
        # the operator's project is untouched: the fleet file and the simulator's pins are in the copy
        assert sorted(p.name for p in (root / "hosts").iterdir()) == shipped
        assert (root / "pins.toml").read_bytes() == pins
        assert b"images/sim" in (project / "pins.toml").read_bytes()
        fleet = load_fleet(project / "hosts" / "local.toml")
        assert fleet.fleet.lane == "tensorfold-tp2" and len(fleet.hosts) == 2
        for step in (["lock", "--offline", "tensorfold-tp2"], ["fetch", "--offline", "tensorfold-tp2"],
                     ["image", "tensorfold-tp2", "--offline"], ["keygen", "--out", "keys"]):
            _builder(project, *step)
        deploy = _builder(project, "deploy", "--fleet", "local", "--key", "keys/builder.key", "--with-image",
                          "--with-models", "--json")
        assert json.loads(deploy.stdout)["result"] == "deployed", deploy.stdout[-2000:]
        status = json.loads(_builder(project, "status", "--fleet", "local", "--json").stdout)
        assert status["exit"] == 0 and all(s["up"] and s["on_lock"] for s in status["hosts"].values()), status
    finally:
        down = _run(root, "down")
    assert down.returncode == 0, down.stderr
    assert local.running(root, "local") == ([], []) and not (root / ".cache" / "local-fleet" / "local").exists()
    assert sorted(p.name for p in (root / "hosts").iterdir()) == shipped
