"""A lane that runs a PUBLISHED image, end to end on the test fleet: an image built here (a payload of
this test's own, so its ImageID is no other test's) is pushed to a REAL registry on loopback (Debian's
docker-registry), removed from this machine's engine, and named by digest in the pins as
`[images.pub] published = ...`; the demo lane then serves `pub`. Through the CLI alone: `builder lock`
resolves it through the registry, `builder image pub` pulls it by digest, `builder bundle --with-image`
carries it, `builder ship` installs it on two test hosts and their dockerd load it, the lane starts,
and `builder audit --phase all` passes on both. Then one host's tag names another image (same files,
another ImageID): the audit fails that host alone, on that check, naming both images.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path

import pytest

from tests.lib import fleetlib, journeylib, projectlib, registrylib

pytestmark = [pytest.mark.registry, pytest.mark.fleet, pytest.mark.docker, pytest.mark.build]
FLEET = "pubfleet"


def _docker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)


def _bad(report: dict[str, object]) -> str:
    hosts = report["hosts"]
    assert isinstance(hosts, dict)
    return json.dumps({h: {c: r for c, r in hr["checks"].items() if r["status"] not in ("pass", "skip")}
                       for h, hr in hosts.items()}, indent=1)


def test_a_fleet_serving_a_published_image_passes_the_audit_and_a_retagged_host_fails(tmp_path: Path) -> None:
    registrylib.require_parts()
    root = projectlib.two_layer_project(tmp_path / "project", secrets.token_bytes(projectlib.PAYLOAD))
    env = projectlib.env_for(tmp_path)
    env["BUILDER_SSH_DIR"] = str(tmp_path / "ssh")
    (tmp_path / "ssh").mkdir(mode=0o700)
    keys = tmp_path / "keys"
    fleet = fleetlib.start_fleet(2, tmp_path / "fleet")
    built: dict[str, str] = {}
    try:
        (root / "hosts" / f"{FLEET}.toml").write_text(journeylib.fleet_toml(FLEET, "demo", fleet, keys))
        for h in fleet.hosts:
            journeylib.prepare_host(fleet, h)
        j = journeylib.Journey(root=root, fleet=fleet, name=FLEET, env=env, keys=keys)
        j.builder("lock", "--offline", "demo")
        j.builder("fetch", "demo", "--offline")
        built = json.loads(j.builder("image", "demo", "--offline", "--json").stdout)
        j.builder("keygen", "--out", str(keys))
        with registrylib.start_registry(tmp_path / "registry") as reg:
            reference = json.loads(j.builder("push", "demo", "--registry", reg.url, "--json").stdout)["reference"]
            # from here on the image is the registry's alone: `builder image pub` must pull it
            assert _docker("rmi", "--force", built["image_id"]).returncode == 0
            projectlib.pin_published(root, reference)
            j.builder("lock", "pub")
            rec = json.loads(j.builder("image", "pub", "--json").stdout)
        j.builder("lock", "--offline", "demo")  # the lane now names pub: its locked entry is kept
        assert rec["built"] is True and rec["published"] == reference and rec["image_id"] == built["image_id"]
        lock = json.loads((root / "pins.lock").read_text())
        assert lock["lanes"]["demo"]["image"] == "pub"  # the lane's lock names the published image

        j.builder("bundle", "--fleet", FLEET, "--with-image", "--with-models", "--key", str(keys / "builder.key"))
        for h in fleet.hosts:
            manifest = json.loads((root / "out" / "bundles" / FLEET / h.name / "manifest.json").read_text())
            assert manifest["image"]["name"] == "pub" and manifest["image"]["image_id"] == rec["image_id"]
        j.ship_all()
        j.start()
        rc, report = j.audit("--phase", "all")
        assert rc == 0 and not journeylib.failing(report), _bad(report)
        for h in fleet.hosts:
            checks = report["hosts"][h.name]["checks"]
            for c in ("image::present_by_id", "image::tag_points_at_image", "image::diff_ids", "image::labels"):
                assert checks[c]["status"] == "pass", (h.name, c, checks[c])
            running = fleet.exec(h, "docker inspect --format '{{.Image}}' $(docker ps -q)").stdout.split()
            assert running == [rec["image_id"]], running  # the lane serves the published image

        # drift: on host 2 the lane's tag names another image (the same files committed: another ImageID)
        h2 = fleet.hosts[1]
        fleet.exec(h2, f"docker create --name other-src {rec['image_id']} >/dev/null")
        other = fleet.exec(h2, "docker commit other-src other/pub:1").stdout.strip()
        fleet.exec(h2, ["docker", "tag", other, rec["tag"]])
        rc, report = j.audit("--phase", "all")
        assert journeylib.failing(report) == {(h2.name, "image::tag_points_at_image")}, _bad(report)
        assert rc == 1
        msg = report["hosts"][h2.name]["checks"]["image::tag_points_at_image"]["message"]
        assert rec["tag"] in msg and rec["image_id"] in msg and other in msg, msg
    finally:
        fleetlib.close_kept_connections(tmp_path / "ssh")
        fleet.teardown()
        if built:
            _docker("rmi", "--force", built["image_id"])
