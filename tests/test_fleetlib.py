"""Tests of the test infrastructure, only where it stands in for something real and must follow its protocol:
the script that builds the test host image reads apt's own source formats, and the fleet's hosts (real sshd,
per-host Docker) must look to ssh and docker as real hosts do, and fail as they do (a cut cable times out, a
stopped sshd refuses, loss and delay reach ssh): the faults the product's fleet tests inject."""

from __future__ import annotations

import secrets
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.lib import fleetlib

# ------------------------------------------------------------------------------------------ unit tier


def _print_mirror(tmp_path: Path, env: dict[str, str] | None = None) -> str:
    """build-testhost.sh's mirror with apt's sources at tmp_path (through APT_CONFIG, as apt-get reads it)."""
    conf = tmp_path / "apt.conf"
    conf.write_text(
        f'Dir::Etc::sourcelist "{tmp_path}/sources.list";\nDir::Etc::sourceparts "{tmp_path}/parts";\n'
    )
    (tmp_path / "parts").mkdir(exist_ok=True)
    full = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "APT_CONFIG": str(conf), **(env or {})}
    proc = subprocess.run(
        ["bash", str(fleetlib.FLEET_DIR / "build-testhost.sh"), "--print-mirror"],
        capture_output=True, text=True, env=full, timeout=30, check=True,
    )
    return proc.stdout.strip()


def test_build_testhost_mirror_comes_from_apt_sources(tmp_path: Path) -> None:
    # nothing configured: Debian's own mirror
    assert _print_mirror(tmp_path) == "http://deb.debian.org/debian"
    # deb822: the first enabled deb entry of bookworm main; continuation lines and other suites ignored
    (tmp_path / "parts" / "00-off.sources").write_text(
        "Enabled: no\nTypes: deb\nURIs: http://off.example/debian\nSuites: bookworm\nComponents: main\n"
    )
    (tmp_path / "parts" / "10-debian.sources").write_text(
        "# comment\nTypes: deb-src\nURIs: http://src.example/debian\nSuites: bookworm\nComponents: main\n\n"
        "Types: deb\nURIs: http://sec.example/debian-security\nSuites: bookworm-security\nComponents: main\n\n"
        "Types: deb\nURIs:\n http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: contrib main\nSigned-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n xyz\n"
    )
    assert _print_mirror(tmp_path) == "http://mirror.example/debian"
    # the one-line sources.list comes first in apt's order; options in brackets are skipped
    (tmp_path / "sources.list").write_text(
        "deb http://other.example/debian bookworm-updates main\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] https://line.example/debian bookworm main\n"
    )
    assert _print_mirror(tmp_path) == "https://line.example/debian"
    # BUILDER_TEST_MIRROR still wins
    assert _print_mirror(tmp_path, {"BUILDER_TEST_MIRROR": "http://override.example/d"}) == (
        "http://override.example/d"
    )


# ------------------------------------------------------------------------------------------ fleet tier


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> fleetlib.Fleet:
    return fleetlib.fleet_fixture(request, 2)


