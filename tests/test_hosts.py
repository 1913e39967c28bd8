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
from builder.inputs.hosts import (
    bundles_folder,
    check_against_pins,
    find_fleet,
    find_host,
    fleet_registry_ca,
    fleet_trusted_key,
    hosts_folder,
    load_fleet,
    load_fleets,
    ssh_config_file,
)
from builder.inputs.pins import load_pins
from builder.lock.lockfile import load_lock
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
    """Every fleet file shipped in hosts/ validates, is found by its name, and runs a lane that the shipped
    pins and lock both hold: what `builder deploy --fleet NAME` reads before it contacts a host."""
    files = sorted((ROOT / "hosts").glob("*.toml"))
    fleets = load_fleets(ROOT / "hosts")  # (raises on the first file that does not validate)
    assert files and sorted(p for p, _ in fleets.values()) == files, (files, fleets.keys())
    lanes, locked = set(load_pins(ROOT / "pins.toml").lanes), set(load_lock(ROOT / "pins.lock").lanes)
    for name, (path, fleet) in fleets.items():
        assert find_fleet(ROOT / "hosts", name) == (path, fleet)
        check_against_pins(path, fleet, lanes, locked)


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


def _two_hosts(a: str, b: str, b_ssh: str = "spark@192.0.2.2") -> list[dict[str, object]]:
    return [{"name": a, "ssh": "spark@192.0.2.1", "rank": 0, "role": "head"},
            {"name": b, "ssh": b_ssh, "rank": 1, "role": "worker"}]


