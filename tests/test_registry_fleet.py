"""The fleet takes its image from a registry: a REAL registry (Debian's docker-registry) on the test
fleet's network with TLS from a CA made here, real pushes by `builder bundle --with-image` (through
`builder push`), and real pulls by the test hosts' own dockerd (each trusts the CA through
/etc/docker/certs.d/<host:port>/ca.crt). The bytes the registry served are read from its access log.

One fleet, in order: the first install pulls every layer; an engine-only change pulls only the
changed layer (and the config); a registry that is down is one line naming it and the old release
stays current; a bundle naming a manifest that is not the lock's image is refused before anything
switches.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.lib import factory, fleetlib, journeylib, projectlib, registrylib, rlib

pytestmark = [pytest.mark.registry, pytest.mark.fleet, pytest.mark.docker, pytest.mark.build]
FLEET = "regfleet"


def _current(fleet: fleetlib.Fleet, h: fleetlib.Host) -> str:
    return fleet.exec(h, f"readlink {journeylib.PATHS['bundles']}/current", check=False).stdout.strip()


def _has_image(fleet: fleetlib.Fleet, h: fleetlib.Host, image_id: str) -> bool:
    return fleet.exec(h, f"docker image inspect --format '{{{{.Id}}}}' {image_id}", check=False
                      ).stdout.strip() == image_id


@dataclass
class RegFleet:
    root: Path
    store: Path
    keys: Path
    fleet: fleetlib.Fleet
    reg: registrylib.Registry
    env: dict[str, str]

    def builder(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return projectlib.run_builder(self.root, self.env, *args, check=check)

    def record(self) -> dict[str, Any]:
        recs = sorted((self.store / "images").glob("*.json"), key=lambda f: f.stat().st_mtime)
        out: dict[str, Any] = json.loads(recs[-1].read_text())
        return out


@contextmanager
def registry_fleet(tmp_path: Path, **fleet_keys: Any) -> Iterator[RegFleet]:
    """Two test hosts whose dockerd trusts a registry on the fleet's network (TLS, a CA made here), the
    fleet file naming it (fleet.registry, fleet.registry_ca relative to the fleet file; ``fleet_keys``:
    more `[fleet]` keys), the lane locked, fetched and built, and a signing key: nothing installed yet."""
    registrylib.require_parts()
    root = projectlib.two_layer_project(tmp_path / "project")
    env = projectlib.env_for(tmp_path)
    env["BUILDER_SSH_DIR"] = str(tmp_path / "ssh")
    (tmp_path / "ssh").mkdir(mode=0o700)
    keys = tmp_path / "keys"
    fleet = fleetlib.start_fleet(2, tmp_path / "fleet")
    try:
        gateway = str(next(ipaddress.ip_network(fleet.subnet).hosts()))
        with registrylib.start_registry(tmp_path / "registry", ip=gateway, tls=True) as reg:
            assert reg.ca is not None
            for h in fleet.hosts:
                journeylib.prepare_host(fleet, h)
                fleet.exec(h, f"mkdir -p /etc/docker/certs.d/{reg.addr}")
                fleetlib.docker("cp", str(reg.ca), f"{h.container_name}:/etc/docker/certs.d/{reg.addr}/ca.crt")
            shutil.copyfile(reg.ca, root / "hosts" / "regfleet-ca.crt")
            (root / "hosts" / f"{FLEET}.toml").write_text(journeylib.fleet_toml(
                FLEET, "demo", fleet, keys, registry=reg.url, registry_ca="regfleet-ca.crt", **fleet_keys))
            rf = RegFleet(root, tmp_path / "store", keys, fleet, reg, env)
            rf.builder("lock", "--offline", "demo")
            rf.builder("fetch", "demo", "--offline")
            rf.builder("image", "demo", "--offline")
            rf.builder("keygen", "--out", str(keys))
            yield rf
    finally:
        fleetlib.close_kept_connections(tmp_path / "ssh")
        fleet.teardown()


def test_deploy_takes_the_image_from_the_registry(tmp_path: Path) -> None:
    """`builder deploy --with-image` on a registry fleet: the first deploy pulls every layer on each host,
    a deploy of what runs sends nothing and remakes no bundle, an engine-only change pulls only the
    changed layer and the config."""
    with registry_fleet(tmp_path) as rf:
        args = ("deploy", "--fleet", FLEET, "--json", "--key", str(rf.keys / "builder.key"), "--with-image",
                "--with-models", "--stop-timeout", "2", "--start-timeout", "60")

        def deploy(want: str) -> dict[str, Any]:
            p = rf.builder(*args, check=False)
            rep: dict[str, Any] = json.loads(p.stdout) if p.stdout.strip() else {}
            assert p.returncode == 0 and rep.get("result") == want, (p.returncode, rep.get("reason"), p.stderr[-3000:])
            return rep

        mark = len(rf.reg.requests())
        deploy("deployed")
        first = rf.record()
        assert rf.reg.blob_bytes_served(mark) == 2 * (sum(first["layer_sizes"]) + first["config_size"])
        for h in rf.fleet.hosts:
            assert _has_image(rf.fleet, h, first["image_id"])

        mark = len(rf.reg.requests())
        deploy("unchanged")
        assert rf.reg.blob_bytes_served(mark) == 0 and rf.reg.blob_puts(mark) == 0

        projectlib.engine_change(rf.root, "0.1.3")
        rf.builder("lock", "--offline", "demo")
        rf.builder("image", "demo", "--offline")
        mark = len(rf.reg.requests())
        deploy("deployed")
        second = rf.record()
        assert second["diff_ids"][0] == first["diff_ids"][0] and second["image_id"] != first["image_id"]
        assert rf.reg.blob_bytes_served(mark) == 2 * (second["layer_sizes"][1] + second["config_size"])


def test_the_fleet_pulls_only_what_it_lacks_from_its_registry(tmp_path: Path) -> None:
    with registry_fleet(tmp_path) as rf:
        root, keys, store, fleet, reg, builder = rf.root, rf.keys, rf.store, rf.fleet, rf.reg, rf.builder
        key = str(keys / "builder.key")
        bundle_args = ("bundle", "--fleet", FLEET, "--with-image", "--with-models", "--key", key)

        def ship_all() -> None:
            for h in reversed(fleet.hosts):
                builder("ship", f"{FLEET}/{h.name}")

        # 1. the first install pulls every layer
        builder(*bundle_args)
        first = rf.record()
        bdir = root / "out" / "bundles" / FLEET / fleet.hosts[0].name
        manifest = json.loads((bdir / "manifest.json").read_text())
        assert manifest["image"]["archive"] is None
        assert manifest["image"]["pull"] == f"{reg.addr}/builder/demo@{first['manifest_digest']}"
        assert not (bdir / "image.tar").exists()
        assert (bdir / "provenance" / "provenance.intoto.json.minisig").is_file()
        builder("verify", str(bdir), "--key", str(keys / "builder.pub"))
        mark = len(reg.requests())
        ship_all()
        sizes = first["layer_sizes"]
        assert isinstance(sizes, list) and isinstance(first["config_size"], int)
        whole = sum(sizes) + first["config_size"]
        assert reg.blob_bytes_served(mark) == 2 * whole  # each host pulled every blob, once
        for h in fleet.hosts:
            assert _has_image(fleet, h, str(first["image_id"]))
            assert _current(fleet, h).endswith(json.loads(
                (root / "out" / "bundles" / FLEET / h.name / "manifest.json").read_text())["bundle_id"])

        # 2. an engine-only change: only the engine layer (and the new config) is pulled
        projectlib.engine_change(root, "0.1.1")
        builder("lock", "--offline", "demo")
        builder("image", "demo", "--offline")
        mark = len(reg.requests())
        builder(*bundle_args)
        second = rf.record()
        assert isinstance(second["diff_ids"], list) and isinstance(first["diff_ids"], list)
        assert second["diff_ids"][0] == first["diff_ids"][0] and second["diff_ids"][1] != first["diff_ids"][1]
        assert reg.blob_puts(mark) == 2  # the push sent the engine layer and the config only
        mark = len(reg.requests())
        ship_all()
        sizes2 = second["layer_sizes"]
        assert isinstance(sizes2, list) and isinstance(second["config_size"], int)
        changed = sizes2[1]
        served = reg.blob_bytes_served(mark)
        assert served == 2 * (changed + second["config_size"]), (served, changed)
        assert served <= 2 * 1.1 * changed
        for h in fleet.hosts:
            assert _has_image(fleet, h, str(second["image_id"]))
        current = {h.name: _current(fleet, h) for h in fleet.hosts}

        # 3. the registry is down: one line naming it, the old release stays current
        projectlib.engine_change(root, "0.1.2")
        builder("lock", "--offline", "demo")
        builder("image", "demo", "--offline")
        builder(*bundle_args)
        third = rf.record()
        reg.stop()
        head = fleet.hosts[0]
        p = builder("ship", f"{FLEET}/{head.name}", check=False)
        assert p.returncode == 1, p.stderr
        errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and f"registry {reg.addr}" in errors[0], p.stderr
        assert "Traceback" not in p.stderr
        assert _current(fleet, head) == current[head.name]
        assert not _has_image(fleet, head, str(third["image_id"]))
        reg.start()

        # 4. a bundle naming a manifest that is not the lock's image is refused before the switch
        rec_file = store / "images" / f"{third['input_address']}.json"
        tampered = json.loads(rec_file.read_text())
        tampered["manifest_digest"] = first["manifest_digest"]
        tampered["pushed"] = {reg.addr: f"{reg.addr}/builder/demo@{first['manifest_digest']}"}
        rec_file.write_text(json.dumps(tampered))
        builder("bundle", "--fleet", FLEET, "--with-models", "--key", str(keys / "builder.key"))
        p = builder("ship", f"{FLEET}/{head.name}", check=False)
        assert p.returncode == 1, p.stderr
        assert f"is image {first['image_id']}, not the bundle's {third['image_id']}" in p.stderr, p.stderr
        assert _current(fleet, head) == current[head.name]


def _blob_data(reg: registrylib.Registry, sha256: str) -> Path:
    return reg.workdir / "storage" / "docker" / "registry" / "v2" / "blobs" / "sha256" / sha256[:2] / sha256 / "data"


def _one_error(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, p.stderr[-3000:]
    return errors[0]


def test_the_fleet_takes_its_model_files_from_its_registry(tmp_path: Path) -> None:
    """`fleet.models_from = "registry"`: the bundles name each model file's blob instead of carrying it,
    each blob is pushed once for the fleet (a second bundle sends none), each host pulls its files by
    digest and installs them; a registry holding a wrong blob, or down, is one line naming the host and
    the file, and the old release stays current with no file half-placed; once the registry is right
    again a deploy completes, and a deploy of what runs sends nothing."""
    with registry_fleet(tmp_path, models_from="registry") as rf:
        root, keys, fleet, reg, builder = rf.root, rf.keys, rf.fleet, rf.reg, rf.builder
        bundle_args = ("bundle", "--fleet", FLEET, "--with-image", "--with-models", "--key", str(keys / "builder.key"))

        def manifest(h: fleetlib.Host) -> dict[str, Any]:
            out: dict[str, Any] = json.loads((root / "out" / "bundles" / FLEET / h.name / "manifest.json").read_text())
            return out

        # 1. the bundles carry no model file; each blob goes to the registry once
        mark = len(reg.requests())
        builder(*bundle_args)
        models = {h.name: manifest(h)["models"] for h in fleet.hosts}
        blobs = {m["sha256"]: m["size"] for ms in models.values() for m in ms}
        assert blobs and all(m["bundled"] is None and m["registry"]["digest"] == "sha256:" + m["sha256"]
                             and m["registry"]["ca"] == "registry-ca.crt" for ms in models.values() for m in ms)
        for h in fleet.hosts:
            assert not (root / "out" / "bundles" / FLEET / h.name / "models").exists()
        model_puts = [r for r in reg.requests()[mark:] if r["method"] == "PUT" and "/model-files/blobs/" in r["path"]]
        assert len(model_puts) == len(blobs)
        mark = len(reg.requests())
        builder(*bundle_args)
        assert reg.blob_puts(mark) == 0  # a second bundle sends no byte

        # 2. each host pulls its files by digest, once, and installs them
        mark = len(reg.requests())
        for h in reversed(fleet.hosts):
            shipped = json.loads(builder("ship", f"{FLEET}/{h.name}", "--json").stdout)
            assert shipped["bytes_pulled"] == sum(m["size"] for m in models[h.name]), shipped
            assert shipped["pull_seconds"] > 0
        assert reg.blob_bytes_served(mark, agent="builder-installer/") == sum(
            m["size"] for ms in models.values() for m in ms)
        for h in fleet.hosts:
            for m in models[h.name]:
                got = fleet.exec(h, f"sha256sum {m['path']}").stdout.split()[0]
                assert got == m["sha256"], (h.name, m["path"])
            assert _current(fleet, h).endswith(manifest(h)["bundle_id"])

        # 3. a wrong blob in the registry: refused naming host and file; the old release stays current
        head = fleet.hosts[0]
        old = _current(fleet, head)
        victim = max(models[head.name], key=lambda m: m["size"])
        data = _blob_data(reg, victim["sha256"])
        good = data.read_bytes()
        data.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
        fleet.exec(head, f"rm {victim['path']}")  # (the host must fetch it again)
        projectlib.engine_change(root, "0.1.4")
        builder("lock", "--offline", "demo")
        builder("image", "demo", "--offline")
        builder(*bundle_args)
        line = _one_error(builder("ship", f"{FLEET}/{head.name}", check=False))
        assert f"host {head.name}: model file {victim['path']}: " in line and "refused" in line, line
        assert _current(fleet, head) == old
        listing = fleet.exec(head, f"ls -a {Path(victim['path']).parent}").stdout.split()
        assert Path(victim["path"]).name not in listing and not [n for n in listing if n.startswith(".tmp-")]

        # 4. the registry down: one line naming host, file and cause; the old release stays current
        data.write_bytes(good)
        reg.stop()
        line = _one_error(builder("ship", f"{FLEET}/{head.name}", check=False))
        assert f"host {head.name}: model file {victim['path']}: " in line and "cannot reach" in line, line
        assert _current(fleet, head) == old

        # 5. the registry back, right: a deploy completes, and a deploy of what runs sends nothing
        reg.start()
        deploy_args = ("deploy", "--fleet", FLEET, "--json", "--key", str(keys / "builder.key"), "--with-image",
                       "--with-models", "--stop-timeout", "2", "--start-timeout", "60")
        for want in ("deployed", "unchanged"):
            mark = len(reg.requests())
            p = builder(*deploy_args, check=False)
            rep = json.loads(p.stdout) if p.stdout.strip() else {}
            assert p.returncode == 0 and rep.get("result") == want, (p.returncode, rep.get("reason"), p.stderr[-3000:])
        assert reg.blob_puts(mark) == 0 and reg.blob_bytes_served(mark, agent="builder-installer/") == 0
        assert fleet.exec(head, f"sha256sum {victim['path']}").stdout.split()[0] == victim["sha256"]
        for h in fleet.hosts:
            assert _current(fleet, h).endswith(manifest(h)["bundle_id"])


#: what builder's own steps look like in a host's process list (host scripts run as `python3 -I -S`, the
#: audit's pytest, the installer's zipapp, the watchdog that ties a step to its ssh channel)
_STEP_MARKS = ("-I -S", "pytest", "install.pyz", "select,signal")


def _left_on_host(fleet: fleetlib.Fleet, h: fleetlib.Host) -> list[str]:
    """builder's steps still running on the host, and containers that are not the lane's ranks."""
    procs = fleet.exec(h, "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null; echo; done",
                       check=False).stdout.splitlines()
    left = [p for p in procs if any(m in p for m in _STEP_MARKS)]
    names = fleet.exec(h, "docker ps -a --format '{{.Names}}'").stdout.split()
    return left + [f"container {n}" for n in names if not n.startswith("builder-demo-r")]


def test_a_deploy_through_the_registry_killed_at_any_moment_converges_on_rerun(tmp_path: Path) -> None:
    """`builder deploy` (image and model files by way of the fleet registry, the hosts' model files removed
    first, so that each install pulls them) ended at points spread over one measured deploy,
    BUILDER_KILL_RUNS times (3 here unless set), by SIGTERM to the command alone (its cleanup runs: exit
    143) and by SIGKILL to its whole process group, in turn. After each, a rerun deploys: every host runs
    the new bundle with each model file whole, and nothing of the ended run is left: no temp file beside
    the model files, no step of builder's still running on a host and no container but the lane's, no
    folder in $TMPDIR and no ssh run folder."""
    with registry_fleet(tmp_path, models_from="registry") as rf:
        tmpdir = tmp_path / "tmpdir"
        tmpdir.mkdir()
        rf.env["TMPDIR"] = str(tmpdir)
        ssh_dir = Path(rf.env["BUILDER_SSH_DIR"])
        deploy = ["deploy", "--fleet", FLEET, "--json", "--key", str(rf.keys / "builder.key"), "--with-image",
                  "--with-models", "--stop-timeout", "2", "--start-timeout", "60"]
        argv = [sys.executable, "-m", "builder", "--pins", str(rf.root / "pins.toml"), *deploy]
        models_dir = journeylib.PATHS["models"]
        streams = iter(range(3, 100))

        def new_release() -> None:
            """Another release of the same image (the lane's serve settings), the hosts' model files gone."""
            n = next(streams)
            factory.edit_pins(rf.root, lambda d: d["lanes"]["demo"]["serve"].update(streams=n))
            rf.builder("lock", "--offline", "demo")
            for h in rf.fleet.hosts:
                rf.fleet.exec(h, f"find {models_dir} -type f -delete")

        def converged(after: str) -> None:
            p = rf.builder(*deploy, check=False)
            rep = json.loads(p.stdout) if p.stdout.strip() else {}
            assert p.returncode == 0 and rep.get("result") in ("deployed", "unchanged"), (
                after, p.returncode, rep.get("reason"), p.stderr[-3000:])
            for h in rf.fleet.hosts:
                m = json.loads((rf.root / "out" / "bundles" / FLEET / h.name / "manifest.json").read_text())
                assert _current(rf.fleet, h).endswith(m["bundle_id"]), h.name
                for f in m["models"]:
                    got = rf.fleet.exec(h, f"sha256sum {f['path']}").stdout.split()[0]
                    assert got == f["sha256"], (h.name, f["path"])
                left = rf.fleet.exec(h, f"find {models_dir} -name '.tmp-*'").stdout.split()
                assert not left, (after, h.name, left)
                assert not _left_on_host(rf.fleet, h), (after, h.name, _left_on_host(rf.fleet, h))
            assert not list(tmpdir.iterdir()), (after, list(tmpdir.iterdir()))
            assert not list(ssh_dir.glob("run-*")), (after, list(ssh_dir.glob("run-*")))

        converged("the first release")
        new_release()
        t0 = time.monotonic()
        converged("a deploy")
        span = time.monotonic() - t0
        rng = random.Random(rlib.kill_seed(38))
        hits = []
        for i in range(int(os.environ.get("BUILDER_KILL_RUNS", "3"))):
            new_release()
            proc = rlib.start_killable(argv, rf.root, rf.env)
            at = rng.uniform(0, span)
            time.sleep(at)
            if i % 2 == 0:  # a CI timeout, `kill PID`, `systemctl stop`: the command alone, its cleanup runs
                running = proc.poll() is None
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(timeout=120)
                # -SIGTERM: it came while Python was still importing builder, before the handler was set (a
                # loaded machine makes that last seconds): the default action ends it, nothing begun
                ended = (128 + signal.SIGTERM, -signal.SIGTERM)
                assert rc in (ended if running else (0, *ended)), (at, rc)
                hits.append(rc == 128 + signal.SIGTERM)
                what = f"SIGTERM at {at:.1f} s (exit {rc})"
            else:
                hits.append(rlib.killpg(proc))
                what = f"SIGKILL at {at:.1f} s"
            converged(what)
        assert any(hits), "no kill found the deploy still running"