@pytest.fixture(scope="module")
def tiny_tar(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    image_id = fleetlib.tiny_image(
        "builder-test-tiny:1", files={"/www/index.html": b"hello from the fleet\n"}
    )
    return image_id, fleetlib.save_image("builder-test-tiny:1", tmp_path_factory.mktemp("img") / "tiny.tar")


@pytest.mark.docker
@pytest.mark.fleet
def test_ssh_with_strict_host_key_checking(fleet: fleetlib.Fleet) -> None:
    for host in fleet:
        proc = fleet.ssh(host, "id -un; hostname", check=True)
        assert proc.stdout.split() == ["spark", host.name]
        root = fleet.ssh(host, "id -u", options=["User=root"], check=True)
        assert root.stdout.strip() == "0"
    assert "StrictHostKeyChecking yes" in fleet.ssh_config.read_text()
    assert fleet.inventory(0)["ssh"] == f"spark@{fleet.hosts[0].ip}:22"


@pytest.mark.docker
@pytest.mark.fleet
def test_wrong_or_missing_known_hosts_entry_is_refused(fleet: fleetlib.Fleet, tmp_path: Path) -> None:
    h1, h2 = fleet.hosts
    lines = fleet.known_hosts.read_text().splitlines()
    key2 = lines[1].split(" ", 1)[1]
    wrong = tmp_path / "known_hosts.wrong"
    wrong.write_text(f"{h1.name},{h1.ip} {key2}\n")  # host 1 listed with host 2's key
    missing = tmp_path / "known_hosts.missing"
    missing.write_text(lines[1] + "\n")  # only host 2
    for path, says in (
        (wrong, "REMOTE HOST IDENTIFICATION HAS CHANGED"),
        (missing, "Host key verification failed"),
    ):
        proc = fleet.ssh(
            h1, "true", options=[f"UserKnownHostsFile={path}", "ControlPath=none", "LogLevel=INFO"]
        )
        assert proc.returncode == 255
        assert says in proc.stderr
    assert fleet.ssh(h1, "true", options=["ControlPath=none"]).returncode == 0


@pytest.mark.docker
@pytest.mark.fleet
def test_images_are_per_host_and_served_at_the_host_ip(
    fleet: fleetlib.Fleet, tiny_tar: tuple[str, Path]
) -> None:
    image_id, tarball = tiny_tar
    h1, h2 = fleet.hosts
    fleet.docker_load(h1, tarball)
    assert image_id in fleet.images(h1)
    assert image_id not in fleet.images(h2)
    fleet.exec(
        h1,
        "docker rm -f web >/dev/null 2>&1; docker run -d --name web --network host "
        "builder-test-tiny:1 httpd -f -p 8080 -h /www",
    )
    try:
        body = b""
        for _ in range(50):
            try:
                with urllib.request.urlopen(f"http://{h1.ip}:8080/index.html", timeout=5) as r:
                    body = r.read()
                break
            except (urllib.error.URLError, ConnectionError):
                fleet.exec(h1, "sleep 0.1")
        assert body == b"hello from the fleet\n"
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://{h2.ip}:8080/index.html", timeout=5)
    finally:
        fleet.exec(h1, "docker rm -f web", check=False)


@pytest.mark.docker
@pytest.mark.fleet
def test_cut_makes_ssh_time_out_and_restore_brings_it_back(fleet: fleetlib.Fleet) -> None:
    h1, h2 = fleet.hosts
    fleet.cut(h1)
    try:
        proc = fleet.ssh(h1, "true", timeout=60)
        assert proc.returncode == 255
        assert "timed out" in proc.stderr
        assert fleet.ssh(h2, "true").returncode == 0  # the rest of the fleet is untouched
    finally:
        fleet.restore(h1)
    proc = fleet.ssh(h1, "hostname -I")
    assert proc.returncode == 0
    assert proc.stdout.split()[0] == h1.ip


@pytest.mark.docker
@pytest.mark.fleet
def test_stop_sshd_refuses_and_start_sshd_recovers(fleet: fleetlib.Fleet) -> None:
    h2 = fleet.hosts[1]
    fleet.stop_sshd(h2)
    try:
        proc = fleet.ssh(h2, "true")
        assert proc.returncode == 255
        assert "Connection refused" in proc.stderr
    finally:
        fleet.start_sshd(h2)
    assert fleet.ssh(h2, "id -un", check=True).stdout.strip() == "spark"


@pytest.mark.docker
@pytest.mark.fleet
def test_netem_loss_and_delay(fleet: fleetlib.Fleet) -> None:
    h1 = fleet.hosts[0]
    try:
        fleet.netem(h1, delay_ms=0, loss_pct=100)
        proc = fleet.ssh(h1, "true", options=["ControlPath=none"], timeout=60)
        assert proc.returncode == 255 and "timed out" in proc.stderr
        mechanism = fleet.netem(h1, delay_ms=50, loss_pct=0)
        assert fleet.ssh(h1, "true", options=["ControlPath=none"]).returncode == 0
        if mechanism == "nfqueue":  # packets really went through the delayer's queue
            # queue, portid, queued, copy mode, copy range, queue dropped, user dropped, last packet id, 1
            fields = fleet.exec(h1, "cat /proc/net/netfilter/nfnetlink_queue").stdout.split()
            assert fields[0] == str(fleetlib.NFQUEUE_NUM) and int(fields[7]) > 0
    finally:
        fleet.clear_netem(h1)
    assert fleet.ssh(h1, "true", options=["ControlPath=none"]).returncode == 0


@pytest.mark.docker
@pytest.mark.fleet
def test_teardown_removes_everything(tmp_path: Path) -> None:
    fl = fleetlib.start_fleet(1, tmp_path, dockerd=False)
    network, cid = fl.network, fl.hosts[0].container
    assert fl.ssh(0, "true").returncode == 0
    fl.teardown()
    fl.teardown()  # idempotent
    assert fleetlib.docker("inspect", cid, check=False).returncode != 0
    assert fleetlib.docker("network", "inspect", network, check=False).returncode != 0


@pytest.mark.docker
@pytest.mark.fleet
def test_a_kept_store_outlives_its_host_with_what_clear_engine_kept(
    tmp_path: Path, tiny_tar: tuple[str, Path]
) -> None:
    """A host's engine store on a named volume (docker_stores): clear_engine leaves the kept image and
    no container, stop_engine ends the engine, and the next host on that volume finds exactly that."""
    image_id, tarball = tiny_tar
    volume = f"builder-test-store-{secrets.token_hex(4)}"
    try:
        fl = fleetlib.start_fleet(1, tmp_path / "first", docker_stores=[volume])
        try:
            fl.docker_load(0, tarball)
            fl.exec(0, "docker run --name made builder-test-tiny:1 true && docker commit made other:1 >/dev/null")
            fl.exec(0, "docker run -d --name web --network host builder-test-tiny:1 httpd -f -p 8081 -h /www")
            assert len(fl.images(0)) == 2
            fl.clear_engine(0, keep=[image_id])
            assert fl.images(0) == {image_id}
            assert fl.exec(0, "docker ps -aq").stdout.split() == []
            fl.stop_engine(0)
            assert fl.exec(0, "pgrep -x dockerd", check=False).returncode == 1
        finally:
            fl.teardown()
        assert fleetlib.docker("volume", "inspect", volume, check=False).returncode == 0
        fl = fleetlib.start_fleet(1, tmp_path / "second", docker_stores=[volume])
        try:
            assert fl.images(0) == {image_id}
            assert fl.exec(0, "docker ps -aq").stdout.split() == []
        finally:
            fl.teardown()
    finally:
        fleetlib.docker("volume", "rm", "-f", volume, check=False)


@pytest.mark.docker
@pytest.mark.fleet
def test_a_kept_store_whose_engine_cannot_start_is_made_again(tmp_path: Path) -> None:
    """A kept store left broken (its engine's containers folder a file: dockerd ends at start) fails the
    first start at once, naming the engine's end; start_on_stores then makes the store again, says so,
    and the host's engine serves."""
    volume = f"builder-test-store-{secrets.token_hex(4)}"
    try:
        fl = fleetlib.start_fleet(1, tmp_path / "first", docker_stores=[volume])
        try:
            fl.stop_engine(0)
            fl.exec(0, "rm -rf /var/lib/docker/containers && echo broken > /var/lib/docker/containers")
        finally:
            fl.teardown()
        with pytest.raises(fleetlib.FleetError, match="inner dockerd ended"):
            fleetlib.start_fleet(1, tmp_path / "broken", docker_stores=[volume])
        said: list[str] = []
        fl = fleetlib.start_on_stores(1, tmp_path / "second", [volume], on_remade=said.append)
        try:
            assert fl.exec(0, "docker info --format '{{.Containers}}'").stdout.strip() == "0"
            assert len(said) == 1 and "made again" in said[0] and "inner dockerd ended" in said[0], said
        finally:
            fl.teardown()
    finally:
        fleetlib.docker("volume", "rm", "-f", volume, check=False)
