"""builder ship: sneakernet copies (resumable), and the real thing on the test fleet (marker `fleet`)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from builder.bundle import hostpkg
from builder.foundation.ssh import parse_target
from builder.store.placement import kept_installer
from tests.lib import bundlelib as bl
from tests.lib import fleetlib

# --------------------------------------------------------------------------- fast tier


def test_parse_target() -> None:
    assert parse_target("spark@192.0.2.1:2222") == ("spark", "192.0.2.1", 2222)
    assert parse_target("192.0.2.1") == (None, "192.0.2.1", None)
    assert parse_target("root@[2001:db8::1]:22") == ("root", "2001:db8::1", 22)
    assert parse_target("alias") == (None, "alias", None)


def _ship_to(p: bl.Project, dest: Path) -> dict[str, Any]:
    r = p.cli("ship", "spark-b", "--to", str(dest), "--key", str(p.pub), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_sneakernet_copy_resumes_and_verifies(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    assert (
        p.cli("bundle", "spark-b", "--with-models", "--part-size", "5000", "--key", str(p.key)).returncode
        == 0
    )
    usb = tmp_path / "usb"
    first = _ship_to(p, usb)
    dest = usb / bl.FLEET / "spark-b"
    assert first["dest"] == str(dest) and not first["skipped"]
    assert bl.tree_bytes(dest) == bl.tree_bytes(p.out("spark-b"))
    # a cut copy: one part short, one missing, a model file short, one stray file
    part = dest / "parts/install.pyz.part0001"
    part.write_bytes(part.read_bytes()[:100])
    (dest / "parts/install.pyz.part0003").unlink()
    weights = dest / "models/demo-model/weights-r1of2.bin"
    weights.write_bytes(weights.read_bytes()[:100])
    (dest / "stray").write_text("x")
    again = _ship_to(p, usb)
    assert sorted(again["sent"]) == [
        "models/demo-model/weights-r1of2.bin",
        "parts/install.pyz.part0001",
        "parts/install.pyz.part0003",
    ]
    assert again["removed"] == ["stray"]
    assert bl.tree_bytes(dest) == bl.tree_bytes(p.out("spark-b"))
    assert _ship_to(p, usb)["sent"] == []
    assert p.cli("verify", str(dest), "--key", str(p.pub)).returncode == 0


def test_ship_refuses_a_tampered_bundle_before_sending(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    assert p.cli("bundle", "spark-b", "--key", str(p.key)).returncode == 0
    (p.out("spark-b") / "stop.sh").write_text("#!/bin/sh\nrm -rf /\n")
    r = p.cli("ship", "spark-b", "--to", str(tmp_path / "usb"), "--key", str(p.pub))
    assert r.returncode == 1 and "stop.sh" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "usb").exists()
    r = p.cli("ship", "spark-a", "--key", str(p.pub))
    assert r.returncode == 2 and "no bundle there" in r.stderr


# --------------------------------------------------------------------------- the test fleet


@pytest.fixture(scope="module")
def fleet2(request: pytest.FixtureRequest) -> Any:
    return fleetlib.fleet_fixture(request, 2, skip_if_unavailable=not os.environ.get("CI"))


FLEET_PATHS = {
    "models": "/home/spark/models",
    "engram": "/home/spark/engram",
    "bundles": "/home/spark/builder",
}


def fleet_project(tmp_path: Path, fleet: Any) -> bl.Project:
    hosts = []
    for i, h in enumerate(fleet.hosts):
        hosts.append(
            {
                "name": h.name,
                "ssh": h.name,
                "rank": i,
                "role": "head" if i == 0 else "worker",
                "address": h.ip,
                "paths": FLEET_PATHS,
            }
        )
    return bl.make_project(
        tmp_path,
        hosts=hosts,
        docker_image=True,
        marker=f"fleet-{fleet.network}",
        ssh_config=str(fleet.ssh_config),
    )


def _applied(fleet: Any, h: Any) -> dict[str, Any]:
    return json.loads(fleet.exec(h, ["cat", f"{FLEET_PATHS['bundles']}/state/applied.json"]).stdout)


def _accepted(fleet: Any, h: Any) -> int:
    """The ssh connections the host's sshd accepted so far."""
    r = fleet.exec(h, ["grep", "-c", "Accepted publickey", "/var/log/sshd.log"], check=False)
    return int(r.stdout.strip() or 0)


