"""Planted secrets never land in any output: the HF token, the registry password, the signing key.

Every command runs with all three planted (HF_TOKEN, BUILDER_REGISTRY_USER/PASSWORD, BUILDER_SIGNING_KEY)
and its stdout, stderr and every file it wrote are scanned for each secret in its raw, hex and base64
forms (tests/lib/rlib.py: secret_forms). With Docker: the image's config, labels and history
and its `docker save` archive, a bundle carrying it, and the installer's apply record. With the loopback
registry: a base resolved with the real password, and refused with a wrong one.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.lib import bundlelib as bl
from tests.lib import clirun, factory, rlib
from tests.lib.fakehub import FakeHub
from tests.lib.registrylib import registry_available, start_registry

HF_TOKEN = "hf_FAKEplanted" + secrets.token_hex(12)
REG_PASSWORD = "regPW-planted-" + secrets.token_hex(12)


class Scanner:
    """Runs builder with the secrets planted and keeps every output for the final scan."""

    def __init__(self, tmp: Path, key_dir: Path, extra_env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.blobs: dict[str, bytes] = {}
        self.key_file = key_dir / "builder.key"
        env = rlib.builder_env(
            {
                "HF_TOKEN": HF_TOKEN,
                "BUILDER_REGISTRY_USER": "planted-user",
                "BUILDER_REGISTRY_PASSWORD": REG_PASSWORD,
                "BUILDER_SIGNING_KEY": str(self.key_file),
                **(extra_env or {}),
            }
        )
        self.env = env
        lines = self.key_file.read_text().splitlines()
        blob = base64.b64decode(lines[1])
        self.secrets: dict[str, str | bytes] = {
            "hf-token": HF_TOKEN,
            "registry-password": REG_PASSWORD,
            "secret-key-line": lines[1],
            "secret-key-seed": blob[62:94],
        }

    def run(
        self,
        *args: str,
        cwd: Path,
        expect: tuple[int, ...] = (0,),
        env: dict[str, str] | None = None,
        argv0: list[str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        e = dict(self.env, **(env or {}))
        for k in [k for k, v in e.items() if v == ""]:
            del e[k]
        p = clirun.run(*args, cwd=cwd, env=e, timeout=600, argv0=tuple(argv0) if argv0 else clirun.ARGV)
        n = len(self.blobs)
        self.blobs[f"[{n}] stdout of {' '.join(args[2:5])}"] = p.stdout.encode()
        self.blobs[f"[{n}] stderr of {' '.join(args[2:5])}"] = p.stderr.encode()
        assert "Traceback" not in p.stderr, p.stderr
        assert p.returncode in expect, (args, p.returncode, p.stderr[-1500:])
        return p

    def add(self, where: str, data: bytes) -> None:
        self.blobs[where] = data

    def scan(self) -> None:
        files = rlib.files_under(self.tmp)
        files.pop(str(self.key_file), None)  # the key file itself holds the key
        hits = rlib.scan_for({**self.blobs, **files}, self.secrets)
        assert not hits, hits[:10]
        assert len(self.blobs) >= 4


def keygen(tmp: Path) -> Path:
    d = tmp / "signing"
    p = clirun.run("keygen", "--out", str(d), "--json", cwd=tmp)
    assert p.returncode == 0, p.stderr
    seed = base64.b64decode((d / "builder.key").read_text().splitlines()[1])[62:94]
    assert not rlib.scan_for({"keygen": (p.stdout + p.stderr).encode()}, {"seed": seed})
    return d


def hub_env(hub: Any, tmp: Path) -> dict[str, str]:
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_CACHE": str(tmp / "hf-cache"),
        "HF_HOME": str(tmp / "hf-home"),
        "HF_HUB_OFFLINE": "",
    }


# --------------------------------------------------------------------------- without docker


def test_no_secret_in_lock_bundle_verify_ship_or_errors(tmp_path: Path) -> None:
    p = bl.make_project(tmp_path)
    keys = keygen(tmp_path)
    sc = Scanner(tmp_path, keys)
    pins = ["--pins", str(p.pins)]
    with FakeHub(token=HF_TOKEN) as hub:
        hub.add_repo(
            "org/model",
            {"config.json": b"{}\n", "model.safetensors": b"\x05" * 5000},
            lfs={"model.safetensors"},
        )
        hp = tmp_path / "hubproj"
        hp.mkdir()
        factory.write_pins(hp, factory.pins(models={"m": factory.model("org/model")}))
        henv = hub_env(hub, tmp_path)
        sc.run("--pins", str(hp / "pins.toml"), "lock", "--json", cwd=hp, env=henv)
        sc.run("--pins", str(hp / "pins.toml"), "lock", "--check", "--json", cwd=hp, env=henv)
        # failures: an unknown repo (the hub answers 404), a wrong token (401), the hub unreachable
        factory.write_pins(hp, factory.pins(models={"m": factory.model("org/gone")}))
        sc.run("--pins", str(hp / "pins.toml"), "lock", "--json", cwd=hp, env=henv, expect=(1,))
        sc.run(
            "--pins",
            str(hp / "pins.toml"),
            "lock",
            cwd=hp,
            env={**henv, "HF_ENDPOINT": "http://127.0.0.1:9"},
            expect=(1,),
        )
        assert any(r.authorization == f"Bearer {HF_TOKEN}" for r in hub.requests)  # it was really sent
    # a base image at a closed loopback registry port, with the password planted
    bp = tmp_path / "baseproj"
    bp.mkdir()
    factory.write_pins(bp, factory.pins(bases={"b": {"ref": "127.0.0.1:9/demo/x:v1", "platforms": ["linux/arm64"]}}))
    sc.run("--pins", str(bp / "pins.toml"), "lock", "--json", cwd=bp, expect=(1,))
    # bundle (key from BUILDER_SIGNING_KEY), verify, ship to a folder: every --json output
    sc.run(*pins, "bundle", "--fleet", bl.FLEET, "--with-models", "--part-size", "4KiB", "--json", cwd=p.root)
    sc.run(*pins, "verify", str(p.out("spark-b")), "--key", str(keys / "builder.pub"), "--json", cwd=p.root)
    sc.run(
        *pins,
        "ship",
        "spark-b",
        "--to",
        str(tmp_path / "usb"),
        "--key",
        str(keys / "builder.pub"),
        "--json",
        cwd=p.root,
    )
    sc.run(*pins, "hosts", "--json", cwd=p.root)
    sc.run(*pins, "lock", "--check", "--json", cwd=p.root, expect=(0, 1))
    # error paths with the key in play
    (p.out("spark-b") / "stop.sh").write_text("#!/bin/sh\n")
    sc.run(*pins, "verify", str(p.out("spark-b")), "--key", str(keys / "builder.pub"), cwd=p.root, expect=(1,))
    os.chmod(keys / "builder.key", 0o644)
    sc.run(*pins, "bundle", "spark-b", "--json", cwd=p.root, expect=(2,))
    os.chmod(keys / "builder.key", 0o600)
    sc.run(*pins, "bundle", "spark-b", "--key", str(tmp_path / "nope.key"), cwd=p.root, expect=(2,))
    sc.run(*pins, "keygen", "--out", str(keys), "--json", cwd=p.root, expect=(2,))  # no silent overwrite
    sc.scan()


# --------------------------------------------------------------------------- with docker


@pytest.mark.docker
def test_no_secret_in_image_layers_labels_archive_bundle_or_apply_record(tmp_path: Path) -> None:
    if not shutil.which("docker"):
        pytest.skip("no docker CLI")
    keys = keygen(tmp_path)
    sc = Scanner(tmp_path, keys)
    proj = tmp_path / "imgproj"
    (proj / "images" / "t").mkdir(parents=True)
    (proj / "images" / "t" / "Dockerfile").write_text("FROM scratch\nARG NOTE\nCOPY hello /hello\n")
    (proj / "images" / "t" / "hello").write_text(f"hello {secrets.token_hex(8)}\n")
    factory.write_pins(proj, factory.pins(
        images={"t": factory.image("images/t", platform="linux/amd64", build_args={"NOTE": "x"})}))
    pins = ["--pins", str(proj / "pins.toml")]
    sc.run(*pins, "lock", "--json", cwd=proj)
    out = json.loads(sc.run(*pins, "image", "t", "--json", cwd=proj).stdout)
    image_id, tag = out["image_id"], out["tag"]
    try:
        sc.run(*pins, "why", "t", "--json", cwd=proj, expect=(0, 2))
        sc.run(*pins, "image", "t", "--plan", "--json", cwd=proj, expect=(0, 2))
        insp = subprocess.run(["docker", "image", "inspect", image_id], capture_output=True, check=True).stdout
        hist = subprocess.run(["docker", "history", "--no-trunc", image_id], capture_output=True, check=True).stdout
        save = subprocess.run(["docker", "save", image_id], capture_output=True, check=True).stdout
        assert b"org.opencontainers.image.title" in insp and len(save) > 1000
        sc.add("docker image inspect (config, labels)", insp)
        sc.add("docker history", hist)
        sc.add("docker save archive", save)
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
    # a bundle carrying an image, installed: the apply record and the installer's output
    host = tmp_path / "host"
    hs = bl.local_hosts(host, bundles="b")
    p = bl.make_project(tmp_path / "b", hosts=hs, docker_image=True, marker=f"secrets-{tmp_path}")
    try:
        sc.run("--pins", str(p.pins), "bundle", "spark-b", "--with-image", "--with-models", "--json", cwd=p.root)
        bdir = p.out("spark-b")
        r = subprocess.run(
            [
                sys.executable,
                "-I",
                str(bl.installer_file()),
                "install",
                str(bdir),
                "--root",
                str(host / "b"),
                "--trusted-key",
                str(keys / "builder.pub"),
            ],
            capture_output=True,
            cwd="/",
            env=sc.env,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        sc.add("install stdout", r.stdout)
        sc.add("install stderr", r.stderr)
        st = subprocess.run(
            [sys.executable, "-I", str(bl.installer_file()), "status", "--root", str(host / "b")],
            capture_output=True,
            cwd="/",
            env=sc.env,
            timeout=60,
        )
        sc.add("installer status", st.stdout + st.stderr)
        assert (host / "b" / "state" / "applied.json").is_file()
    finally:
        subprocess.run(["docker", "rmi", "-f", p.image_id], capture_output=True)
    sc.scan()


# --------------------------------------------------------------------------- with the loopback registry


@pytest.mark.registry
def test_registry_password_never_printed(tmp_path: Path) -> None:
    if not registry_available():
        pytest.skip("docker-registry is not installed")
    keys = keygen(tmp_path)
    with start_registry(tmp_path / "registry", auth=True) as reg:
        idx = reg.push_index("demo/multi", "v1")
        assert reg.password
        sc = Scanner(
            tmp_path,
            keys,
            {"BUILDER_REGISTRY_USER": str(reg.username), "BUILDER_REGISTRY_PASSWORD": str(reg.password)},
        )
        sc.secrets["registry-password"] = str(reg.password)
        proj = tmp_path / "proj"
        proj.mkdir()
        factory.write_pins(proj, factory.pins(
            bases={"b": {"ref": f"{reg.addr}/demo/multi:v1", "platforms": ["linux/arm64"]}}))
        r = sc.run("--pins", str(proj / "pins.toml"), "lock", "--json", cwd=proj)
        assert idx.digest in (proj / "pins.lock").read_text(), r.stderr
        # a wrong password: refused in one line, neither password printed
        sc.secrets["wrong-password"] = REG_PASSWORD
        sc.run(
            "--pins",
            str(proj / "pins.toml"),
            "lock",
            "--update",
            "b",
            cwd=proj,
            env={"BUILDER_REGISTRY_PASSWORD": REG_PASSWORD},
            expect=(1,),
        )
        sc.scan()


def test_the_scanner_finds_every_form() -> None:
    """The scan would see a leak: raw, hex, and base64 at any alignment inside other bytes."""
    secret = b"\x01\x02sekret-bytes-0123456789\xff"
    for shift in range(3):
        framed = b"x" * shift + secret
        enc = base64.b64encode(framed)
        assert rlib.scan_for({"blob": b"label=" + enc + b";"}, {"s": secret}), shift
    assert rlib.scan_for({"blob": secret.hex().encode()}, {"s": secret})
    assert rlib.scan_for({"blob": b"a" + secret + b"b"}, {"s": secret})
    assert not rlib.scan_for({"blob": b"nothing here"}, {"s": secret})
