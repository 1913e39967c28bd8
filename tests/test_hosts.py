"""The inventory's ssh targets (builder/inputs/hosts.py Host.ssh, parsed by builder/foundation/ssh.py): what is
accepted, what is refused, and how a refusal reaches the user (exit 2, one line naming file and key)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from builder.bundle.keys import fleet_trusted_key as project_trusted_key
from builder.errors import ConfigError
from builder.foundation.ssh import parse_target
from builder.inputs.hosts import fleet_registry_ca, fleet_trusted_key, load_fleet, ssh_config_file
from tests.lib import auditlib, clirun, factory

ROOT = Path(__file__).resolve().parent.parent

GOOD = {
    "spark-1": (None, "spark-1", None),
    "spark@spark-1": ("spark", "spark-1", None),
    "spark@192.0.2.1:2222": ("spark", "192.0.2.1", 2222),
    "192.0.2.1:22": (None, "192.0.2.1", 22),
    "[2001:db8::1]:2222": (None, "2001:db8::1", 2222),
    "ops@[2001:db8::1]:22": ("ops", "2001:db8::1", 22),
    "[::1]": (None, "::1", None),
    "2001:db8::1": (None, "2001:db8::1", None),
    "op_1@spark.example.org:65535": ("op_1", "spark.example.org", 65535),
}

BAD = {
    "-oProxyCommand=touch /tmp/x": "must not start with '-'",
    "-F/tmp/cfg": "must not start with '-'",
    "spark 1": "whitespace",
    "spark\t1": "whitespace",
    "spark\n1": "whitespace",
    "spark\x001": "control character",
    "spark\x1b1": "control character",
    "@spark-1": "empty user",
    "spark@": "empty host",
    "spark@:22": "empty host",
    "spark-1:": "bad port",
    "spark-1:0": "bad port",
    "spark-1:65536": "bad port",
    "spark-1:ssh": "bad port",
    "[2001:db8::1]:": "bad port",
    "[2001:db8::1]x": "[ADDRESS]:PORT",
    "[nothex]:22": "not an IPv6 address",
    "[fe80::1%eth0]:22": "IPv6 zone",
    "spark:1:2": "not an IPv6 address",
    "-l@spark-1": "must not start with '-'",
    "-user@spark-1": "must not start with '-'",
    "a@-spark": "host '-spark'",
    "u:pw@spark-1": "user 'u:pw'",  # testinfra would read a password (sshpass)
    "a@b@spark-1": "user 'a@b'",
    "spark-1?ssh_config=/tmp/x": "host 'spark-1?ssh_config=/tmp/x'",  # testinfra's URL query
    "spark-1,spark-2": "host 'spark-1,spark-2'",  # testinfra's --hosts list
    "spark;reboot": "host 'spark;reboot'",
    "spark/1": "host 'spark/1'",
}


@pytest.mark.parametrize("target", sorted(GOOD))
def test_accepted_targets(target: str) -> None:
    assert tuple(parse_target(target)) == GOOD[target]


@pytest.mark.parametrize("target", sorted(BAD))
def test_refused_targets(target: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_target(target)
    msg = str(e.value)
    assert BAD[target] in msg and "\n" not in msg, msg


def _fleet_file(d: Path, target: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / "f.toml"
    p.write_text(auditlib.fleet_toml("f", [{"name": "a", "ssh": "spark@192.0.2.1", "rank": 0, "role": "head"},
                                          {"name": "b", "ssh": target, "rank": 1, "role": "worker"}]))
    return p


@pytest.mark.parametrize("target", ["-oProxyCommand=x", "spark 1", "spark\x07", "spark-1:99999", "u@", ""])
def test_inventory_names_file_and_key(tmp_path: Path, target: str) -> None:
    p = _fleet_file(tmp_path / "hosts", target)
    with pytest.raises(ConfigError) as e:
        load_fleet(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: hosts[1].ssh: ") and "\n" not in msg and "Value error" not in msg, msg


def test_inventory_accepts_the_shipped_fleets() -> None:
    for p in sorted((ROOT / "hosts").glob("*.toml")):
        load_fleet(p)


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return clirun.run(*args, pins=root / "pins.toml", timeout=300)


@pytest.mark.parametrize("target", ["-oProxyCommand=sh -c 'touch MARKER'", "spark@host:22x"])
def test_cli_hosts_and_audit_exit_2_with_one_line(tmp_path: Path, target: str) -> None:
    """`builder hosts` and `builder audit` refuse the inventory before anything runs: exit 2, one
    `error:` line naming the file and hosts[1].ssh, no traceback, nothing contacted."""
    paths = auditlib.make_project(tmp_path / "proj")
    root = paths["pins"].parent
    marker = tmp_path / "contacted"
    p = _fleet_file(paths["hosts"], target.replace("MARKER", str(marker)))
    for args in (["hosts", "--fleet", "f"], ["hosts"], ["audit", "--fleet", "f", "--connect-timeout", "2"]):
        r = _cli(root, *args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == "", r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {p}: hosts[1].ssh: "), r.stderr
    assert not marker.exists()


def test_every_file_a_fleet_names_is_taken_from_the_fleet_files_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hosts = tmp_path / "hosts"
    (hosts / "keys").mkdir(parents=True)
    for name in ("fleet.pub", "ssh_config", "ca.pem"):
        (hosts / "keys" / name).write_text("x\n")
    path = hosts / "f.toml"
    factory.write_fleet(tmp_path, factory.fleet(
        "f", "l", [factory.host("a", 0)], trusted_key="keys/fleet.pub", ssh_config="keys/ssh_config",
        registry="https://192.0.2.1:5000", registry_ca="keys/ca.pem"))
    monkeypatch.chdir(tmp_path / "hosts" / "keys")  # (the working folder has no say)
    fleet = load_fleet(path)
    assert fleet_trusted_key(path, fleet) == hosts / "keys" / "fleet.pub"
    assert project_trusted_key(tmp_path, "f") == hosts / "keys" / "fleet.pub"
    assert ssh_config_file(path, fleet.fleet.ssh_config) == hosts / "keys" / "ssh_config"
    assert fleet_registry_ca(path, fleet) == hosts / "keys" / "ca.pem"
    (hosts / "keys" / "ca.pem").unlink()
    with pytest.raises(ConfigError, match=rf"^{path}: fleet\.registry_ca: no such file: "):
        fleet_registry_ca(path, fleet)


def test_hosts_and_its_ansible_inventory_agree_on_a_fleet_whose_ssh_config_is_not_there_yet(
    tmp_path: Path,
) -> None:
    """The shipped test fleet names an ssh_config that exists only while its hosts run: `builder hosts`
    lists it, and `builder hosts --ansible` over every fleet writes it too (the path, for ssh to read when
    Ansible connects), rather than exit 2 over the missing file."""
    r = _cli(ROOT, "hosts", "--json")
    assert r.returncode == 0, r.stderr
    listed = {(x["fleet"], x["name"]) for x in json.loads(r.stdout)}
    assert ("test-fleet", "spark-test-1") in listed
    inv = tmp_path / "inv.yml"
    r = _cli(ROOT, "hosts", "--ansible", str(inv))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    text = inv.read_text()
    written = {(g, h) for g, h in re.findall(r"^    (\S+):\n|^        (\S+):$", text, re.M)}
    assert {h for _, h in written if h} == {name for _, name in listed}
    cfg = (ROOT / "hosts" / "test-fleet.toml").parent / "../.cache/test-fleet/ssh_config"
    assert f'ansible_ssh_common_args: "-F {cfg.resolve()}"' in text
    ini = tmp_path / "inv.ini"
    assert _cli(ROOT, "hosts", "--fleet", "test-fleet", "--ansible", str(ini)).returncode == 0
    assert f"ansible_ssh_common_args='-F {cfg.resolve()}'" in ini.read_text()
    if shutil.which("ansible-inventory"):
        p = subprocess.run(["ansible-inventory", "-i", str(inv), "--list"], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible")})
        assert p.returncode == 0, p.stderr
        assert set(json.loads(p.stdout)["_meta"]["hostvars"]) == {name for _, name in listed}
