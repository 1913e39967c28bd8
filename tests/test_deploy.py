"""`builder deploy`, `builder status`, `builder start`, `builder stop`.

Fast tier: the report's exit codes, the fleet lock, the journal, the bundle currency rule, config errors.
Docker tier: the installer's stage and switch (what a deploy builds on), on local roots.
Fleet tier (tests/lib/journeylib.py: the project copy, the shipped pins, the real image, bundles and
installer, a FAKE nvidia-smi on each host): through the CLI only, `builder deploy --fleet ...` of a first
lock, of a second (a changed serve setting: every host switches), of a third whose engine refuses its
arguments at start (the whole fleet back on the second, serving and passing its audit), of a rank that
never answers (bounded), refused while another GPU workload runs, a host cut off during ship (nothing
switched), two deploys at once, SIGKILL at several points then a rerun (every host on the new release,
or every host on the old one), and start/stop in rank order; a bystander container on every host that
is not the lane's is never touched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest

from builder.audit.run import run_audit
from builder.audit.selection import AuditOptions
from builder.bundle import launch_manifest, load_bundle_inputs, rank_launch
from builder.deploy import journal as J
from builder.deploy.bundles import FleetBundle, current_bundle, ensure_bundles, why_stale
from builder.deploy.fleetaudit import audit
from builder.deploy.fleetlock import fleet_lock
from builder.deploy.fleetwork import Fleetwork
from builder.deploy.hoststate import Container, HostState
from builder.deploy.options import DeployOptions
from builder.deploy.report import DeployReport, FleetResult, HostOutcome, Outcome, Side
from builder.deploy.rollout import record_drift
from builder.deploy.status import FleetStatus, HostStatus
from builder.errors import BuilderError, ConfigError
from builder.foundation import sign
from builder.foundation.ssh import with_parent
from builder.hostscripts import tied
from builder.inputs.hosts import find_fleet
from builder.lock.lockfile import load_lock
from tests.lib import auditlib, clirun, factory, fleetlib
from tests.lib import bundlelib as bl
from tests.lib import deploylib as dl
from tests.lib.bundlelib import bundle, install, run_installer
from tests.lib.journeylib import PATHS, Journey, edit_on, fleet_toml, journey

# --------------------------------------------------------------------------- fast tier


def test_exit_codes_follow_the_result() -> None:
    def rep(result: str, **kw: Any) -> DeployReport:
        r = DeployReport(fleet="f", lane="l", result=result, **kw)
        r.hosts = [HostOutcome("a", 0, "head", on="new"), HostOutcome("b", 1, "worker", on="old")]
        return r

    assert rep("deployed").exit_code == 0 and rep("planned").exit_code == 0
    assert rep("refused").exit_code == 1 and rep("rolled-back").exit_code == 1
    assert rep("refused", unreachable=True).exit_code == 3 and rep("failed", unreachable=True).exit_code == 3
    assert rep("unchanged", audit={"exit": 1}).exit_code == 1 and rep("unchanged", audit={"exit": 0}).exit_code == 0
    assert rep("failed").to_json()["fleet_on"] == "mixed"


def documented(after: str) -> list[str]:
    """The values docs/deploy.md gives in the table, or the sentence, that follows the line
    starting with `after`: each row's first cell, or each `value` followed by its meaning."""
    lines = (Path(__file__).resolve().parent.parent / "docs" / "deploy.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(after))
    if not lines[start].rstrip().endswith(":"):  # a sentence: `value` (meaning), ...
        para = " ".join(lines[start:lines.index("", start)])
        return re.findall(r"`([a-z-]+)` \(", para.split(":", 1)[1])
    rows = []
    for ln in lines[start + 2:]:
        if ln.startswith("| `"):
            rows.append(ln.split("`")[1])
        elif rows:
            break
    return rows


def test_the_documented_results_are_the_reports_values() -> None:
    assert documented("A host's `result`") == list(get_args(Outcome))
    assert documented("A host's `on`") == list(get_args(Side))
    assert documented("The fleet's `result`") == list(get_args(FleetResult))


def test_the_burn_window_runs_only_where_the_gate_could_not_burn(monkeypatch: pytest.MonkeyPatch) -> None:
    """builder.deploy.switch.burn_window: the hosts whose gate skipped the burn because the lane held
    the GPU get it between stop and start (`--only burn`); a failing GPU raises, naming it."""
    from types import SimpleNamespace

    from builder.audit.findings import AuditReport, CheckOutcome, HostResult
    from builder.deploy import switch
    from builder.deploy.switch import burn_window

    asked: list[tuple[list[str] | None, list[str] | None]] = []
    latched = HostResult("s2", "f", "unhealthy", checks=[
        CheckOutcome("burn::gpu", "burn", "fail", "GPU 0 clock latch: ...; fix: power-cycle", {"kind": "hardware"})])

    def deployment(facts: dict[str, Any], result: HostResult) -> Any:
        def fleet_audit(w: Any, phase: str, only: list[str] | None = None, hosts: list[str] | None = None) -> Any:
            asked.append((only, hosts))
            return AuditReport([result], "fast", phase, ["burn"])
        monkeypatch.setattr(switch, "audit", fleet_audit)  # (a FAKE audit: the report the gate would give)
        skipped = {"status": "skip", "message": "the lane's own release is on the GPU"}
        gate = {"hosts": {"s1": {"checks": {"burn::gpu": {"status": "pass"}}},
                          "s2": {"checks": {"burn::gpu": skipped | ({"facts": facts} if facts else {})}}}}
        return SimpleNamespace(rep=SimpleNamespace(audit=gate), w=SimpleNamespace())

    burn_window(deployment({}, latched))  # (a skip for another reason: no burn in the profile)
    assert asked == []
    with pytest.raises(BuilderError, match=r"the burn failed with the GPUs free: s2: burn::gpu: GPU 0 clock latch"):
        burn_window(deployment({"deferred": True}, latched))
    assert asked == [(["burn"], ["s2"])]  # only the host that deferred its burn
    burn_window(deployment({"deferred": True}, HostResult("s2", "f", "pass")))


#: one side of the race: at each slot's start, take the fleet lock (as `builder TAG`), hold it a moment;
#: print per round "held" or the refusal's line
LOCK_RACER = """
import os, sys, time
from pathlib import Path
from builder.deploy.fleetlock import fleet_lock
from builder.errors import BuilderError
store, tag, other, t0, rounds = Path(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
def tried(i, who):
    return store / f"tried-{i}-{who}"
for i in range(rounds):
    while time.time() < t0 + i * 0.4:
        pass
    try:
        with fleet_lock(store, f"f{i}", tag):
            print(i, "held", flush=True)
            tried(i, tag).touch()
            # the holder lets go only once the other has tried this round's lock: however late the
            # machine's load lets the other start, it finds the lock held
            deadline = time.monotonic() + 120
            while not tried(i, other).exists() and time.monotonic() < deadline:
                time.sleep(0.005)
    except BuilderError as e:
        print(i, "refused", e, flush=True)
        tried(i, tag).touch()
"""


def test_two_commands_started_at_once_the_refused_one_names_the_holder(tmp_path: Path) -> None:
    """Two real processes take one fleet's lock at the same moment, round after round: one holds it, and
    the other's refusal names the holder's command and pid every time, however close together they came."""
    rounds, t0 = 25, time.time() + 2.0
    pair = {"deploy": "stop", "stop": "deploy"}
    procs = {tag: subprocess.Popen([sys.executable, "-c", LOCK_RACER, str(tmp_path), tag, other, str(t0), str(rounds)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clirun.environment())
             for tag, other in pair.items()}
    said = {}
    for tag, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        said[tag] = dict(line.split(" ", 1) for line in out.splitlines())
    pids = {tag: p.pid for tag, p in procs.items()}
    for i in map(str, range(rounds)):
        outcome = {tag: said[tag][i] for tag in procs}
        held = [tag for tag, o in outcome.items() if o == "held"]
        assert len(held) == 1, outcome  # (both start at the slot's start; the holder waits for the other's try)
        other = pair[held[0]]
        assert outcome[other].startswith("refused "), outcome
        assert f"(`builder {held[0]}`, pid {pids[held[0]]}, since " in outcome[other], outcome


def test_fleet_lock_refuses_a_second_holder_and_names_the_first(tmp_path: Path) -> None:
    with fleet_lock(tmp_path, "f", "deploy"):
        code = (
            "import sys; from pathlib import Path; from builder.deploy.fleetlock import fleet_lock\n"
            "try:\n    with fleet_lock(Path(sys.argv[1]), 'f', 'stop'): print('got it')\n"
            "except Exception as e: print(e)\n"
        )
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True).stdout
        assert "another command holds" in out and "`builder deploy`" in out and f"pid {os.getpid()}" in out
        with pytest.raises(BuilderError, match="never interleave"):
            with fleet_lock(tmp_path, "f", "start"):
                pass
    with fleet_lock(tmp_path, "f", "stop"):  # released with its holder
        pass
    with fleet_lock(tmp_path, "g", "deploy"), fleet_lock(tmp_path, "h", "deploy"):  # other fleets: their own
        pass


def test_journal_round_trip_and_snapshot(tmp_path: Path) -> None:
    j = J.Journal(fleet="f", target={"a": "1" * 64}, origin={"a": None}, origin_locks={"a": None}, target_lock="2" * 64)
    J.save(tmp_path, j)
    assert J.load(tmp_path, "f") == j and J.load(tmp_path, "g") is None
    J.clear(tmp_path, "f")
    assert J.load(tmp_path, "f") is None
    (tmp_path / "deploy").mkdir(exist_ok=True)
    J.journal_path(tmp_path, "f").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read"):  # unreadable: an error naming it, never "none"
        J.load(tmp_path, "f")
    J.clear(tmp_path, "f")
    root = tmp_path / "proj"
    (root / "images" / "demo").mkdir(parents=True)
    (root / "images" / "demo" / "Dockerfile").write_text("FROM scratch\n")
    factory.write_pins(root, factory.pins())
    (root / "pins.lock").write_text("{}\n")
    d = J.snapshot(tmp_path, "3" * 64, root / "pins.toml", root / "pins.lock", root, "images/demo")
    assert J.find_snapshot(tmp_path, "3" * 64) == d
    assert (d / "images" / "demo" / "Dockerfile").read_text() == "FROM scratch\n"
    assert J.find_snapshot(tmp_path, "4" * 64) is None and J.find_snapshot(tmp_path, None) is None


def test_status_counts_an_unfinished_deploy_as_not_deployed() -> None:
    st = FleetStatus(fleet="f", lane="l", lock_hash="a" * 64, image_id=None)
    st.hosts = [HostStatus("h0", 0, "head", up=True, on_lock=True),
                HostStatus("h1", 1, "worker", up=True, on_lock=True)]
    assert st.exit_code == 0
    st.deploy, st.deploy_phase, st.resume = "a deploy did not finish", "verifying", "builder deploy --fleet f"
    assert st.exit_code == 1 and "not deployed" in st.summary and "verifying" in st.summary
    d = st.to_json()
    assert d["exit"] == 1 and d["deploy_phase"] == "verifying" and d["resume"] == "builder deploy --fleet f"
    assert J.rolling_back(J.Journal("f", {}, {}, {}, "", phase="restarting-old"))
    assert not J.rolling_back(J.Journal("f", {}, {}, {}, "", phase="starting"))


def test_a_step_ends_with_its_command(tmp_path: Path) -> None:
    """builder.hostscripts.tied + with_parent: a command killed alone (SIGKILL) ends its steps' children;
    a step whose command runs on ends normally, its output and exit status passed through."""
    mark = tmp_path / "mark"
    ok = subprocess.run(["sh", "-c", tied("echo out; echo err >&2; exit 3")], capture_output=True, text=True)
    assert (ok.returncode, ok.stdout, ok.stderr) == (3, "out\n", "err\n")
    ok = subprocess.run(with_parent(["sh", "-c", "read x; echo got $x; exit 4"]), input="in\n", capture_output=True,
                        text=True)
    assert (ok.returncode, ok.stdout) == (4, "got in\n")
    with pytest.raises(FileNotFoundError):  # (a missing program is the caller's to report, as without it)
        subprocess.run(with_parent([str(tmp_path / "no-such-program")]))
    code = (
        "import subprocess, sys; from builder.foundation.ssh import with_parent; from builder.hostscripts import tied\n"
        f"subprocess.run(with_parent(['sh', '-c', tied('sleep 2; touch {mark}')]), capture_output=True)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(1.0)
    p.kill()
    p.wait()
    time.sleep(3.0)
    assert not mark.exists()


def test_no_code_runs_between_fork_and_exec() -> None:
    """A preexec_fn runs Python in the child of a program with threads, where a lock another thread held
    at the fork (malloc's, the import lock, dlopen's) never comes free: builder passes none."""
    src = Path(__file__).resolve().parents[1] / "builder"
    users = [str(p.relative_to(src)) for p in sorted(src.rglob("*.py")) if re.search(r"preexec_fn\s*=", p.read_text())]
    assert users == []


def test_a_rank_is_up_only_on_one_running_container_of_its_bundle() -> None:
    c = Container(id="x", name="builder-demo-r0", state="running", bundle="b1", image="i", status="Up")
    st = HostState(host="h", current="b1", applied={"bundle_id": "b1"}, containers=[c])
    assert st.installed == "b1" and st.up_on("b1") and not st.up_on("b2") and not st.up_on(None)
    st.containers = [c, Container("y", "old", "running", "b0", "i", "Up")]
    assert not st.up_on("b1")
    st.containers = [Container("x", "builder-demo-r0", "exited", "b1", "i", "Exited (2)")]
    assert not st.up_on("b1")
    assert HostState(host="h", current="b1", applied={"bundle_id": "b0"}).installed is None  # record disagrees


def test_a_deploy_makes_its_stale_bundles_in_one_call_of_the_fleet_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundles a deploy makes again are made together: the lane check and the registry's preflights
    run once for the fleet, whether every host's bundle is stale or one; a bundle just made is fresh
    (what its launch decides is what its manifest holds), and a deploy of what is there makes none.
    The steps are the real ones, counted as they are called."""
    from builder.bundle import make

    p = bl.make_project(tmp_path)
    ctx = load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)
    fleet_path, fleet = find_fleet(ctx.hosts_dir, bl.FLEET)
    calls: list[str] = []

    def counted(name: str) -> None:
        real = getattr(make, name)

        def call(*args: Any, **kw: Any) -> Any:
            calls.append(name)
            return real(*args, **kw)

        monkeypatch.setattr(make, name, call)

    for name in ("check_lane", "registry_preflight", "models_preflight", "render_bundle"):
        counted(name)

    def deploy() -> tuple[dict[str, FleetBundle | str], list[str]]:
        said: list[str] = []
        calls.clear()
        made = ensure_bundles(ctx, fleet_path, fleet, key=p.key, with_image=False, with_models=False,
                              part_size="4KiB", say=said.append)
        return made, said

    made, said = deploy()
    names = [h.name for h in fleet.by_rank()]
    assert len(names) == 2 and list(made) == names
    assert all(isinstance(b, FleetBundle) and b.made for b in made.values()), made
    assert sorted(calls) == sorted(["check_lane", "registry_preflight", "models_preflight", *["render_bundle"] * 2])
    assert [ln for ln in said if "making its bundle" in ln] == [f"{n}: making its bundle (no bundle yet)"
                                                                 for n in names], said
    first = {n: b.bundle_id for n, b in made.items() if isinstance(b, FleetBundle)}

    made, said = deploy()
    assert calls == [] and said == [] and all(isinstance(b, FleetBundle) and not b.made for b in made.values())

    shutil.rmtree(bundle_dir_of(p, names[1]))
    made, said = deploy()
    assert sorted(calls) == ["check_lane", "models_preflight", "registry_preflight", "render_bundle"]
    a, b = made[names[0]], made[names[1]]
    assert isinstance(a, FleetBundle) and not a.made and a.bundle_id == first[names[0]]
    assert isinstance(b, FleetBundle) and b.made and b.bundle_id == first[names[1]]  # (the same inputs)
    assert [ln for ln in said if "making its bundle" in ln] == [f"{names[1]}: making its bundle (no bundle yet)"]


def bundle_dir_of(p: bl.Project, host: str) -> Path:
    return p.root / "out" / "bundles" / bl.FLEET / host


def test_bundle_currency_names_what_differs(tmp_path: Path) -> None:
    """A bundle just made holds what its rank's launch decides (though its install.pyz is in parts),
    and each part of that, changed, is named as the reason it is made again; so is what the deploy
    asks it to carry."""
    p = bl.make_project(tmp_path)
    ctx = load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)
    fleet_path, fleet = find_fleet(ctx.hosts_dir, bl.FLEET)
    made = ensure_bundles(ctx, fleet_path, fleet, key=p.key, with_image=False, with_models=False,
                          part_size="4KiB")
    host = fleet.by_rank()[0]
    bundled = made[host.name]
    assert isinstance(bundled, FleetBundle)
    m = bundled.manifest
    want = launch_manifest(rank_launch(ctx, fleet, host, fleet.fleet.lane))
    assert any(f.get("parts") for f in m["files"]) and m["models"], m  # (what the manifest adds to it)
    assert why_stale(m, want, False, False) is None
    assert why_stale({**m, "lock_hash": "K"}, want, False, False) == "lock_hash differs"
    assert why_stale({**m, "paths": {**m["paths"], "models": "/elsewhere"}}, want, False, False) == \
        "paths.models differs"
    assert why_stale({**m, "image": {**m["image"], "image_id": "sha256:" + "2" * 64}}, want, False, False) == \
        "image.image_id differs"
    models = [{**m["models"][0], "sha256": "0" * 64}, *m["models"][1:]]
    assert why_stale({**m, "models": models}, want, False, False) == "its model files differ from the lock's"
    assert why_stale({**m, "models": m["models"][1:]}, want, False, False) == "its model files differ from the lock's"
    files = [{**f, "sha256": "0" * 64} if f["path"] == "start.sh" else f for f in m["files"]]
    assert why_stale({**m, "files": files}, want, False, False) == "start.sh differs"
    assert why_stale({**m, "files": [f for f in m["files"] if f["path"] != "install.pyz"]}, want, False, False) == \
        "install.pyz differs"
    assert why_stale(m, want, True, False) == "it carries no image (--with-image)"
    assert why_stale(m, want, False, True) == "it carries no model files (--with-models)"


def test_bundles_made_again_name_their_key_and_a_home_key_needs_asking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundles a deploy makes again are signed by the key `builder bundle` would choose, named once
    (path, key id, what named it); the home folder's keygen default is refused unless allowed."""
    p = bl.make_project(tmp_path)
    ctx = load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)
    fleet_path, fleet = find_fleet(ctx.hosts_dir, bl.FLEET)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))
    home_key = tmp_path / "home" / ".config" / "builder" / "builder.key"
    home_key.parent.mkdir(parents=True)
    sign.generate_keypair(home_key, home_key.with_suffix(".pub"))
    said: list[str] = []
    with pytest.raises(ConfigError, match=f"^{re.escape(str(home_key))}: signing key outside the project"):
        ensure_bundles(ctx, fleet_path, fleet, key=None, with_image=False, with_models=False, part_size="256MiB",
                       say=said.append)
    made = ensure_bundles(ctx, fleet_path, fleet, key=None, allow_outside_key=True, with_image=False,
                          with_models=False, part_size="256MiB", say=said.append)
    assert made and all(isinstance(b, FleetBundle) and b.made for b in made.values())
    key_id = sign.load_secret_key(home_key).public_key.key_id_hex
    assert said.count(f"signing bundles with {home_key} (key id {key_id}, from the keygen default)") == 1, said
    assert not any(home_key.read_text().splitlines()[1] in line for line in said)