def _health(ip: str, port: int = bl.PORT, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{ip}:{port}/health", timeout=2) as r:
                return r.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def _remote_installer(fleet: Any, h: Any, *args: str) -> subprocess.CompletedProcess[str]:
    """The installer that ship keeps on the host (by its sha256), run there."""
    prog = kept_installer(FLEET_PATHS["bundles"], hostpkg.sha256())
    return fleet.ssh(h, " ".join(shlex.quote(a) for a in ["python3", prog, *args]), timeout=120)


@pytest.fixture
def fleet2_project(fleet2: Any, tmp_path: Path) -> Iterator[bl.Project]:
    """The project on ``fleet2``; its image (unique to the fleet) leaves this machine's engine after."""
    p = fleet_project(tmp_path, fleet2)
    yield p
    subprocess.run(["docker", "image", "rm", "-f", p.image_id], capture_output=True)


@pytest.mark.fleet
def test_ship_install_start_rollback_on_the_fleet(fleet2: Any, fleet2_project: bl.Project, tmp_path: Path) -> None:
    fleet = fleet2
    p = fleet2_project
    head, worker = fleet.hosts
    r = p.cli(
        "bundle",
        "--fleet",
        bl.FLEET,
        "--with-image",
        "--with-models",
        "--part-size",
        "512KiB",
        "--key",
        str(p.key),
    )
    assert r.returncode == 0, r.stderr
    ids1 = {h.name: bl.manifest(p.out(h.name))["bundle_id"] for h in fleet.hosts}

    # a cut host: exit 3, one line naming it, within bounded time; nothing left half-done
    fleet.cut(worker)
    try:
        r = p.cli("ship", worker.name, "--signing-key", str(p.key), "--timeout", "20", timeout=300)
        assert r.returncode == 3, r.stderr
        assert worker.name in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    finally:
        fleet.restore(worker)
        fleet.close_connection(worker)

    # ship killed part-way, then a rerun resumes
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "builder",
            "--pins",
            str(p.pins),
            "ship",
            worker.name,
            "--signing-key",
            str(p.key),
        ],
        cwd=p.root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    time.sleep(2.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for h in (worker, head):
        before = _accepted(fleet, h)
        r = p.cli("ship", h.name, "--signing-key", str(p.key), "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["result"] in ("installed", "unchanged")
        # one ssh connection (key exchange, login) for the whole ship, however many files it sent
        assert _accepted(fleet, h) - before == 1, json.loads(r.stdout)["sent"]
        rec = _applied(fleet, h)
        assert rec["bundle_id"] == ids1[h.name] and rec["host"] == h.name
        assert rec["image"]["image_id"] == p.image_id

    # start: worker first, then head; /health answers on every host's IP
    for h in (worker, head):
        r = fleet.ssh(h, f"{FLEET_PATHS['bundles']}/current/start.sh", timeout=120)
        assert r.returncode == 0, r.stderr
    for h in fleet.hosts:
        assert _health(h.ip) == "ok\n"
    ps = fleet.exec(head, ["docker", "ps", "--format", "{{.Labels}}"]).stdout
    assert f"io.builder.bundle-id={ids1[head.name]}" in ps and "io.builder.rank=0" in ps
    # a second start while running: the same bundle says so; a worker refuses while the head answers
    assert fleet.ssh(head, f"{FLEET_PATHS['bundles']}/current/start.sh").returncode == 0
    fleet.ssh(worker, f"{FLEET_PATHS['bundles']}/current/stop.sh", check=True)
    r = fleet.ssh(worker, f"{FLEET_PATHS['bundles']}/current/start.sh")
    assert r.returncode == 1 and "old head is still running" in r.stderr

    # a second ship of the same bundle changes nothing
    before = _applied(fleet, head)
    r = p.cli("ship", head.name, "--signing-key", str(p.key), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "unchanged", r.stderr
    assert _applied(fleet, head) == before

    # a new release: a cut ship resumes from the byte it reached (what the host holds is not sent again)
    bl.relock(p, streams=3)
    r = p.cli("bundle", "--fleet", bl.FLEET, "--with-image", "--part-size", "512KiB", "--key", str(p.key))
    assert r.returncode == 0, r.stderr
    d2 = p.out(head.name)
    m2 = bl.manifest(d2)
    id2 = m2["bundle_id"]
    archive = next(f for f in m2["files"] if f["path"] == "image.tar")
    assert len(archive["parts"]) >= 2
    whole = b"".join((d2 / pt["path"]).read_bytes() for pt in archive["parts"])
    have = 512 * 1024 + 1000  # into the second part: a ship cut there left these bytes
    incoming = f"{FLEET_PATHS['bundles']}/incoming/{id2}"
    fleet.exec(head, f"mkdir -p {incoming}")
    (tmp_path / "cut").write_bytes(whole[:have])
    subprocess.run(
        ["docker", "cp", str(tmp_path / "cut"), f"{head.container}:{incoming}/image.tar"],
        check=True, capture_output=True,
    )
    fleet.exec(head, f"chown -R spark {FLEET_PATHS['bundles']}")
    fleet.ssh(head, f"{FLEET_PATHS['bundles']}/current/stop.sh", check=True)
    fleet.exec(head, ["docker", "image", "rm", "-f", p.image_id])  # so that the host needs the archive
    r = p.cli("ship", head.name, "--signing-key", str(p.key), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["result"] == "installed" and "image.tar" in out["sent"], out
    sizes = {f["path"]: f["size"] for f in m2["files"]}
    assert out["bytes_sent"] == sum(sizes[f] for f in out["sent"]) - have, out
    assert not any(f.startswith("models/") for f in out["sent"]), out  # the host holds them already
    rec = _applied(fleet, head)
    assert rec["bundle_id"] == id2 and rec["previous_bundle_id"] == ids1[head.name]

    # rollback returns to the previous release
    r = _remote_installer(fleet, head, "rollback", "--root", FLEET_PATHS["bundles"])
    assert r.returncode == 0, r.stderr
    rec = _applied(fleet, head)
    assert rec["bundle_id"] == ids1[head.name] and rec["action"] == "rollback"
    link = fleet.exec(head, ["readlink", f"{FLEET_PATHS['bundles']}/current"]).stdout.strip()
    assert link == f"releases/{ids1[head.name]}"
    for h in (head, worker):
        fleet.ssh(h, f"{FLEET_PATHS['bundles']}/current/stop.sh", check=True)
