"""Network faults on the test fleet: a host cut off mid-ship, slowed links during ship and audit.

Already elsewhere: a host cut off before `ship` (exit 3, one line naming it) and `ship` SIGKILLed then
resumed are tests/test_ship.py; a cut host and a stopped sshd during `audit` are
tests/test_checks_fleet.py. Here: the cable pulled in the middle of a transfer, and links slowed
(tc netem, or fleetlib's NFQUEUE delayer on kernels without sch_netem) a little (the command
completes) and a lot (it gives up within its bound, exit 3, naming the host). Each time a rerun
after the fault resumes: files already on the host are not sent again. No wall-clock assertions:
exit codes, messages and what was sent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.lib import auditlib, factory, fleetlib, rlib
from tests.lib import bundlelib as bl

pytestmark = [pytest.mark.fleet, pytest.mark.docker]

FLEET_PATHS = {
    "models": "/home/spark/models",
    "engram": "/home/spark/engram",
    "bundles": "/home/spark/builder",
}


@pytest.fixture(scope="module")
def fleet2(request: pytest.FixtureRequest) -> Any:
    return fleetlib.fleet_fixture(request, 2, skip_if_unavailable=not os.environ.get("CI"))


@pytest.fixture(scope="module")
def shipproj(fleet2: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("netship")
    hosts = [factory.host(h.name, i, address=h.ip, paths=FLEET_PATHS) for i, h in enumerate(fleet2.hosts)]
    p = bl.make_project(
        base,
        hosts=hosts,
        docker_image=True,
        marker=f"netfaults-{fleet2.network}",
        ssh_config=str(fleet2.ssh_config),
    )
    r = rlib.run_builder(
        "--pins",
        str(p.pins),
        "bundle",
        "--fleet",
        bl.FLEET,
        "--with-image",
        "--with-models",
        "--part-size",
        "64KiB",
        "--key",
        str(p.key),
        cwd=p.root,
    )
    assert r.returncode == 0, r.stderr
    yield p
    subprocess.run(["docker", "rmi", "-f", p.image_id], capture_output=True)


def ship(p: Any, host: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return rlib.run_builder(
        "--pins",
        str(p.pins),
        "ship",
        host,
        "--signing-key",
        str(p.key),
        "--json",
        *extra,
        cwd=p.root,
        timeout=600,
    )


def applied(fleet: Any, h: Any) -> dict[str, Any] | None:
    r = fleet.exec(h, ["cat", f"{FLEET_PATHS['bundles']}/state/applied.json"], check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def reset_host(fleet: Any, h: Any) -> None:
    fleet.exec(h, f"rm -rf {FLEET_PATHS['bundles']} {FLEET_PATHS['models']}", check=False)


def one_line_naming(r: subprocess.CompletedProcess[str], host: str) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and host in errors[0], r.stderr
    return errors[0]


def test_cable_pulled_mid_transfer_then_rerun_resumes(fleet2: Any, shipproj: Any) -> None:
    fleet, p = fleet2, shipproj
    h = fleet.hosts[1]
    reset_host(fleet, h)
    bid = bl.manifest(p.out(h.name))["bundle_id"]
    incoming = f"{FLEET_PATHS['bundles']}/incoming/{bid}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "builder",
            "--pins",
            str(p.pins),
            "ship",
            h.name,
            "--signing-key",
            str(p.key),
            "--timeout",
            "15",
        ],
        cwd=p.root,
        env=rlib.builder_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    # wait until the stream has begun to land on the host (the receive writes into incoming/<id>/),
    # then pull the cable
    n = 0
    for _ in range(600):
        r = fleet.exec(h, f"find {incoming} -type f 2>/dev/null | wc -l", check=False)
        n = int(r.stdout.strip() or 0)
        if n >= 1 or proc.poll() is not None:
            break
        time.sleep(0.05)
    fleet.cut(h)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        fleet.restore(h)
        fleet.close_connection(h)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if r.returncode == 0:
        pytest.skip(f"the transfer finished before the cut ({n} files were there)")
    assert r.returncode == 3, r.stderr
    one_line_naming(r, h.name)
    # nothing half-installed: no record, or (the host finished before the cut reached its answer)
    # the whole new one
    before = applied(fleet, h)
    assert before is None or before["bundle_id"] == bid, before
    r = ship(p, h.name)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    if before is None:
        total = sum(f["size"] for f in bl.manifest(p.out(h.name))["files"])
        # resumed: what the host had received was not sent again
        assert res["result"] == "installed" and (res["skipped"] or res["bytes_sent"] < total), res
    else:
        assert res["result"] == "unchanged", res
    rec = applied(fleet, h)
    assert rec is not None and rec["bundle_id"] == bid
    rlib.record_figures(
        "cut-mid-ship",
        {"files_before_cut": n, "skipped_on_rerun": len(res["skipped"]), "sent_on_rerun": len(res["sent"])},
    )


def test_slow_link_ship_completes_or_gives_up_naming_the_host(fleet2: Any, shipproj: Any) -> None:
    fleet, p = fleet2, shipproj
    h = fleet.hosts[0]
    reset_host(fleet, h)
    fleet.close_connection(h)
    bid = bl.manifest(p.out(h.name))["bundle_id"]
    # a lot slower than the bound: refused within it (exit 3), naming the host and the step
    how = fleet.netem(h, delay_ms=2500)
    try:
        r = ship(p, h.name, "--timeout", "4")
    finally:
        fleet.clear_netem(h)
        fleet.close_connection(h)
    assert r.returncode == 3, r.stderr
    msg = one_line_naming(r, h.name)
    assert "no answer within" in msg or "unreachable" in msg, msg
    # a little slower, with some loss: it completes
    fleet.netem(h, delay_ms=40, loss_pct=2)
    try:
        r = ship(p, h.name, "--timeout", "120")
    finally:
        fleet.clear_netem(h)
        fleet.close_connection(h)
    assert r.returncode in (0, 3), r.stderr
    if r.returncode == 3:
        one_line_naming(r, h.name)
        r = ship(p, h.name)  # and the rerun resumes
        assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["result"] == "installed"
    rec = applied(fleet, h)
    assert rec is not None and rec["bundle_id"] == bid
    r = ship(p, h.name)
    assert r.returncode == 0 and json.loads(r.stdout)["result"] == "unchanged"
    rlib.record_figures("slow-ship", {"delayer": how})


def test_slow_link_audit_completes_or_names_the_unreachable_host(fleet2: Any, tmp_path: Path) -> None:
    fleet = fleet2
    ap = auditlib.make_project(tmp_path / "audit", tp=2)
    hosts = [factory.host(h.name, i) for i, h in enumerate(fleet.hosts)]
    (ap["hosts"] / "t.toml").write_text(
        auditlib.fleet_toml("t", hosts, ssh_config=str(fleet.plain_ssh_config),
                            expect={"docker": False, "gpu_count": 0})
    )

    def audit(*extra: str) -> tuple[int, dict[str, Any], str]:
        r = rlib.run_builder(
            "--pins",
            str(ap["pins"]),
            "audit",
            "--fleet",
            "t",
            "--json",
            "--only",
            "memory,storage",
            "--checks",
            str(rlib.REPO / "checks"),
            "--ssh-persist",
            "60",
            *extra,
            cwd=ap["pins"].parent,
            timeout=600,
        )
        assert "Traceback" not in r.stderr, r.stderr
        return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else {}), r.stderr

    # The audits keep each host's connection (--ssh-persist 60) in this test's own
    # $BUILDER_SSH_DIR (tests/conftest.py); fleet.close_connection closes only the fleet's own
    # ControlPath, which the audit does not use, so a fresh connection needs these closed.
    kept = Path(os.environ["BUILDER_SSH_DIR"])

    def fresh() -> None:
        fleetlib.close_kept_connections(kept, remove=False)
        for hh in fleet.hosts:
            fleet.close_connection(hh)

    rc0, base, err = audit("--connect-timeout", "5")
    assert rc0 in (0, 1), err
    statuses = {n: v["status"] for n, v in base["hosts"].items()}
    assert "unreachable" not in statuses.values(), base
    slow = fleet.hosts[1]
    fresh()  # a little slower, with some loss, on new connections: it completes
    fleet.netem(slow, delay_ms=60, loss_pct=1)
    try:
        rc, data, err = audit("--connect-timeout", "10")
    finally:
        fleet.clear_netem(slow)
    assert rc == rc0, err
    assert {n: v["status"] for n, v in data["hosts"].items()} == statuses
    # A lot slower (3 s per round trip, --connect-timeout 2): unreachable, first through the
    # connection the audit above kept for it, then on a new one. (The kept one is what once let
    # the host pass in 15.6 s: its `true` had 5 s more than --connect-timeout, and answered.)
    other = fleet.hosts[0].name
    for how in ("kept", "fresh"):
        if how == "fresh":
            fresh()
        else:
            from builder.foundation.ssh import ControlSockets
            from builder.inputs.hosts import fleet_hosts

            (t,) = [t for t in fleet_hosts(ap["hosts"], "t") if t.name == slow.name]
            sockets = ControlSockets(kept, True, 60)
            assert Path(sockets.path(t.ssh_config(), t.host.ssh)).is_socket(), "the audit kept no connection"
        fleet.netem(slow, delay_ms=3000)
        try:
            rc, data, err = audit("--connect-timeout", "2")
        finally:
            fleet.clear_netem(slow)
            fleet.close_connection(slow)
        assert rc == 3, f"{how}: {err}"
        assert data["hosts"][slow.name]["status"] == "unreachable" and data["hosts"][slow.name]["message"]
        assert data["hosts"][other]["status"] == statuses[other]  # the rest is audited as before
    rc, data, err = audit("--connect-timeout", "5")  # the link back: the rerun is whole again
    assert rc == rc0 and {n: v["status"] for n, v in data["hosts"].items()} == statuses, err