def test_unknown_fleet_is_one_line_and_exit_2(tmp_path: Path, project_root: Path) -> None:
    for cmd in (["deploy", "--fleet", "nope"], ["status", "--fleet", "nope"], ["start", "--fleet", "nope"],
                ["stop", "--fleet", "nope"]):
        p = clirun.run(*cmd, cwd=project_root, store=tmp_path / "store", timeout=120)
        assert p.returncode == 2, (cmd, p.stderr)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "no fleet named 'nope'" in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_a_repair_has_no_dry_run(tmp_path: Path, project_root: Path) -> None:
    p = clirun.run("deploy", "--fleet", "f", "--repair", "--dry-run", cwd=project_root, store=tmp_path / "store",
                   timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and "--repair with --dry-run" in lines[0], p.stderr


def test_a_fleet_commands_audit_takes_the_fleet_pins_and_lock_it_loaded(tmp_path: Path, project_root: Path) -> None:
    """The audits of a deploy, start or status (builder.deploy.fleetaudit) run on the fleet file, pins and
    lock the command loaded at its start: with all three unreadable on disk after that, the audit still
    runs (here on this machine, testinfra's local backend) and checks against the lock it loaded, while
    an audit that reads them from disk refuses (exit 2). A rolled-back release's audit takes the loaded
    fleet and the pins and lock kept with that release."""
    paths = auditlib.make_project(tmp_path / "proj")
    fleet_file = paths["hosts"] / "l.toml"
    fleet_file.write_text(auditlib.fleet_toml("l", [auditlib.local_host(tmp_path)], expect={"docker": False}))
    lock_hash = load_lock(paths["lock"]).lock_hash()
    (tmp_path / "b" / "state").mkdir(parents=True)
    (tmp_path / "b" / "state" / "applied.json").write_text(json.dumps(
        {"host": "me", "fleet": "l", "lane": "demo", "rank": 0, "lock_hash": lock_hash}))
    opts = DeployOptions(root=paths["pins"].parent, pins=paths["pins"], lock=paths["lock"], store=paths["store"],
                         fleet="l", checks_dir=project_root / "checks", connect_timeout=5)
    snap = tmp_path / "snapshot"  # (what a deploy keeps of the pins and lock it deployed from)
    shutil.copytree(opts.root / "images", snap / "images")
    for p in (paths["pins"], paths["lock"]):
        shutil.copyfile(p, snap / p.name)
    w = Fleetwork(opts, lambda _: None, strict=False)
    try:
        for p in (paths["pins"], paths["lock"], fleet_file):
            p.write_text("not [ what it was\n")
        reports = [audit(w, "preflight", only=["release"]), audit(w, "preflight", only=["release"], snapshot=snap)]
    finally:
        w.close()
    for report in reports:
        host = report.to_json()["hosts"]["me"]
        assert list(report.to_json()["hosts"]) == ["me"] and host["status"] != "error", host
        assert host["checks"]["release::record_lock"]["status"] == "pass", host["checks"]["release::record_lock"]
    with pytest.raises(ConfigError, match=r"l\.toml"):
        run_audit(AuditOptions(root=opts.root, pins=opts.pins, lock=opts.lock, store=opts.store, fleet="l",
                               checks_dir=opts.checks_dir, only=["release"]))


# --------------------------------------------------------------------------- docker tier: stage and switch


@pytest.mark.docker
def test_installer_stages_without_switching_then_switches_and_back(tmp_path: Path) -> None:
    if not shutil.which("docker"):
        pytest.skip("no docker CLI")
    p = bl.make_project(tmp_path, hosts=bl.local_hosts(tmp_path / "host"), docker_image=True, marker="deploy-stage")
    root = tmp_path / "host" / "builder"
    v1 = bundle(p, tmp_path / "v1", with_image=True, with_models=True)
    id1 = bl.manifest(v1)["bundle_id"]
    r = install(v1, root, "--trusted-key", str(p.pub), "--host", "spark-b")
    assert r.returncode == 0, r.stderr
    bl.relock(p, streams=3)
    v2 = bundle(p, tmp_path / "v2")
    id2 = bl.manifest(v2)["bundle_id"]
    applied = (root / "state" / "applied.json").read_bytes()

    r = install(v2, root, "--stage")
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "staged", r.stderr
    assert os.readlink(root / "current") == f"releases/{id1}" and os.readlink(root / "staged") == f"releases/{id2}"
    assert (root / "state" / "applied.json").read_bytes() == applied  # the installed release is untouched
    staged = json.loads((root / "state" / "staged.json").read_text())
    assert (staged["bundle_id"], staged["action"], staged["previous_bundle_id"]) == (id2, "stage", id1)
    st = json.loads(run_installer("status", "--root", str(root)).stdout)
    assert st["staged"] == id2 and st["current"] == id1 and sorted(st["releases"]) == sorted([id1, id2])

    r = run_installer("switch", "--root", str(root), "--to", id2)
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "switched", r.stderr
    assert os.readlink(root / "current") == f"releases/{id2}" and os.readlink(root / "previous") == f"releases/{id1}"
    assert not (root / "staged").exists() and not (root / "state" / "staged.json").exists()
    rec = json.loads((root / "state" / "applied.json").read_text())
    assert (rec["bundle_id"], rec["action"], rec["previous_bundle_id"]) == (id2, "install", id1)
    r = run_installer("switch", "--root", str(root), "--to", id2)
    assert json.loads(r.stdout)["result"] == "unchanged"

    # back to any installed release (what a deploy's rollback does), recorded as a rollback
    r = run_installer("switch", "--root", str(root), "--to", id1, "--rollback")
    assert r.returncode == 0, r.stderr
    rec = json.loads((root / "state" / "applied.json").read_text())
    assert (rec["bundle_id"], rec["action"], rec["previous_bundle_id"]) == (id1, "rollback", id2)
    # a release already on the host is staged without its bundle
    r = run_installer("stage", "--root", str(root), "--release", id2)
    assert r.returncode == 0 and os.readlink(root / "staged") == f"releases/{id2}", r.stderr
    # refusals: no such release; a damaged one
    r = run_installer("switch", "--root", str(root), "--to", "5" * 64)
    assert r.returncode == 1 and "no release" in r.stderr
    (root / "releases" / id2 / "start.sh").write_text("#!/bin/sh\n")
    r = run_installer("switch", "--root", str(root), "--to", id2)
    assert r.returncode == 1 and "damaged" in r.stderr
    assert os.readlink(root / "current") == f"releases/{id1}"
    subprocess.run(["docker", "image", "rm", "-f", p.image_id], capture_output=True)


# --------------------------------------------------------------------------- fleet tier

GPU_EXPECT = auditlib.H200_EXPECT
ARGS = ["serve", "--host", "{host}", "--port", "{port}", "--served-name", "{served_name}"]
APPS = "/etc/fake-nvidia-smi/apps"
PATHS_BUNDLES = PATHS["bundles"]


@pytest.fixture(scope="module")
def j(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Journey]:
    """Two hosts with nothing installed (no bundle made yet): `builder deploy` does the rest."""
    if not fleetlib.docker_available():
        pytest.fail("Docker Engine not reachable: the deploy tests need it")
    with journey(
        tmp_path_factory.mktemp("deploy"), 2, name="dep", expect=GPU_EXPECT, prepare=auditlib.install_fake_on,
        bundle=False,
    ) as jj:
        yield jj


def _args(j: Journey, *extra: str) -> list[str]:
    # (a short stop timeout bounds a stop whatever the engine does with SIGTERM)
    return ["--key", str(j.keys / "builder.key"), "--with-image", "--with-models", "--stop-timeout", "2",
            "--start-timeout", "60", "--connect-timeout", "5", *extra]


def _deploy(j: Journey, *extra: str) -> tuple[int, dict[str, Any]]:
    return j.deploy(*_args(j, *extra))


def _status(j: Journey) -> tuple[int, dict[str, Any]]:
    p = j.builder("status", "--fleet", j.name, "--json", check=False)
    return p.returncode, json.loads(p.stdout)


def _deployed(j: Journey) -> dict[str, str]:
    """Deploy the copy's lock; it must end deployed with every host on its new bundle. Returns them."""
    rc, rep = _deploy(j)
    assert rc == 0 and rep["result"] == "deployed", (rc, rep.get("reason"), j.last_stderr[-3000:])
    want = dl.bundle_ids(j)
    dl.assert_on(j, want)
    assert rep["fleet_on"] == "new" and {h: r["target"] for h, r in rep["hosts"].items()} == want
    return want


def _good(j: Journey) -> dict[str, str]:
    """The fleet on a known good release, serving (whatever an earlier test left)."""
    j.set_lane(start="workers-first", relock=False)
    j.set_serve(args=ARGS)
    for h in j.fleet.hosts:
        j.fleet.exec(h, f"rm -f {APPS}")
    rc, rep = _deploy(j)
    assert rc == 0 and rep["result"] in ("deployed", "unchanged"), (rc, rep.get("reason"))
    want = dl.bundle_ids(j)
    dl.assert_on(j, want)
    return want


_context = iter(range(5000, 9000, 16))


def _new_release(j: Journey) -> None:
    """A changed serve setting (context), relocked: every host gets a new bundle."""
    j.set_serve(context=next(_context))


@pytest.fixture
def bystanders(j: Journey) -> Iterator[None]:
    """Another lane's container on every host (so a test run alone has them too), checked untouched after."""
    _good(j)
    dl.start_bystanders(j)
    yield
    running = dl.bystanders_running(j)
    assert running == {h.name: True for h in j.fleet.hosts}, ("a deploy touched a bystander", {
        h.name: j.fleet.exec(h, f"docker inspect -f '{{{{.State}}}}' {dl.BYSTANDER}; docker logs {dl.BYSTANDER}",
                             check=False).stdout[-600:] for h in j.fleet.hosts if not running[h.name]})


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_dry_run_first_deploy_a_no_op_and_a_changed_serve_setting(j: Journey) -> None:
    rc, rep = _deploy(j, "--dry-run")
    assert rc == 0 and rep["result"] == "planned", j.last_stderr
    assert rep["steps"] and all(r["plan"] for r in rep["hosts"].values())
    assert not (j.root / "out" / "bundles").exists()  # nothing was made ...
    assert all(dl.current(j, h) is None and not dl.lane_containers(j, h) for h in j.fleet.hosts)  # ... or changed

    first = _deployed(j)  # bundles made, shipped, gated, started workers-then-head, audited
    rc, st = _status(j)
    assert rc == 0 and all(h["up"] and h["on_lock"] and h["bundle"] == first[n] for n, h in st["hosts"].items()), st
    # the demo lane's gates ran on the head; their answers are the release's serving record, in the
    # operator's store and on the head, and status shows it
    head_name = j.fleet.hosts[0].name
    store = Path(j.env.get("BUILDER_STORE") or j.root / ".cache" / "builder")
    rec = json.loads((store / "deploy" / "serving" / j.name / f"{first[head_name]}.json").read_text())
    assert rec["gates"] == {"models": True, "chat_probe": True, "burst": True, "concurrent_equals_solo": True,
                            "garble": True}, rec
    assert [r["prompt"] for r in rec["replay"]] == ["17*19=", "Say OK.", "What is the capital of France?",
                                                    "Name a colour.", "Count from one to twenty."]
    assert all(r["text"] == "ok" and r["ids"] is None for r in rec["replay"]), rec["replay"]
    assert st["hosts"][head_name]["serving"] == rec
    on_head = j.fleet.exec(j.fleet.hosts[0], f"cat {PATHS_BUNDLES}/state/serving/{first[head_name]}.json").stdout
    assert json.loads(on_head) == rec
    dl.start_bystanders(j)
    ids = {h.name: [c["id"] for c in dl.lane_containers(j, h)] for h in j.fleet.hosts}

    rc, rep = _deploy(j)  # already deployed and serving: a no-op that audits
    assert rc == 0 and rep["result"] == "unchanged" and rep["audit"]["phase"] == "all", j.last_stderr[-3000:]
    assert all(r["result"] == "unchanged" for r in rep["hosts"].values())
    assert ids == {h.name: [c["id"] for c in dl.lane_containers(j, h)] for h in j.fleet.hosts}  # not restarted

    _new_release(j)
    rc, rep = _deploy(j)
    assert rc == 0 and rep["result"] == "deployed", (rc, rep.get("reason"), j.last_stderr[-3000:])
    second = dl.bundle_ids(j)
    assert all(second[h] != first[h] for h in second)
    # the new release answered the replay as the first did: compared with the first's record, it passes
    replay = rep["audit"]["hosts"][head_name]["checks"]["gates::replay"]
    assert replay["status"] == "pass" and replay["facts"]["replay"] == rec["replay"], replay
    rep_hosts = json.loads(j.builder("deploy", "--fleet", j.name, "--json", "--dry-run").stdout)["hosts"]
    assert all(r["origin"] == second[h] for h, r in rep_hosts.items())
    head, worker = j.fleet.hosts
    starts = {h.name: dl.lane_containers(j, h)[0]["started"] for h in j.fleet.hosts}
    assert starts[worker.name] < starts[head.name]  # the workers start first
    assert dl.bystanders_running(j) == {h.name: True for h in j.fleet.hosts}


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_an_engine_that_fails_at_start_rolls_the_whole_fleet_back(j: Journey, bystanders: None) -> None:
    good = _good(j)
    old = j.root.parent / "good"  # the second lock's pins and lock, as the operator had them
    shutil.rmtree(old, ignore_errors=True)
    shutil.copytree(j.root / "images" / "demo", old / "images" / "demo")
    shutil.copy2(j.root / "pins.toml", old / "pins.toml")
    shutil.copy2(j.root / "pins.lock", old / "pins.lock")
    j.set_serve(args=[*ARGS, "--no-such-flag"])  # the demo engine refuses it and exits 2
    rc, rep = _deploy(j)
    assert rc == 1 and rep["result"] == "rolled-back", (rep.get("reason"), j.last_stderr[-3000:])
    assert "exited (code 2 at " in rep["reason"] and "UnknownFlag" in rep["reason"]  # (its code, when, its log)
    assert rep["fleet_on"] == "old" and all(r["result"] == "rolled-back" for r in rep["hosts"].values())
    assert rep["rollback_audit"] and rep["rollback_audit"]["exit"] == 0, rep["reason"]
    dl.assert_on(j, good)  # every host back on the second lock's bundle, serving
    # the rolled-back fleet passes the audit of the pins and lock it was deployed from
    p = j.builder("--pins", str(old / "pins.toml"), "--lock", str(old / "pins.lock"), "audit", "--fleet", j.name,
                  "--phase", "all", "--hosts-dir", str(j.root / "hosts"), "--checks", str(j.root / "checks"),
                  check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    rc, st = _status(j)
    assert rc == 1 and all(h["up"] and not h["on_lock"] for h in st["hosts"].values())  # up, on the old lock


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_a_rank_that_never_answers_is_bounded_and_rolled_back(j: Journey, bystanders: None) -> None:
    good = _good(j)
    j.set_serve(args=["serve", "--host", "{host}", "--port", "9998", "--served-name", "{served_name}"])
    t0 = time.monotonic()
    rc, rep = j.deploy(*_args(j, "--start-timeout", "6"))  # (the last --start-timeout counts)
    assert rc == 1 and rep["result"] == "rolled-back", rep.get("reason")
    assert "did not answer within 6 s" in rep["reason"]
    assert time.monotonic() - t0 < 240
    dl.assert_on(j, good)


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_refused_while_another_gpu_workload_runs(j: Journey, bystanders: None) -> None:
    good = _good(j)
    worker = j.fleet.hosts[1]
    j.fleet.exec(worker, f"echo '4242, python3, 1024' > {APPS}")  # (FAKE nvidia-smi: a compute app not the lane's)
    try:
        _new_release(j)
        rc, rep = _deploy(j)
        assert rc == 1 and rep["result"] == "refused", rep.get("reason")
        msg = rep["hosts"][worker.name]["message"]
        assert "gpu::no_other_compute_process" in msg and "4242" in msg, rep["hosts"]
        assert all(r["result"] == "not-switched" for r in rep["hosts"].values())
        dl.assert_on(j, good)  # nothing switched, the old release still serves
        j.builder("stop", "--fleet", j.name, "--stop-timeout", "2")
        p = j.builder("start", "--fleet", j.name, "--json", check=False)  # start refuses too
        assert p.returncode == 1 and json.loads(p.stdout)["result"] == "refused", p.stderr
        assert not [c for h in j.fleet.hosts for c in dl.lane_containers(j, h)]
    finally:
        j.fleet.exec(worker, f"rm -f {APPS}")


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_refused_on_a_latched_gpu_naming_the_host_and_the_fix(j: Journey) -> None:
    """The burn in the gate: the worker's FAKE GPU (tests/lib/fake_nvidia_smi.py) runs its load at a
    latched GB10's figures (low clock at low power, few TFLOPS): the deploy switches nothing and names
    the host, the latch and the power cycle that fixes it; the head's healthy burn passes. With the
    lane's engines on the GPUs the gate cannot burn: the burn runs once they are stopped, before the
    new release starts, and the latched worker rolls the deploy back."""
    good = _good(j)
    worker = j.fleet.hosts[1]
    inventory = j.root / "hosts" / f"{j.name}.toml"
    before = inventory.read_text()
    burn = {"command": ["/usr/local/bin/nvidia-smi", "--fake-burn", "4"], "seconds": 4}
    latched = auditlib.busy_sample().replace(", 1440, 1980, 690.", ", 690, 1980, 18.")
    state = "/etc/fake-nvidia-smi"
    try:
        inventory.write_text(fleet_toml(j.name, "demo", j.fleet, j.keys, GPU_EXPECT | {"burn": burn}))
        j.fleet.exec(worker, ["sh", "-c", f"cat > {state}/sample-busy && echo 31.2 > {state}/tflops"],
                     input=latched)
        _new_release(j)
        rc, rep = _deploy(j)
        assert rc == 1 and rep["result"] == "refused", rep.get("reason")
        msg = rep["hosts"][worker.name]["message"]
        assert "burn::gpu" in msg and "clock latch" in msg and "unplugged for 30 to 60 s" in msg, rep["hosts"]
        assert worker.name in rep["reason"]
        burned = rep["audit"]["burn"]["hosts"]
        assert burned[worker.name]["verdict"] == "latched" and burned[j.fleet.hosts[0].name]["verdict"] == "pass"
        assert rep["audit"]["hosts"][worker.name]["status"] == "unhealthy"
        assert all(r["result"] == "not-switched" for r in rep["hosts"].values())
        dl.assert_on(j, good)
        for rank, h in enumerate(j.fleet.hosts):  # the engines on the GPUs: the gate's burn skips
            pid = j.fleet.exec(h, f"docker inspect -f '{{{{.State.Pid}}}}' builder-demo-r{rank}").stdout.strip()
            j.fleet.exec(h, f"echo '{pid}, demo-engine, 1024' > {state}/apps-live")
        rc, rep = _deploy(j)
        assert rc == 1 and rep["result"] == "rolled-back", rep.get("reason")
        assert "the burn failed with the GPUs free" in rep["reason"] and worker.name in rep["reason"]
        assert "clock latch" in rep["reason"] and "power-cycle" in rep["reason"]
        dl.assert_on(j, good)  # back on the old release, serving
    finally:
        inventory.write_text(before)
        for h in j.fleet.hosts:
            j.fleet.exec(h, f"rm -f {state}/sample-busy {state}/tflops {state}/apps-live")


def _builder_steps(j: Journey, h: fleetlib.Host) -> list[str]:
    """builder's steps running on the host: its host scripts (`python3 -I -S`), the audit's pytest, the
    burn's load (the fake GPU's), the watchdog that ties a step to its ssh channel."""
    # each process on one line: pid, parent, group and session (its stat's fields 1, 4-6), then its command
    procs = j.fleet.exec(h, "for d in /proc/[0-9]*; do s=$(cut -d' ' -f1,4,5,6 $d/stat 2>/dev/null) && "
                            "echo \"$s $(tr '\\0\\n' '  ' < $d/cmdline 2>/dev/null | cut -c1-200)\"; done",
                         check=False).stdout.splitlines()
    return [p for p in procs if any(m in p for m in ("-I -S", "pytest", "--fake-burn", "select,signal"))]


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
@pytest.mark.slow
def test_an_audit_ended_mid_burn_by_sigterm_or_sigkill_leaves_nothing_behind(j: Journey, tmp_path: Path) -> None:
    """`builder audit --only burn` (the FAKE GPU's load, 60 s) ended while the burn runs on the hosts: by
    SIGTERM (its cleanup runs: exit 143, nothing of it is left) and by SIGKILL of the command alone (its
    steps on the hosts end with their ssh channel; its temp folder, named with its pid, goes with the next
    audit). After each, within the watchdog's bound, no step of builder's runs on any host; the next audit
    passes and leaves nothing in $TMPDIR or the ssh folder."""
    _good(j)
    inventory = j.root / "hosts" / f"{j.name}.toml"
    before = inventory.read_text()
    burn = {"command": ["/usr/local/bin/nvidia-smi", "--fake-burn", "60"], "seconds": 60}
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = {**j.env, "TMPDIR": str(tmpdir)}
    ssh_dir = Path(j.ssh_dir().get("BUILDER_SSH_DIR") or j.env["BUILDER_SSH_DIR"])
    audit_args = ["audit", "--fleet", j.name, "--only", "burn", "--json"]
    try:
        inventory.write_text(fleet_toml(j.name, "demo", j.fleet, j.keys, GPU_EXPECT | {"burn": burn}))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            bg = dl.Background(dataclasses.replace(j, env=env), *audit_args)
            deadline = time.monotonic() + 300
            while not all(any("--fake-burn" in p for p in _builder_steps(j, h)) for h in j.fleet.hosts):
                assert bg.p.poll() is None, ("the audit ended before its burn ran", bg.lines[-20:])
                assert time.monotonic() < deadline, "the burn never ran on every host"
                time.sleep(0.2)
            os.kill(bg.p.pid, sig)
            rc = bg.p.wait(timeout=120)
            assert rc == (128 + signal.SIGTERM if sig == signal.SIGTERM else -signal.SIGKILL), (sig, rc, bg.lines[-5:])
            if sig == signal.SIGTERM:
                bg.wait_line(r"^terminated \(SIGTERM\)$", timeout=30)
                assert not list(tmpdir.iterdir()), list(tmpdir.iterdir())
            deadline = time.monotonic() + 30  # (the hosts' watchdog: TERM, then KILL 3 s later)
            while left := [s for h in j.fleet.hosts for s in _builder_steps(j, h)]:
                assert time.monotonic() < deadline, (sig, left)
                time.sleep(0.5)
        p = j.builder(*audit_args, env={"TMPDIR": str(tmpdir)}, check=False)
        assert p.returncode == 0, p.stderr[-3000:]
        assert all(h["checks"]["burn::gpu"]["status"] == "pass" for h in json.loads(p.stdout)["hosts"].values())
        assert not list(tmpdir.iterdir()), list(tmpdir.iterdir())  # the killed audit's folder went too
        assert not list(ssh_dir.glob("run-*")), list(ssh_dir.glob("run-*"))
    finally:
        inventory.write_text(before)


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_a_host_cut_off_during_ship_switches_nothing(j: Journey, bystanders: None) -> None:
    good = _good(j)
    _new_release(j)
    head, worker = j.fleet.hosts
    bg = dl.Background(j, "deploy", "--fleet", j.name, "--json", *_args(j, "--parallel", "1"))
    bg.wait_line(rf"^{head.name}: staged")  # the head is staged; the worker's ship is under way
    j.fleet.cut(worker)
    try:
        rc, rep = bg.wait()
    finally:
        j.fleet.restore(worker)
    assert rc == 3 and rep["result"] == "refused", bg.stderr[-3000:]
    assert rep["hosts"][worker.name]["result"] == "unreachable" and rep["hosts"][head.name]["result"] == "not-switched"
    dl.assert_on(j, good)  # nothing switched: the old release serves on both
    new = _deployed(j)  # and the rerun completes
    assert new != good


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_two_deploys_never_interleave(j: Journey, bystanders: None) -> None:
    _good(j)
    _new_release(j)
    bg = dl.Background(j, "deploy", "--fleet", j.name, "--json", *_args(j))
    bg.wait_line(r"staged|making its bundle")
    bg.pause()  # (the deploy holds the fleet's lock until it ends: paused, it ends after the three tries)
    try:
        for cmd in (["deploy", "--fleet", j.name, *_args(j)], ["stop", "--fleet", j.name, "--stop-timeout", "2"],
                    ["start", "--fleet", j.name]):
            p = j.builder(*cmd, check=False)
            assert p.returncode == 1 and "another command holds" in p.stderr and "builder deploy" in p.stderr, p.stderr
    finally:
        bg.resume()
    rc, rep = bg.wait()
    assert rc == 0 and rep["result"] == "deployed", bg.stderr[-3000:]
    dl.assert_on(j, dl.bundle_ids(j))


KILL_POINTS = {
    "staging": r": staged",
    "gate": r"preflight audit \(the gate\)",
    "stop": r"stopped rank 0",
    "switch": r": switched ",
    "start": r"rank 1 is up",
}


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
@pytest.mark.slow
@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_deploy_killed_then_rerun_ends_every_host_on_the_new_release(j: Journey, point: str, bystanders: None) -> None:
    old = _good(j)
    _new_release(j)
    # one host at a time where the order allows it: a kill after the head's step finds the worker's undone
    bg = dl.Background(j, "deploy", "--fleet", j.name, "--json", *_args(j, "--parallel", "1"))
    bg.wait_line(KILL_POINTS[point])
    bg.kill()
    left = {h.name: (dl.current(j, h), [c["state"] for c in dl.lane_containers(j, h)]) for h in j.fleet.hosts}
    rc, rep = _deploy(j)
    assert rc == 0 and rep["result"] == "deployed", (point, left, rep.get("reason"), j.last_stderr[-3000:])
    new = dl.bundle_ids(j)
    dl.assert_on(j, new)
    assert new != old and rep["fleet_on"] == "new"
    if point not in ("staging", "gate"):  # (the journal is written after the gate)
        assert "did not finish" in rep["resumed"], rep["resumed"]
    assert not J.journal_path(Path(j.env["BUILDER_STORE"]), j.name).exists()
    rc, st = _status(j)
    assert rc == 0 and not st["deploy"], st


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
@pytest.mark.slow
def test_deploy_killed_while_rolling_back_then_rerun_ends_every_host_on_the_old_release(
    j: Journey, bystanders: None
) -> None:
    old = _good(j)
    j.set_serve(args=[*ARGS, "--no-such-flag"])
    bg = dl.Background(j, "deploy", "--fleet", j.name, "--json", *_args(j))
    bg.wait_line(r": rolled back ")
    bg.kill()
    rc, st = _status(j)
    assert rc == 1 and "did not finish" in st["deploy"]
    rc, rep = _deploy(j)
    assert rc == 1 and rep["result"] == "rolled-back", rep.get("reason")
    assert rep["fleet_on"] == "old" and "did not finish" in rep["resumed"]
    dl.assert_on(j, old)
    j.set_serve(args=ARGS)


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_stop_and_start_in_rank_order_only_the_lanes_containers(j: Journey, bystanders: None) -> None:
    good = _good(j)
    # nanoseconds: docker events' --until in whole seconds leaves out what died in the current second
    since = j.fleet.exec(0, "date +%s.%N").stdout.strip()
    # the default stop timeout: the engine gets docker stop's SIGTERM (start.sh runs it under --init)
    p = j.builder("stop", "--fleet", j.name, "--json")
    rep = json.loads(p.stdout)
    assert rep["result"] == "stopped" and all(r["result"] == "stopped" for r in rep["hosts"].values())
    head, worker = j.fleet.hosts
    for h in (head, worker):  # 143 = ended by SIGTERM; 137 would be docker's SIGKILL after the timeout
        died = j.fleet.exec(h, f"docker events --since {since} --until $(date +%s.%N) --filter event=die "
                               "--filter label=io.builder.lane=demo --format '{{.Actor.Attributes.exitCode}}'")
        assert died.stdout.split() == ["143"], (h.name, died.stdout)
    lines = p.stderr.splitlines()
    assert lines.index(f"{head.name}: stopped rank 0") < lines.index(f"{worker.name}: stopped rank 1")
    assert not [c for h in j.fleet.hosts for c in dl.lane_containers(j, h)]
    rc, st = _status(j)
    assert rc == 1 and not any(h["up"] for h in st["hosts"].values())
    p = j.builder("start", "--fleet", j.name, "--json")
    rep = json.loads(p.stdout)
    assert rep["result"] == "started" and rep["audit"]["exit"] == 0, p.stderr
    up = [ln.split(":")[0] for ln in p.stderr.splitlines() if re.match(r"^spark-\S+: rank \d+ is up", ln)]
    assert up == [worker.name, head.name], p.stderr
    dl.assert_on(j, good)
    rc, st = _status(j)
    assert rc == 0, st
    # a fleet partly up is stopped first, then started in order (a new worker never joins an old head)
    j.fleet.exec(worker, "docker rm -f builder-demo-r1")
    p = j.builder("start", "--fleet", j.name, "--json", "--stop-timeout", "2")
    assert json.loads(p.stdout)["result"] == "started", p.stderr
    dl.assert_on(j, good)


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_a_head_first_lane_starts_rank_0_first_and_waits_for_its_readiness(j: Journey, bystanders: None) -> None:
    """The lane's order, not a fixed one: with `start = "head-first"` (TensorFold's Python engine) the
    head starts and is ready (its /health) before any worker starts; stop is still the head first."""
    _good(j)
    j.set_lane(start="head-first")
    _deployed(j)
    p = j.builder("stop", "--fleet", j.name, "--json")
    assert json.loads(p.stdout)["result"] == "stopped", p.stderr
    p = j.builder("start", "--fleet", j.name, "--json")
    assert json.loads(p.stdout)["result"] == "started", p.stderr
    head, worker = j.fleet.hosts
    up = [ln.split(":")[0] for ln in p.stderr.splitlines() if re.match(r"^spark-\S+: rank \d+ is up", ln)]
    assert up == [head.name, worker.name], p.stderr
    fmt = "{{.State.StartedAt}}"
    started = {h.name: j.fleet.exec(h, f"docker inspect -f '{fmt}' builder-demo-r{rank}").stdout.strip()
               for rank, h in enumerate(j.fleet.hosts)}
    assert started[head.name] < started[worker.name], started  # (RFC 3339 in UTC: ordered as text)
    out = j.builder("launch", "--fleet", j.name, "--json")
    assert json.loads(out.stdout)["start_order"] == [head.name, worker.name]


# --------------------------------------------------------------------------- an interrupted deploy leaves no doubt


_HOLD, _HELD = "/tmp/test-hold-docker-run", "/tmp/test-docker-run-held"


def _hold_docker_run(j: Journey, h: fleetlib.Host) -> None:
    """While _HOLD exists, `docker run` on the host touches _HELD and waits 20 s before it runs."""
    script = (f"#!/bin/sh\nif [ \"$1\" = run ] && [ -e {_HOLD} ]; then touch {_HELD}; sleep 20; fi\n"
              "exec /usr/bin/docker.real \"$@\"\n")
    j.fleet.exec(h, ["sh", "-c", "mv /usr/bin/docker /usr/bin/docker.real && cat > /usr/bin/docker && "
                                 "chmod 755 /usr/bin/docker && "
                                 f"rm -f {_HELD} && touch {_HOLD}"], input=script.encode())


def _wait_held(j: Journey, h: fleetlib.Host, bg: dl.Background, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while j.fleet.exec(h, f"test -e {_HELD}", check=False).returncode != 0:
        assert bg.p.poll() is None, ("the deploy ended before the head's docker run", bg.lines[-20:])
        assert time.monotonic() < deadline, "the head's docker run was never reached"
        time.sleep(0.2)


def _alone(bg: dl.Background) -> None:
    """SIGKILL the deploy process alone (not its group): its children must end with it."""
    os.kill(bg.p.pid, 9)
    bg.p.wait(timeout=60)


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_a_deploy_killed_alone_while_starting_changes_nothing_after_and_status_says_not_deployed(
    j: Journey, bystanders: None
) -> None:
    """Points 1 and 4: the deploy process alone SIGKILLed while the head's start.sh runs; its ssh
    children end with it (parent-death signal) and so does the step on the host (builder.hostscripts.tied):
    nothing on a host changes afterwards. Status then exits 1 naming the phase and the resuming command."""
    _good(j)
    _new_release(j)
    head, worker = j.fleet.hosts
    # The head's `docker run` is held inside its start.sh (a wrapper in place of /usr/bin/docker),
    # so the kill lands in the start phase whatever this machine's load: a deploy whose head came up in
    # under the test's reaction time would finish before the kill. Were the step to outlive the kill,
    # the held `docker run` would go on 20 s later and the head's containers would change.
    _hold_docker_run(j, head)
    try:
        bg = dl.Background(j, "deploy", "--fleet", j.name, "--json", *_args(j))
        _wait_held(j, head, bg)
        _alone(bg)
        time.sleep(5)  # (the host's watchdog: TERM, KILL 3 s later)
        before = {h.name: dl.lane_containers(j, h) for h in j.fleet.hosts}
        time.sleep(25)
        after = {h.name: dl.lane_containers(j, h) for h in j.fleet.hosts}
        assert after == before, (before, after)
        left = j.fleet.exec(head, "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f 2>/dev/null; echo; done | "
                                  "grep '[c]urrent/start.sh' || true").stdout.strip()
        assert not left, left
    finally:
        j.fleet.exec(head, f"rm -f {_HOLD} {_HELD} && mv /usr/bin/docker.real /usr/bin/docker")
    rc, st = _status(j)
    assert rc == 1 and st["exit"] == 1, st
    assert st["deploy_phase"] in ("starting", "verifying") and "did not finish" in st["deploy"], st
    assert st["resume"] == f"builder deploy --fleet {j.name}" and "not deployed" in st["summary"], st
    p = j.builder("status", "--fleet", j.name, check=False)
    assert p.returncode == 1 and f"builder deploy --fleet {j.name}" in p.stderr, p.stderr
    _deployed(j)  # the rerun finishes it
    rc, st = _status(j)
    assert rc == 0 and not st["deploy"] and not st["deploy_phase"], st


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_a_rollback_killed_while_restarting_is_journaled_and_finished_by_start(j: Journey, bystanders: None) -> None:
    """Point 2: the journal covers the rollback until the old release is started and audited."""
    old = _good(j)
    j.set_serve(args=[*ARGS, "--no-such-flag"])
    try:
        bg = dl.Background(j, "deploy", "--fleet", j.name, "--json", *_args(j))
        bg.wait_line(r": rolled back ")
        bg.wait_line(r"rank 1 is up")  # (only the rollback's start gets a rank up: the new engine exits 2)
        bg.kill()
        store = Path(j.env["BUILDER_STORE"])
        jr = J.load(store, j.name)
        assert jr is not None and jr.phase in ("restarting-old", "verifying-old"), jr
        rc, st = _status(j)
        assert rc == 1 and "rollback did not finish" in st["deploy"] and st["deploy_phase"] == jr.phase, st
        assert "builder start" in st["deploy"], st
        p = j.builder("start", "--fleet", j.name, "--json", "--stop-timeout", "2", check=False)
        rep = json.loads(p.stdout)
        assert p.returncode == 0 and rep["result"] == "started", (rep.get("reason"), p.stderr[-3000:])
        assert "finishing a rollback" in p.stderr
        assert J.load(store, j.name) is None
        dl.assert_on(j, old)
        rc, st = _status(j)
        assert rc == 1 and not st["deploy"] and all(h["up"] for h in st["hosts"].values()), st  # (the old lock)
    finally:
        j.set_serve(args=ARGS)


@pytest.mark.fleet
@pytest.mark.docker
@pytest.mark.build
def test_repair_reinstalls_a_drifted_release_from_its_bundle(j: Journey, bystanders: None) -> None:
    """Point 3: a launch file edited on the worker, the apply record on the head: the no-op deploy refuses
    naming --repair; `deploy --repair` reinstalls from the bundle, restarts in order and audits."""
    good = _good(j)
    head, worker = j.fleet.hosts
    root = PATHS_BUNDLES
    j.fleet.exec(worker, f"echo '# edited by hand' >> {root}/current/start.sh")
    edit_on(j.fleet, head, op="json_set", path=f"{root}/state/applied.json", key="manifest_sha256", value="0" * 64)
    rc, rep = _deploy(j)
    assert rc == 1 and rep["result"] == "unchanged", rep.get("reason")
    assert "already deployed, but the audit fails" in rep["reason"] and "--repair" in rep["reason"], rep["reason"]
    rc, rep = _deploy(j, "--repair")
    assert rc == 0 and rep["result"] == "deployed", (rep.get("reason"), j.last_stderr[-3000:])
    assert {h: r["result"] for h, r in rep["hosts"].items()} == {head.name: "repaired", worker.name: "repaired"}, rep
    assert rep["audit"]["exit"] == 0
    dl.assert_on(j, good)
    assert "edited" not in j.fleet.exec(worker, f"cat {root}/current/start.sh").stdout
    assert json.loads(j.fleet.exec(head, f"cat {root}/state/applied.json").stdout)["manifest_sha256"] != "0" * 64
    rc, rep = _deploy(j)  # and the fleet is whole again: a no-op that passes
    assert rc == 0 and rep["result"] == "unchanged", rep.get("reason")


def test_a_repair_compares_the_apply_record_with_the_bundles_signed_manifest(tmp_path: Path) -> None:
    mbytes = b'{"bundle_id": "b"}\n'
    (tmp_path / "manifest.json").write_bytes(mbytes)
    files = [{"path": "start.sh", "size": 3, "sha256": "a" * 64}, {"path": "rank.env", "size": 2, "sha256": "b" * 64}]
    manifest = {"bundle_id": "b", "files": files, "models": [], "image": {"archive": None}}
    b = FleetBundle("h", tmp_path, manifest, made=False)
    good = {"manifest_sha256": hashlib.sha256(mbytes).hexdigest(), "files": list(reversed(files))}
    assert record_drift(good, b) == ""
    assert record_drift({**good, "manifest_sha256": "0" * 64}, b) == "manifest_sha256"
    assert record_drift({**good, "files": [files[0], {**files[1], "sha256": "c" * 64}]}, b) == "files: rank.env"
    assert record_drift({**good, "files": files[:1]}, b) == "files: rank.env"
    assert record_drift(None, b) == "missing"
    for edited in (7, "start.sh", None, {"path": "start.sh"}):
        assert record_drift({**good, "files": edited}, b) == "files"


@pytest.mark.parametrize("earlier_deploy", [False, True])
def test_a_repair_with_nothing_to_do_says_so_or_keeps_the_reason_of_an_earlier_deploy_it_finished(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, earlier_deploy: bool) -> None:
    """`deploy --repair` of a fleet whose hosts run their current bundles, each apply record as the
    installer writes it: nothing differs, and it says "nothing to repair" (exit 0, unchanged); after an
    earlier deploy that had moved every host but did not finish, that deploy's reason stands (deployed)
    and its journal is cleared. The real deploy, bundles, journal, record comparison and no-op; FAKE
    (test only: no host here) are only the steps that run on the hosts: what each host answers, the
    staging over ssh, the derivations and the fleet audit, each as it goes on a fleet that is whole."""
    from builder.audit.findings import AuditReport, HostResult
    from builder.deploy import dryrun, rollout
    from builder.deploy.hoststate import Container
    from builder.installer.record import write_record
    from builder.installer.root import Root

    p = bl.make_project(tmp_path, hosts=bl.local_hosts(tmp_path / "host"))
    ctx = load_bundle_inputs(p.pins, p.root / "pins.lock", p.store)
    fleet_path, fleet = find_fleet(ctx.hosts_dir, bl.FLEET)
    bundles = ensure_bundles(ctx, fleet_path, fleet, key=p.key, with_image=False, with_models=False,
                             part_size="256MiB")
    installed: dict[str, HostState] = {}
    for h in fleet.by_rank():
        b = bundles[h.name]
        assert isinstance(b, FleetBundle)
        for m in b.manifest["models"]:  # (placed, as the installer places them before it records them)
            Path(m["path"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p.root / "models" / "demo" / m["file"], m["path"])
        record = write_record(Root(str(tmp_path / h.name)), b.manifest, (b.path / "manifest.json").read_bytes(),
                              "install", None, path=str(tmp_path / f"{h.name}-applied.json"))
        installed[h.name] = HostState(
            h.name, current=b.bundle_id, releases=[b.bundle_id], applied=record,
            containers=[Container(f"c{h.rank}", f"{fleet.fleet.lane}-r{h.rank}", "running", b.bundle_id,
                                  "sha256:ab", "Up 1 hour")],
            health={"status": 200} if h.role == "head" else None)
    if earlier_deploy:
        J.save(p.store, J.Journal(bl.FLEET, target={n: s.current or "" for n, s in installed.items()},
                                  origin=dict.fromkeys(installed), origin_locks=dict.fromkeys(installed),
                                  target_lock=ctx.lock.lock_hash(), phase="starting"))

    def answers(self: Fleetwork, hosts: list[Any] | None = None) -> dict[str, str]:
        self.states.update(installed)
        return {}

    staged: list[bool] = []
    monkeypatch.setattr(Fleetwork, "probe", answers)
    monkeypatch.setattr(rollout, "stage", lambda d: staged.append(d.rehash) or True)
    monkeypatch.setattr(rollout, "derive", lambda d: None)
    monkeypatch.setattr(dryrun, "audit", lambda w, phase, **kw: AuditReport(
        [HostResult(h.name, w.fleet_name, "pass") for h in w.hosts], "fast", phase, []))
    rep = rollout.deploy(DeployOptions(root=p.root, pins=p.pins, lock=p.root / "pins.lock", store=p.store,
                                       fleet=bl.FLEET, key=p.key, repair=True))
    assert staged == [True]  # (every file hashed as it is staged)
    assert rep.exit_code == 0 and {o.result for o in rep.hosts} == {"unchanged"}, rep.to_json()
    if earlier_deploy:
        assert rep.result == "deployed" and rep.reason.startswith("the earlier deploy had moved every host"), rep.reason
        assert J.load(p.store, bl.FLEET) is None
    else:
        assert rep.result == "unchanged", rep.reason
        assert rep.reason.startswith("nothing to repair: every file on every host matches"), rep.reason


def test_a_plan_from_the_lock_and_fleet_file_contacts_no_host(tmp_path: Path) -> None:
    """`deploy --plan` prints each host's bundle and the steps on stdout, and what only the hosts could
    tell; ssh (a stand-in on PATH that records any call) is never run, as it is by --dry-run."""
    p = bl.make_project(tmp_path)
    calls = tmp_path / "ssh-calls"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 255\n")
    (fake / "ssh").chmod(0o755)
    env = {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    r = p.cli("deploy", "--fleet", bl.FLEET, "--plan", "--key", str(p.key), env=env)
    assert r.returncode == 0, r.stderr
    assert "1. bundle: spark-a, spark-b made again" in r.stdout, r.stdout
    assert "spark-a: runs: not known (no host was contacted)" in r.stdout, r.stdout
    assert "not known without the hosts: whether the head answers its health check" in r.stdout, r.stdout
    j = p.cli("deploy", "--fleet", bl.FLEET, "--plan", "--key", str(p.key), "--json", env=env)
    doc = json.loads(j.stdout)
    assert doc["result"] == "planned" and doc["exit"] == 0 and doc["unknown"] and doc["steps"], doc
    assert set(doc["hosts"]) == {"spark-a", "spark-b"}
    assert not calls.exists(), calls.read_text()
    assert not (p.root / "out").exists()  # (nothing made: a plan writes no bundle)
    d = p.cli("deploy", "--fleet", bl.FLEET, "--dry-run", "--key", str(p.key), env=env)
    assert d.returncode == 3 and calls.exists(), d.stderr  # (the stand-in answers as a host cut off)


# --------------------------------------------------------------------------- what cannot be read is an error


@pytest.mark.parametrize("content", [b"{ not json", b'{"format": 99, "fleet": "f"}', b'{"format": 1}', b"[]"])
def test_a_journal_that_cannot_be_read_is_an_error_naming_the_file_and_the_fix(tmp_path: Path, content: bytes) -> None:
    """The journal alone says which release every host ran before an unfinished deploy: one that is there
    but cannot be read is refused (exit 2, one line), never taken for "no deploy under way"."""
    p = bl.make_project(tmp_path)
    path = J.journal_path(p.store, bl.FLEET)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(ConfigError) as ei:
        J.load(p.store, bl.FLEET)
    line = str(ei.value)
    assert line.startswith(f"{path}: ") and "cannot be read" in line and "remove it" in line
    assert f"builder status --fleet {bl.FLEET}" in line
    r = p.cli("deploy", "--fleet", bl.FLEET, "--plan", "--key", str(p.key))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.strip()][-1].endswith(line)
    assert path.read_bytes() == content  # (left as it was)
    path.unlink()
    assert J.load(p.store, bl.FLEET) is None  # none there: no deploy under way


READ_AS_ANOTHER = """
import os, sys
from pathlib import Path
from builder.deploy.bundles import current_bundle
from builder.errors import BuilderError
if os.geteuid() == 0:  # root reads any file: read as a user who may not read the manifest
    os.setgid(65534)
    os.setuid(65534)
try:
    _, why = current_bundle(Path(sys.argv[1]), b"", {}, False, False)
    print("stale: " + why)
except BuilderError as e:
    print("error: " + str(e))
"""


def test_a_stale_bundle_is_made_again_and_one_that_cannot_be_read_is_an_error(tmp_path: Path) -> None:
    """Stale (docs/deploy.md: not signed for the hosts' key, files changed, missing or cut short) means
    made again; a bundle folder that cannot be read is an error naming it, not a reason to make another."""
    stale_dir = tmp_path / "stale"
    stale_dir.mkdir()
    (stale_dir / "manifest.json").write_text("{}\n")
    (stale_dir / "manifest.json.minisig").write_text("not a signature\n")
    manifest, why = current_bundle(stale_dir, b"", {}, False, False)
    assert manifest is None and "manifest.json.minisig" in why
    d = Path(tempfile.mkdtemp(prefix="builder-test-bundle-"))  # (the other user must reach it)
    try:
        d.chmod(0o755)
        (d / "manifest.json").write_text("{}\n")
        (d / "manifest.json").chmod(0)
        r = subprocess.run([sys.executable, "-c", READ_AS_ANOTHER, str(d)], capture_output=True, text=True,
                           timeout=60, env=clirun.environment())
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"error: {d}: cannot read the bundle: Permission denied"
    finally:
        shutil.rmtree(d, ignore_errors=True)