def _mixed_inventory(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """A project whose hosts/ holds one good fleet (`good`: good-1, good-2), one file of malformed TOML
    (`broken.toml`) and one that parses but does not validate (`typo`: typo-1, typo-2, a bad ssh)."""
    root = auditlib.make_project(tmp_path / "proj")["pins"].parent
    hosts = root / "hosts"
    hosts.mkdir(exist_ok=True)
    (hosts / "good.toml").write_text(auditlib.fleet_toml("good", _two_hosts("good-1", "good-2")))
    broken = hosts / "broken.toml"
    broken.write_text("[fleet\nname = 'broken'\n")
    typo = hosts / "typo.toml"
    typo.write_text(auditlib.fleet_toml("typo", _two_hosts("typo-1", "typo-2", b_ssh="spark@host:22x")))
    return root, hosts, broken, typo


def test_a_bad_fleet_file_fails_only_what_uses_it(tmp_path: Path) -> None:
    root, hosts, broken, typo = _mixed_inventory(tmp_path)
    path, fleet = find_fleet(hosts, "good")
    assert path == hosts / "good.toml" and fleet.fleet.name == "good"
    assert find_host(hosts, "good-2")[2].rank == 1
    assert find_host(hosts, "good/good-1")[2].role == "head"
    for ask in (lambda: find_fleet(hosts, "typo"), lambda: find_host(hosts, "typo-2"),
                lambda: find_host(hosts, "typo/typo-1")):
        with pytest.raises(ConfigError) as e:
            ask()
        assert str(e.value).startswith(f"{typo}: hosts[1].ssh: ") and "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        find_fleet(hosts, "broken")  # (its TOML does not read: the file's name stands for its fleet's)
    assert str(e.value).startswith(f"{broken}: malformed TOML")
    with pytest.raises(ConfigError) as e:
        load_fleets(hosts)  # every fleet at once: the first bad file fails it
    assert str(e.value).startswith(f"{broken}: ")
    # through the CLI: the good fleet works, the bad files are named where they are used
    r = _cli(root, "hosts", "--fleet", "good")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert [line.split("\t")[:2] for line in r.stdout.splitlines()] == [["good", "good-1"], ["good", "good-2"]]
    r = _cli(root, "hosts", "--fleet", "typo")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith(f"error: {typo}: hosts[1].ssh: ")
    assert len(r.stderr.splitlines()) == 1


def test_the_host_listing_lists_the_good_fleets_and_names_each_bad_file(tmp_path: Path) -> None:
    """`builder hosts` over every fleet: the fleets that validate on stdout, one `error:` line per file
    that does not (file and key), exit 2."""
    root, _, broken, typo = _mixed_inventory(tmp_path)
    for args in (["hosts"], ["hosts", "--json"]):
        r = _cli(root, *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        errors = r.stderr.strip().splitlines()
        assert len(errors) == 2, r.stderr
        assert errors[0].startswith(f"error: {broken}: malformed TOML")
        assert errors[1].startswith(f"error: {typo}: hosts[1].ssh: ")
        names = ([h["name"] for h in json.loads(r.stdout)] if "--json" in args
                 else [line.split("\t")[1] for line in r.stdout.splitlines()])
        assert names == ["good-1", "good-2"]


def test_unknown_fleet_and_host_names_get_the_closest(tmp_path: Path) -> None:
    root, hosts, broken, typo = _mixed_inventory(tmp_path)
    with pytest.raises(ConfigError) as e:
        find_fleet(hosts, "god")
    assert "no fleet named 'god' (did you mean `good`?)" in str(e.value)
    assert f"unreadable: {broken}, {typo}" in str(e.value)
    with pytest.raises(ConfigError) as e:
        find_host(hosts, "goodd-1")
    assert "no host named 'goodd-1' (did you mean `good-1`?)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        find_host(hosts, "good/god-2")
    assert "no host named 'god-2' (did you mean `good-2`?)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        find_fleet(hosts, "zzzz")
    assert "did you mean" not in str(e.value) and "(have: good;" in str(e.value)
    r = _cli(root, "hosts", "--fleet", "goood")
    assert r.returncode == 2 and "(did you mean `good`?)" in r.stderr and len(r.stderr.splitlines()) == 1


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
    """A fleet may name an ssh_config that exists only while its hosts run (the local fleet's is written by
    `python3 -m tests.fleet.local up`): `builder hosts` lists it, and `builder hosts --ansible` over every
    fleet writes it too (the path, for ssh to read when Ansible connects), rather than exit 2 over the
    missing file."""
    root = auditlib.make_project(tmp_path / "proj", lock=False)["pins"].parent
    factory.write_fleet(root, factory.fleet("pending", "demo", [factory.host("spark-1", 0), factory.host("spark-2", 1)],
                                            ssh_config="../.cache/pending/ssh_config"))
    factory.write_fleet(root, factory.fleet("plain", "demo", [factory.host("spark-a", 0, ssh="op@192.0.2.1")]))
    r = _cli(root, "hosts", "--json")
    assert r.returncode == 0, r.stderr
    listed = {(x["fleet"], x["name"]) for x in json.loads(r.stdout)}
    assert listed == {("pending", "spark-1"), ("pending", "spark-2"), ("plain", "spark-a")}
    inv = tmp_path / "inv.yml"
    r = _cli(root, "hosts", "--ansible", str(inv))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    text = inv.read_text()
    written = {(g, h) for g, h in re.findall(r"^    (\S+):\n|^        (\S+):$", text, re.M)}
    assert {h for _, h in written if h} == {name for _, name in listed}
    cfg = (root / "hosts" / "../.cache/pending/ssh_config").resolve()
    assert not cfg.exists()
    assert f'ansible_ssh_common_args: "-F {cfg}"' in text
    ini = tmp_path / "inv.ini"
    assert _cli(root, "hosts", "--fleet", "pending", "--ansible", str(ini)).returncode == 0
    assert f"ansible_ssh_common_args='-F {cfg}'" in ini.read_text()
    if shutil.which("ansible-inventory"):
        p = subprocess.run(["ansible-inventory", "-i", str(inv), "--list"], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible")})
        assert p.returncode == 0, p.stderr
        assert set(json.loads(p.stdout)["_meta"]["hostvars"]) == {name for _, name in listed}


#: the commands that read fleet files (each takes --hosts-dir)
FLEET_READERS = ["launch", "bundle", "verify", "ship", "push", "hosts", "audit", "deploy", "status", "start", "stop"]


def test_the_hosts_folder_and_the_bundles_folder_have_one_default() -> None:
    root = Path("/p")
    assert hosts_folder(root) == root / "hosts"
    assert hosts_folder(root, Path("/elsewhere")) == Path("/elsewhere")
    assert bundles_folder(root, "f", "a") == root / "out" / "bundles" / "f" / "a"
    assert bundles_folder(root, "f") == root / "out" / "bundles" / "f"


def test_every_command_that_reads_fleet_files_takes_hosts_dir() -> None:
    import importlib

    from builder.cli import COMMANDS

    for name in FLEET_READERS:
        module, attr, _ = COMMANDS[name]
        cmd = getattr(importlib.import_module(module), attr)
        assert "--hosts-dir" in [o for p in cmd.params for o in p.opts], name


@pytest.mark.parametrize("args", [
    ["deploy", "--fleet", "nope"], ["status", "--fleet", "nope"], ["start", "--fleet", "nope"],
    ["stop", "--fleet", "nope"], ["push", "demo", "--fleet", "nope"], ["ship", "nope"], ["bundle", "nope"],
])
def test_hosts_dir_is_the_folder_each_command_reads(tmp_path: Path, args: list[str]) -> None:
    """With --hosts-dir, the fleet files are read there and not in hosts/ under the project root: the
    refusal (exit 2, nothing contacted) names that folder."""
    paths = auditlib.make_project(tmp_path / "proj")
    root = paths["pins"].parent
    inv = tmp_path / "inventory"
    _fleet_file(inv, "spark@192.0.2.1")
    r = _cli(root, *args, "--hosts-dir", str(inv))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: {inv}: no "), r.stderr


def test_models_from_the_registry_needs_a_registry(tmp_path: Path) -> None:
    head = '[[hosts]]\nname = "h"\nssh = "h"\nrank = 0\nrole = "head"\n'
    p = tmp_path / "f.toml"
    p.write_text('[fleet]\nname = "a"\nlane = "b"\nmodels_from = "registry"\n' + head)
    with pytest.raises(ConfigError) as e:
        load_fleet(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: fleet: models_from: ") and "fleet.registry" in msg and "\n" not in msg, msg
    p.write_text('[fleet]\nname = "a"\nlane = "b"\nmodels_from = "registry"\n'
                 'registry = "https://spark-head:5000"\n' + head)
    assert load_fleet(p).fleet.models_from == "registry"
    p.write_text('[fleet]\nname = "a"\nlane = "b"\n' + head)
    assert load_fleet(p).fleet.models_from == "bundle"
