"""Derivations: the address (builder.launch.derivplan) and the host side that makes and checks them
(builder.hostscripts.derive), run as the bundle's derive.py is, on real files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from builder.errors import ConfigError
from builder.inputs.hosts import Fleet
from builder.inputs.loader import validate
from builder.inputs.pins import Pins
from builder.launch.derivplan import derivation_runs
from builder.lock.lockfile import Lock, LockedModelFile
from tests.lib import factory

SERVE = {"tensor_parallel": 2, "context": 1, "streams": 1, "port": 8000, "served_name": "m"}
DERIVE = Path(__file__).resolve().parents[1] / "builder" / "hostscripts" / "derive.py"


def plan(tmp_path: Path, script: str, rank: int = 1, world: int = 2, address: str = "a" * 64) -> Path:
    """A derive.json whose one derivation runs `sh -c script` with {out} as $1."""
    p = tmp_path / "derive.json"
    p.write_text(json.dumps({"format": 1, "rank": rank, "world_size": world, "derivations": [{
        "name": "cache", "address": address, "path": str(tmp_path / "derived" / f"cache-{address[:16]}"),
        "output": "/cache", "argv": ["sh", "-c", script, "sh", "{out}"]}]}))
    return p


def derive(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(DERIVE), *args], capture_output=True, text=True, timeout=timeout)


def folder(p: Path) -> Path:
    return Path(json.loads(p.read_text())["derivations"][0]["path"])


def test_made_once_then_held(tmp_path: Path) -> None:
    count = tmp_path / "runs"
    p = plan(tmp_path, f'echo run >> {count}; mkdir -p "$1/rank-cache"; printf abc > "$1/rank-cache/rank1of2-x.bin"; '
                       'printf map > "$1/token_map.json"')
    r = derive("make", str(p))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["derivations"][0]["result"] == "made" and out["derivations"][0]["files"] == 2
    assert "made 2 file(s)" in r.stderr
    rec = json.loads((folder(p) / ".builder-derived.json").read_text())
    assert rec["address"] == "a" * 64 and [f["path"] for f in rec["files"]] == ["rank-cache/rank1of2-x.bin",
                                                                              "token_map.json"]
    assert rec["files"][0]["sha256"] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    r = derive("make", str(p))
    assert json.loads(r.stdout)["derivations"][0]["result"] == "held"
    assert count.read_text().count("run") == 1  # not made again while the address holds
    assert derive("check", str(p), "full").returncode == 0


def test_a_failure_leaves_nothing(tmp_path: Path) -> None:
    p = plan(tmp_path, 'printf half > "$1/partial.bin"; echo "set TF_DS_KIT" >&2; exit 3')
    r = derive("make", str(p))
    assert r.returncode == 1
    res = json.loads(r.stdout)["derivations"][0]
    assert res["result"] == "failed" and "exit 3" in res["why"] and "set TF_DS_KIT" in res["why"]
    assert not folder(p).exists() and list((tmp_path / "derived").iterdir()) == []


def test_killed_half_way_leaves_nothing_under_its_address_and_is_made_again(tmp_path: Path) -> None:
    started = tmp_path / "started"
    p = plan(tmp_path, f'printf x > "$1/rank1of2-a.bin"; touch {started}; sleep 60')
    proc = subprocess.Popen([sys.executable, str(DERIVE), "make", str(p)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline, "the derivation never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not folder(p).exists()
    assert [x.name for x in (tmp_path / "derived").iterdir()][0].startswith(f".tmp-builder-{folder(p).name}.")
    p2 = plan(tmp_path, 'printf y > "$1/rank1of2-a.bin"')
    r = derive("make", str(p2))
    assert r.returncode == 0 and json.loads(r.stdout)["derivations"][0]["result"] == "made"
    assert [x.name for x in (tmp_path / "derived").iterdir()] == [folder(p).name]  # the leftover is gone
    assert (folder(p) / "rank1of2-a.bin").read_text() == "y"


def check(p: Path, mode: str = "fast") -> list[str]:
    r = subprocess.run([sys.executable, "-c", DERIVE.read_text(), json.dumps({"plan": json.loads(p.read_text()),
                                                                              "mode": mode})],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return list(json.loads(r.stdout)["cache"])


def test_drift_is_named(tmp_path: Path) -> None:
    p = plan(tmp_path, 'printf abcdef > "$1/rank1of2-a.bin"; printf m > "$1/map.json"')
    assert derive("make", str(p)).returncode == 0
    f = folder(p)
    assert check(p) == [] and check(p, "full") == []
    (f / "rank1of2-a.bin").write_bytes(b"abc")  # truncated
    assert check(p) == [f"{f}/rank1of2-a.bin: expected 6 bytes, found 3"]
    rec = json.loads((f / ".builder-derived.json").read_text())
    kept = next(x for x in rec["files"] if x["path"] == "rank1of2-a.bin")
    (f / "rank1of2-a.bin").write_bytes(b"abcdeX")  # same size, other bytes: fast mode sees the mtime
    assert check(p) == [f"{f}/rank1of2-a.bin: expected mtime {kept['mtime']}, found "
                        f"{(f / 'rank1of2-a.bin').stat().st_mtime_ns} (modified; fast mode)"]
    os.utime(f / "rank1of2-a.bin", ns=(kept["mtime"], kept["mtime"]))  # ... and its mtime put back: only full
    assert check(p) == [] and check(p, "full") == [f"{f}/rank1of2-a.bin: content differs from the record (sha256)"]
    (f / "rank1of2-a.bin").write_bytes(b"abcdef")
    os.utime(f / "rank1of2-a.bin", ns=(kept["mtime"], kept["mtime"]))
    (f / "rank0of2-a.bin").write_bytes(b"abcdef")  # another rank's file
    (f / "extra.txt").write_bytes(b"x")
    (f / "map.json").unlink()
    assert check(p) == [f"{f}/extra.txt: not in the derivation's record",
                        f"{f}/rank0of2-a.bin: another rank's file (this host is rank 1 of 2)",
                        f"{f}/map.json: missing"]
    other = plan(tmp_path, "true", address="b" * 64)
    assert check(other) == [f"{folder(other)}: not made (no .builder-derived.json; `builder deploy --repair` or "
                            "`builder start` on its fleet makes it)"]


def test_a_full_make_remakes_what_differs_in_content_and_a_fast_one_holds_it(tmp_path: Path) -> None:
    p = plan(tmp_path, 'printf abcdef > "$1/rank1of2-a.bin"; printf m > "$1/map.json"')
    assert derive("make", str(p)).returncode == 0
    f = folder(p)
    target = f / "rank1of2-a.bin"
    st = target.stat()
    target.write_bytes(b"abcdeX")  # changed in place, its size and mtime put back
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = derive("make", str(p))
    assert r.returncode == 0 and json.loads(r.stdout)["derivations"][0]["result"] == "held"
    assert target.read_bytes() == b"abcdeX"  # (what fast mode cannot see: the reason a repair hashes)
    r = derive("make", str(p), "full")
    out = json.loads(r.stdout)["derivations"][0]
    assert r.returncode == 0 and out["result"] == "made", r.stderr
    assert out["differed"] == [f"{target}: content differs from the record (sha256)"]
    assert target.read_bytes() == b"abcdef" and check(p, "full") == []
    assert sorted(x.name for x in f.parent.iterdir()) == [f.name]  # nothing left beside it (no temp, no old one)
    r = derive("make", str(p), "full")
    assert json.loads(r.stdout)["derivations"][0]["result"] == "held"


def _pins_fleet(command: list[str]) -> tuple[Pins, Fleet, Lock]:
    pins = validate(Pins, factory.pins(
        images={"tiny": factory.image("images/tiny")},
        models={"m": factory.model("o/m")},
        lanes={"l": factory.lane(
            "tiny", ["m"], serve=SERVE, mounts=[{"source": "derived:cache", "target": "/cache"}],
            derivations={"cache": {"command": command, "output": "/cache",
                                   "mounts": [{"source": "model:m", "target": "/model"}]}})},
    ), "t")
    fleet = validate(Fleet, factory.fleet("f", "l", [factory.host(f"s{r}", r, address=f"192.0.2.{r + 1}")
                                                     for r in range(2)]), "t")
    files = [LockedModelFile(path="config.json", size=2, sha256="3" * 64),
             LockedModelFile(path="w-r0of2.bin", size=1, sha256="1" * 64),
             LockedModelFile(path="w-r1of2.bin", size=1, sha256="2" * 64)]
    return pins, fleet, factory.lock(models={"m": factory.locked_model(pins.models["m"], files, commit="c" * 40)})


def test_the_address_follows_the_inputs_the_rank_and_the_command() -> None:
    pins, fleet, lock = _pins_fleet(["/engine/make", "/model", "{rank}"])
    r0, r1 = (derivation_runs(pins, lock, fleet, fleet.host(f"s{r}"), "l", "IMG", "f" * 64)[0] for r in (0, 1))
    assert r0.address and r1.address and r0.address != r1.address
    assert r0.path == f"/var/lib/builder/derived/cache-{r0.address[:16]}"
    assert r0.argv[-5:] == ["--entrypoint", "/engine/make", "IMG", "/model", "0"]
    assert r0.argv[r0.argv.index("/srv/models/m:/model:ro") - 1] == "-v"
    assert r0.argv[r0.argv.index("{out}:/cache") - 1] == "-v" and "--network" in r0.argv
    again = derivation_runs(pins, lock, fleet, fleet.host("s0"), "l", "IMG", "f" * 64)[0]
    assert again.address == r0.address  # the same inputs: the same folder
    other_image = derivation_runs(pins, lock, fleet, fleet.host("s0"), "l", "IMG", "e" * 64)[0]
    assert other_image.address != r0.address
    p2, _, _ = _pins_fleet(["/engine/make", "/model", "{rank}", "--more"])
    assert derivation_runs(p2, lock, fleet, fleet.host("s0"), "l", "IMG", "f" * 64)[0].address != r0.address
    unlocked = derivation_runs(pins, None, fleet, fleet.host("s0"), "l", "IMG", None)[0]
    assert unlocked.address is None and unlocked.path.endswith("cache-(unlocked)")


@pytest.mark.parametrize("bad", [{"output": "relative"}, {"mounts": [{"source": "state:x", "target": "/x"}]}])
def test_bad_derivations_are_refused(bad: dict[str, Any]) -> None:
    def pins(**change: Any) -> Pins:
        return validate(Pins, factory.pins(images={"tiny": factory.image("images/tiny")}, lanes={"l": factory.lane(
            "tiny", [], serve=SERVE, derivations={"d": {"command": ["x"], "output": "/o", **change}})}), "t")

    assert pins().lanes["l"].derivations
    with pytest.raises(ConfigError, match=f"^t: lanes.l.derivations.d.{next(iter(bad))}: "):
        pins(**bad)


def test_a_drifted_folder_is_made_again(tmp_path: Path) -> None:
    count = tmp_path / "runs"
    p = plan(tmp_path, f'echo run >> {count}; printf abcdef > "$1/rank1of2-a.bin"')
    assert derive("make", str(p)).returncode == 0
    (folder(p) / "rank1of2-a.bin").write_bytes(b"abc")
    r = derive("make", str(p))
    assert r.returncode == 0 and json.loads(r.stdout)["derivations"][0]["result"] == "made"
    assert "expected 6 bytes, found 3: making it again" in r.stderr
    assert (folder(p) / "rank1of2-a.bin").read_bytes() == b"abcdef" and count.read_text().count("run") == 2


@pytest.mark.parametrize("lose", ["folder", "record"])
def test_a_full_make_counts_a_lost_folder_or_record_as_differed(tmp_path: Path, lose: str) -> None:
    p = plan(tmp_path, 'printf abcdef > "$1/rank1of2-a.bin"')
    assert derive("make", str(p)).returncode == 0
    f = folder(p)
    if lose == "folder":
        shutil.rmtree(f)
    else:
        (f / ".builder-derived.json").unlink()
    r = derive("make", str(p), "full")
    out = json.loads(r.stdout)["derivations"][0]
    assert r.returncode == 0 and out["result"] == "made", r.stderr
    assert out["differed"] == [f"{f}: no record"]  # (what a repair counts: its rank is restarted)
    assert (f / "rank1of2-a.bin").read_bytes() == b"abcdef"


def test_a_first_fast_make_names_nothing_as_differed(tmp_path: Path) -> None:
    p = plan(tmp_path, 'printf abcdef > "$1/rank1of2-a.bin"')
    out = json.loads(derive("make", str(p)).stdout)["derivations"][0]
    assert out["result"] == "made" and "differed" not in out


def test_its_temps_are_named_by_the_core_rule(tmp_path: Path) -> None:
    """derive.py is sent to hosts as its source alone, so it keeps its own copy of builder.core's
    temp-naming rule: what it leaves beside a folder is what the core's cleaner finds."""
    from builder.core import atomic
    from builder.hostscripts import derive as host_derive
    path = str(tmp_path / "cache-0123")
    assert host_derive.tmp_stem(path) == atomic.tmp_stem(path)
    made, aside = host_derive.tmp_name(path), host_derive.tmp_name(path, "old-")
    os.mkdir(made)
    os.mkdir(aside)
    (tmp_path / "cache-0123").mkdir()
    assert atomic.clean_stale_tmp(path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache-0123"]


def test_the_old_folder_is_put_back_when_the_new_one_cannot_go_in(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from builder.hostscripts import derive as host_derive
    path = tmp_path / "cache"
    tmp = Path(host_derive.tmp_name(str(path)))
    path.mkdir()
    (path / "old.bin").write_bytes(b"old")
    tmp.mkdir()
    (tmp / "new.bin").write_bytes(b"new")
    real = os.rename

    def rename(src: str, dst: str) -> None:
        if src == str(tmp):
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(host_derive.os, "rename", rename)
    why = host_derive.place(str(tmp), str(path))
    assert why.startswith(f"cannot put {path} in place:") and "No space left" in why
    assert (path / "old.bin").read_bytes() == b"old"
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted(["cache", tmp.name])  # no old one left aside


#: a stand-in for the docker CLI with the one behaviour that matters here: `docker run` starts the
#: container as a process of its own (it outlives a killed client, as a real container does) and waits
#: for it; `docker rm -f -v NAME` ends it. Every call is logged.
FAKE_DOCKER = """#!/usr/bin/env python3
import os, signal, subprocess, sys
state = os.environ["FAKE_DOCKER_STATE"]
args = sys.argv[1:]
with open(os.path.join(state, "calls"), "a") as f:
    f.write(" ".join(args[:1] + [a for a in args if a.startswith("builder-")]) + "\\n")
if args[:1] == ["run"]:
    name = args[args.index("--name") + 1]
    c = subprocess.Popen(["sleep", "300"], start_new_session=True)
    open(os.path.join(state, name), "w").write(str(c.pid))
    sys.exit(c.wait())
if args[:3] == ["rm", "-f", "-v"]:
    try:
        pid = int(open(os.path.join(state, args[3])).read())
    except FileNotFoundError:
        sys.exit("Error: No such container: " + args[3])
    os.kill(pid, signal.SIGKILL)
    os.unlink(os.path.join(state, args[3]))
    print(args[3])
"""


@pytest.mark.parametrize("named", [True, False])
def test_a_timeout_removes_the_container_and_a_left_one_goes_before_the_next_run(tmp_path: Path, named: bool) -> None:
    bin_dir, state = tmp_path / "bin", tmp_path / "docker"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    name = "builder-derive-demo-cache-r1" if named else "builder-derive-cache-r1"
    left = subprocess.Popen(["sleep", "300"], start_new_session=True)  # a killed run's container, still up
    (state / name).write_text(str(left.pid))
    argv = ["docker", "run", "--rm", "--network", "none", *(["--name", name] if named else []), "img", "{out}"]
    p = tmp_path / "derive.json"
    p.write_text(json.dumps({"format": 1, "rank": 1, "world_size": 2, "derivations": [{
        "name": "cache", "address": "a" * 64, "path": str(tmp_path / "derived" / "cache"), "output": "/cache",
        "timeout": 1, "argv": argv}]}))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_DOCKER_STATE": str(state)}
    r = subprocess.run([sys.executable, str(DERIVE), "make", str(p)], capture_output=True, text=True, timeout=120,
                       env=env)
    try:
        assert r.returncode == 1, r.stderr
        res = json.loads(r.stdout)["derivations"][0]
        assert res["result"] == "failed" and res["why"] == f"no end within 1 s; its container {name} removed"
        assert (state / "calls").read_text().splitlines() == [f"rm {name}", f"run {name}", f"rm {name}"]
        left.wait(timeout=10)  # the one left before: removed before the run
        assert sorted(x.name for x in state.iterdir()) == ["calls"]  # the run's own: removed at its timeout
        assert list((tmp_path / "derived").iterdir()) == []
    finally:
        if left.poll() is None:
            left.kill()
            left.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_mid_run_removes_the_container_and_the_folder(tmp_path: Path, sig: signal.Signals) -> None:
    """The step's ssh channel gone, the host's watchdog TERMs derive.py (a hang-up likewise): the container
    (its fixed name) is removed and the half-made folder with it, the exit code says the signal; nothing is
    left for the next run to find."""
    bin_dir, state = tmp_path / "bin", tmp_path / "docker"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    name = "builder-derive-demo-cache-r1"
    argv = ["docker", "run", "--rm", "--network", "none", "--name", name, "img", "{out}"]
    p = tmp_path / "derive.json"
    p.write_text(json.dumps({"format": 1, "rank": 1, "world_size": 2, "derivations": [{
        "name": "cache", "address": "a" * 64, "path": str(tmp_path / "derived" / "cache"), "output": "/cache",
        "timeout": 300, "argv": argv}]}))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_DOCKER_STATE": str(state)}
    proc = subprocess.Popen([sys.executable, str(DERIVE), "make", str(p)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 60
    while not (state / name).exists():  # the container runs
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    pid = int((state / name).read_text())
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert f"ended by signal {int(sig)}" in err
    assert (state / "calls").read_text().splitlines() == [f"rm {name}", f"run {name}", f"rm {name}"]
    assert not (state / name).exists() and list((tmp_path / "derived").iterdir()) == []
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # (the fake's container, SIGKILLed by its `rm -f`, is reaped by its parent)
            os.kill(pid, 0)
            time.sleep(0.05)
