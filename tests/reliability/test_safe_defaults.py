"""Safe defaults, each tested: host keys checked, signatures required, no escapes or device files,
private keys 0600, and nothing from a bundle runs before its signature and hashes check out."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from builder.bundle import BundleOptions, load_bundle_inputs, make_bundle, verify_dir
from builder.errors import BuilderError, ConfigError, VerifyError
from builder.foundation import sign
from builder.foundation.ssh import ssh_options
from builder.image import layers
from builder.image.build import extract_wheel_folder
from builder.inputs.hosts import load_fleet
from builder.installer.errors import EXIT_CONFIG, InstallError
from builder.installer.manifest import MANIFEST, SIGNATURE
from builder.installer.verify import verify_bundle
from builder.ship import Remote
from tests.lib import auditlib, factory, fleetlib, rlib
from tests.lib import bundlelib as bl

# --------------------------------------------------------------------------- ssh host keys

WEAKENING = [
    (
        re.compile(r"StrictHostKeyChecking\s*[= ]\s*[\"']?(no|off|accept-new)", re.I),
        "StrictHostKeyChecking off",
    ),
    (re.compile(r"UserKnownHostsFile\s*[= ]\s*[\"']?/dev/null", re.I), "known_hosts thrown away"),
    (re.compile(r"GlobalKnownHostsFile\s*[= ]\s*[\"']?/dev/null", re.I), "global known_hosts thrown away"),
    (re.compile(r"AutoAddPolicy|WarningPolicy|MissingHostKeyPolicy"), "paramiko accepting unknown keys"),
    (re.compile(r"look_for_keys\s*=\s*False|known_hosts\s*=\s*None"), "host keys skipped"),
]


def test_no_code_path_switches_host_key_checking_off() -> None:
    hits = []
    for base in ("builder", "checks", "images"):
        for p in sorted((rlib.REPO / base).rglob("*")):
            if not p.is_file() or p.suffix not in (
                ".py",
                ".sh",
                ".toml",
                ".cfg",
                ".ini",
                ".j2",
                ".jinja",
                "",
            ):
                continue
            text = p.read_text(errors="replace")
            for rx, why in WEAKENING:
                for m in rx.finditer(text):
                    hits.append(f"{p.relative_to(rlib.REPO)}: {why}: {m.group(0)!r}")
    assert not hits, hits
    # and what ship and audit actually pass to ssh
    opts = " ".join(ssh_options(8, "/nonexistent/%C", 60))
    assert "StrictHostKeyChecking" not in opts and "KnownHosts" not in opts and "BatchMode=yes" in opts


def test_ship_ssh_argv_keeps_host_key_checking(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    fleet = load_fleet(p.root / "hosts" / "test.toml")
    argv = Remote(p.root / "hosts" / "test.toml", fleet, fleet.hosts[1]).argv("true")
    joined = " ".join(argv)
    assert argv[0] == "ssh" and "BatchMode=yes" in joined
    assert "StrictHostKeyChecking" not in joined and "UserKnownHostsFile" not in joined


@pytest.fixture(scope="module")
def fleet2(request: pytest.FixtureRequest) -> Any:
    return fleetlib.fleet_fixture(request, 2, skip_if_unavailable=not os.environ.get("CI"), dockerd=False)


def wrong_known_hosts_config(fleet: Any, tmp: Path) -> Path:
    """A copy of the fleet's ssh_config whose known_hosts gives each host the OTHER host's key."""
    lines = fleet.known_hosts.read_text().splitlines()
    keys = [ln.split(" ", 1)[1] for ln in lines]
    names = [ln.split(" ", 1)[0] for ln in lines]
    wrong = tmp / "known_hosts.wrong"
    wrong.write_text("".join(f"{n} {k}\n" for n, k in zip(names, keys[1:] + keys[:1], strict=True)))
    cm = tmp / "cm"
    cm.mkdir(exist_ok=True)
    cfg = fleet.ssh_config.read_text().replace(str(fleet.known_hosts), str(wrong))
    cfg = re.sub(r"ControlPath .*", f"ControlPath {cm}/%C", cfg)  # never reuse a master opened with the right keys
    out = tmp / "ssh_config.wrong"
    out.write_text(cfg)
    return out


@pytest.mark.fleet
@pytest.mark.docker
def test_ship_and_audit_refuse_a_host_whose_key_does_not_match(fleet2: Any, tmp_path: Path) -> None:
    fleet = fleet2
    cfg = wrong_known_hosts_config(fleet, tmp_path)
    paths = {"models": "/home/spark/models", "engram": "/home/spark/engram", "bundles": "/home/spark/builder"}
    hosts = [factory.host(h.name, i, address=h.ip, paths=paths) for i, h in enumerate(fleet.hosts)]
    p = bl.make_project(tmp_path / "ship", hosts=hosts, ssh_config=str(cfg))
    assert (
        rlib.run_builder(
            "--pins", str(p.pins), "bundle", "--fleet", bl.FLEET, "--key", str(p.key), cwd=p.root
        ).returncode
        == 0
    )
    target = fleet.hosts[1]
    r = rlib.run_builder(
        "--pins", str(p.pins), "ship", target.name, "--signing-key", str(p.key), "--timeout", "20", cwd=p.root
    )
    assert r.returncode == 3, r.stderr
    assert target.name in r.stderr and "Host key verification failed" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    probe = fleet.exec(target, "ls /home/spark/builder 2>/dev/null || true").stdout.strip()
    assert probe == "", probe  # nothing reached the host
    # the audit: the same host is unreachable (exit 3), never audited with an unverified key
    ap = auditlib.make_project(tmp_path / "audit", tp=2)
    (ap["hosts"] / "t.toml").write_text(
        auditlib.fleet_toml(
            "t",
            [factory.host(h.name, i) for i, h in enumerate(fleet.hosts)],
            ssh_config=str(cfg),
            expect={"docker": False, "gpu_count": 0},
        )
    )
    r = rlib.run_builder(
        "--pins",
        str(ap["pins"]),
        "audit",
        "--fleet",
        "t",
        "--json",
        "--connect-timeout",
        "5",
        "--checks",
        str(rlib.REPO / "checks"),
        "--only",
        "release",
        cwd=ap["pins"].parent,
    )
    assert r.returncode == 3, r.stderr
    data = json.loads(r.stdout)
    for h in fleet.hosts:
        assert data["hosts"][h.name]["status"] == "unreachable"
        assert "Host key verification failed" in data["hosts"][h.name]["message"]
        assert data["hosts"][h.name]["checks"] == {}


# --------------------------------------------------------------------------- signatures required


def test_signatures_are_required_unless_insecure_is_given(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    pins = ["--pins", str(p.pins)]
    assert rlib.run_builder(*pins, "bundle", "spark-b", "--key", str(p.key), cwd=p.root).returncode == 0
    d = p.out("spark-b")
    (d / SIGNATURE).unlink()
    usb = tmp_path / "usb"
    for env in (
        {},
        {"BUILDER_INSECURE": "1", "INSECURE": "1", "BUILDER_VERIFY": "0"},
    ):  # no env var turns it off
        r = rlib.run_builder(*pins, "ship", "spark-b", "--to", str(usb), "--key", str(p.pub), cwd=p.root, env=env)
        rlib.assert_clean_cli(r, allowed=(1,))
        assert "manifest.json.minisig: missing" in r.stderr and not usb.exists()
        r = rlib.run_builder(*pins, "verify", str(d), "--key", str(p.pub), cwd=p.root, env=env)
        rlib.assert_clean_cli(r, allowed=(1,))
    with pytest.raises(InstallError) as e:
        verify_bundle(str(d), None)
    assert e.value.code == EXIT_CONFIG and "no trusted key" in str(e.value)
    with pytest.raises(InstallError, match="minisig: missing"):
        verify_bundle(str(d), p.pub.read_bytes())
    # the explicit flag, on the command line only, lets it through (and says so on the host)
    r = rlib.run_builder(*pins, "ship", "spark-b", "--to", str(usb), "--insecure", "--key", str(p.pub), cwd=p.root)
    assert r.returncode == 0, r.stderr
    # --insecure checks no signature, so it needs no key either (none configured, none given)
    r = rlib.run_builder(*pins, "ship", "spark-b", "--to", str(tmp_path / "usb2"), "--insecure", cwd=p.root,
                         env={"BUILDER_SIGNING_KEY": str(tmp_path / "no-such-key")})
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "usb2").rglob(MANIFEST))) == 1
    root = tmp_path / "root"
    rb = subprocess.run(
        [sys.executable, "-I", str(bl.installer_file()), "install", str(d), "--root", str(root)],
        capture_output=True,
        cwd="/",
        timeout=120,
    )
    assert rb.returncode == 2 and b"no trusted key" in rb.stderr  # the installer needs a key too
    rb = subprocess.run(
        [sys.executable, "-I", str(bl.installer_file()), "install", str(d), "--root", str(root), "--insecure"],
        capture_output=True,
        cwd="/",
        timeout=120,
    )
    assert b"WARNING: --insecure" in rb.stderr, rb.stderr


# --------------------------------------------------------------------------- escapes and device files


def _bundle_with(tmp_path: Path) -> tuple[Any, Path]:
    p = bl.make_project(tmp_path)
    ctx = load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)
    return p, make_bundle(ctx, "spark-b", BundleOptions(key=p.key, out=tmp_path / "b")).path


def test_bundle_refuses_fifos_devices_and_links(tmp_path: Path) -> None:
    p, d = _bundle_with(tmp_path)
    verify_dir(d, p.pub)
    os.mkfifo(d / "fifo")
    with pytest.raises(VerifyError, match=r"fifo \(not a regular file\)"):
        verify_dir(d, p.pub)
    (d / "fifo").unlink()
    try:
        os.mknod(d / "dev", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("no CAP_MKNOD here")
    with pytest.raises(VerifyError, match=r"dev \(not a regular file\)"):
        verify_dir(d, p.pub)
    (d / "dev").unlink()
    os.symlink("/etc/passwd", d / "parts-link")
    with pytest.raises(VerifyError, match="symbolic link"):
        verify_dir(d, p.pub)
    (d / "parts-link").unlink()
    # a signed manifest naming a device path for a model is refused too
    m = json.loads((d / MANIFEST).read_text())
    m["models"][0]["path"] = "/dev/sda"
    bl.resign(d, p.key, m)
    with pytest.raises(VerifyError, match="outside paths.models"):
        verify_dir(d, p.pub)


def _tar(entries: list[tarfile.TarInfo], data: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti in entries:
            tf.addfile(ti, io.BytesIO(data.get(ti.name, b"")) if ti.isreg() else None)
    return buf.getvalue()


@pytest.mark.parametrize("name", ["../escape", "/etc/cron.d/x", "a/../../b", "./../x"])
def test_layer_normalisation_refuses_escapes(tmp_path: Path, name: str) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = 1
    src = tmp_path / "l.tar"
    src.write_bytes(_tar([ti], {name: b"x"}))
    with pytest.raises(BuilderError) as e, open(tmp_path / "out.tar", "wb") as out:
        layers.normalize_layer(src, out, source_date_epoch=0)
    rlib.assert_one_line(e.value)


def test_layer_normalisation_drops_devices_and_fifos(tmp_path: Path) -> None:
    dev = tarfile.TarInfo("dev/sda")
    dev.type = tarfile.BLKTYPE
    fifo = tarfile.TarInfo("run/fifo")
    fifo.type = tarfile.FIFOTYPE
    ok = tarfile.TarInfo("etc/ok")
    ok.size = 2
    src = tmp_path / "l.tar"
    src.write_bytes(_tar([dev, fifo, ok], {"etc/ok": b"ok"}))
    with open(tmp_path / "out.tar", "wb") as out:
        res = layers.normalize_layer(src, out, source_date_epoch=0)
    assert sorted(res.skipped) == ["dev/sda", "run/fifo"]
    with tarfile.open(tmp_path / "out.tar") as tf:
        assert all(m.isreg() or m.isdir() for m in tf.getmembers())


def test_wheel_extraction_refuses_escapes(tmp_path: Path) -> None:
    whl = tmp_path / "x.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("ziglang/zig", b"ok")
        z.writestr("ziglang/../../evil", b"bad")
    with pytest.raises(VerifyError, match="unsafe path"):
        extract_wheel_folder(whl, "ziglang/", tmp_path / "out")
    assert not (tmp_path / "evil").exists()


# --------------------------------------------------------------------------- private keys


def test_private_keys_are_0600_and_refused_when_others_can_read_them(tmp_path: Path) -> None:
    r = rlib.run_builder("keygen", "--out", str(tmp_path / "k"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    sk = tmp_path / "k" / "builder.key"
    assert stat.S_IMODE(sk.stat().st_mode) == 0o600
    sign.load_secret_key(sk)
    for mode in (0o640, 0o604, 0o644, 0o660, 0o606, 0o777):
        os.chmod(sk, mode)
        with pytest.raises(ConfigError) as e:
            sign.load_secret_key(sk)
        assert "group or others" in rlib.assert_one_line(e.value)
    os.chmod(sk, 0o400)
    sign.load_secret_key(sk)
    # even under a permissive umask, keygen writes 0600
    r = subprocess.run(
        ["sh", "-c", f"umask 000 && {sys.executable} -m builder keygen --out {tmp_path / 'k2'}"],
        capture_output=True,
        text=True,
        env=rlib.builder_env(),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE((tmp_path / "k2" / "builder.key").stat().st_mode) == 0o600


# --------------------------------------------------------------------------- nothing from a bundle runs first


CANARY = "#!/bin/sh\ntouch {marker}\n"
PY_CANARY = "import pathlib; pathlib.Path({marker!r}).touch()\n"


@pytest.mark.docker
def test_nothing_from_the_bundle_runs_before_or_during_install(tmp_path: Path) -> None:
    """A validly re-signed bundle whose start.sh, stop.sh and install.pyz are canaries: `builder ship` (local
    connection) installs it with its own trusted installer and runs none of them; a tampered, not
    re-signed one is refused before anything is copied."""
    if not shutil.which("docker"):
        pytest.skip("no docker CLI")
    host = tmp_path / "host"
    hs = bl.local_hosts(host, bundles="b", connection="local")
    p = bl.make_project(tmp_path, hosts=hs, docker_image=True, marker=f"canary-{tmp_path}")
    marker = tmp_path / "CANARY-RAN"
    try:
        pins = ["--pins", str(p.pins)]
        r = rlib.run_builder(*pins, "bundle", "spark-b", "--key", str(p.key), "--with-models", cwd=p.root)
        assert r.returncode == 0, r.stderr
        d = p.out("spark-b")
        # 1. tampered (not re-signed): refused before anything reaches the host
        for name in ("start.sh", "install.pyz"):
            keep = (d / name).read_bytes()
            (d / name).write_text(
                CANARY.format(marker=marker) if name.endswith(".sh") else PY_CANARY.format(marker=str(marker))
            )
            r = rlib.run_builder(*pins, "ship", "spark-b", "--signing-key", str(p.key), cwd=p.root)
            rlib.assert_clean_cli(r, allowed=(1,))
            assert name in r.stderr and not marker.exists() and not (host / "b").exists()
            (d / name).write_bytes(keep)
        # 2. canaries in a validly signed bundle: installed as files, never run by ship or the installer
        m = json.loads((d / MANIFEST).read_text())
        for f in m["files"]:
            if f["path"] in ("start.sh", "stop.sh", "install.pyz"):
                text = CANARY if f["path"].endswith(".sh") else PY_CANARY
                data = text.format(marker=str(marker) if f["path"].endswith(".pyz") else marker).encode()
                (d / f["path"]).write_bytes(data)
                import hashlib

                f["size"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        bl.resign(d, p.key, m)
        r = rlib.run_builder(*pins, "ship", "spark-b", "--signing-key", str(p.key), "--json", cwd=p.root)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["result"] == "installed"
        assert not marker.exists(), "a script from the bundle was run"
        assert PY_CANARY.split(";")[0] in (host / "b" / "current" / "install.pyz").read_text()
    finally:
        subprocess.run(["docker", "rmi", "-f", p.image_id], capture_output=True)
