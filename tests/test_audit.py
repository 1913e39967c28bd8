"""builder audit / builder hosts: validation before contact, reports, the Ansible inventory writer,
and real runs of the checks through testinfra's local backend (a FAKE nvidia-smi on PATH)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from builder.audit import runner
from builder.audit.findings import AuditReport, CheckOutcome, HostResult, burn_rows, junit_xml, matrix_rows
from builder.audit.run import run_audit
from builder.audit.selection import AuditOptions
from builder.lock.lockfile import load_lock
from tests.lib import auditlib, clirun, factory

ROOT = Path(__file__).resolve().parent.parent
HOSTS = [factory.host("a", 0, ssh="node-a"), factory.host("b", 1, ssh="node-b")]


def cli(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return clirun.run(*args, pins=root / "pins.toml", env=clirun.environment(env), timeout=300)


def tripwire_project(tmp_path: Path, fleet_text: str | None = None, **kw: Any) -> tuple[Path, Path]:
    """A project whose ssh_config makes any contact with a host create a marker file."""
    paths = auditlib.make_project(tmp_path / "proj", **kw)
    marker = tmp_path / "contacted"
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host *\n  ProxyCommand sh -c 'touch {marker}; exit 1'\n")
    text = fleet_text or auditlib.fleet_toml("f", HOSTS, ssh_config=str(cfg))
    (paths["hosts"] / "f.toml").write_text(text)
    return paths["pins"].parent, marker


def test_tripwire_really_fires(tmp_path: Path) -> None:
    root, marker = tripwire_project(tmp_path)
    r = cli(root, "audit", "--fleet", "f", "--only", "memory", "--connect-timeout", "2")
    assert r.returncode == 3, r.stderr
    assert marker.exists()
    assert "unreachable" in r.stderr


BAD_CASES = {
    "unknown lane": (lambda t: t.replace('lane = "demo"', 'lane = "nope"'), "unknown lane 'nope'"),
    "host without rank": (lambda t: t.replace("rank = 1\n", "", 1), "hosts[1].rank"),
    "two hosts with one rank": (lambda t: t.replace("rank = 1", "rank = 0"), "rank 0 is also host"),
    "wrong type": (
        lambda t: t.replace("[hosts.expect]\n", '[hosts.expect]\ngpu_count = "one"\n', 1),
        "hosts[0].expect.gpu_count",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_inventory_exit_2_one_line_no_contact(tmp_path: Path, case: str) -> None:
    edit, needle = BAD_CASES[case]
    root, marker = tripwire_project(tmp_path)
    f = root / "hosts" / "f.toml"
    f.write_text(edit(f.read_text()))
    r = cli(root, "audit", "--fleet", "f") if case != "two hosts with one rank" else cli(root, "audit", "a")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not marker.exists()


def test_lock_missing_lane_exit_2(tmp_path: Path) -> None:
    root, marker = tripwire_project(tmp_path)
    lock = json.loads((root / "pins.lock").read_text())
    del lock["lanes"]["demo"]
    (root / "pins.lock").write_text(json.dumps(lock))
    r = cli(root, "audit", "--fleet", "f")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "not in the lock" in r.stderr
    assert not marker.exists()


def test_lock_missing_model_exit_2(tmp_path: Path) -> None:
    root, marker = tripwire_project(tmp_path)
    lock = json.loads((root / "pins.lock").read_text())
    del lock["models"]["tiny"]
    (root / "pins.lock").write_text(json.dumps(lock))
    r = cli(root, "audit", "a", "b")
    assert r.returncode == 2 and "models.tiny" in r.stderr
    assert not marker.exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--fleet", "f", "--only", "gpu,bogus"], "unknown concern 'bogus'"),
        (["--fleet", "nope"], "no fleet named 'nope'"),
        ([], "say which hosts"),
        (["zz"], "no host named 'zz'"),
        (["--fleet", "f", "--backend", "ansible", "--inventory", "/nonexistent.yml"], "no Ansible inventory"),
    ],
)
def test_usage_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    root, marker = tripwire_project(tmp_path)
    r = cli(root, "audit", *args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert not marker.exists()


def test_missing_ssh_config_is_config_error(tmp_path: Path) -> None:
    root, marker = tripwire_project(tmp_path, auditlib.fleet_toml("f", HOSTS, ssh_config="nowhere/cfg"))
    r = cli(root, "audit", "--fleet", "f")
    assert r.returncode == 2 and "fleet.ssh_config" in r.stderr


# ------------------------------------------------------------------ hosts and the Ansible inventory


def test_hosts_json_and_ansible_inventories(tmp_path: Path) -> None:
    root, _ = tripwire_project(tmp_path)
    (root / "hosts" / "g.toml").write_text(
        auditlib.fleet_toml(
            "g",
            [factory.host("c", 0, ssh="ops@192.0.2.7:2222"), factory.host("d", 1, ssh="ctr-d", connection="docker"),
             factory.host("e", 2, ssh="localhost", connection="local")],
        )
    )
    r = cli(root, "hosts", "--json")
    rows = json.loads(r.stdout)
    assert [(x["fleet"], x["name"], x["rank"], x["role"]) for x in rows] == [
        ("f", "a", 0, "head"),
        ("f", "b", 1, "worker"),
        ("g", "c", 0, "head"),
        ("g", "d", 1, "worker"),
        ("g", "e", 2, "worker"),
    ]
    ini = tmp_path / "inv.ini"
    assert cli(root, "hosts", "--fleet", "g", "--ansible", str(ini)).returncode == 0
    text = ini.read_text()
    assert "[g]" in text
    assert (
        "c ansible_connection=ssh ansible_host=192.0.2.7 ansible_user=ops ansible_port=2222 rank=0 role=head"
        in text
    )
    assert "d ansible_connection=docker ansible_host=ctr-d" in text
    assert "e ansible_connection=local" in text
    yml = tmp_path / "inv.yml"
    assert cli(root, "hosts", "--ansible", str(yml)).returncode == 0
    y = yml.read_text()
    assert "          ansible_port: 2222\n" in y and "          rank: 1\n" in y
    assert f'ansible_ssh_common_args: "-F {tmp_path / "ssh_config"}"' in y
    bad = cli(root, "hosts", "--ansible", str(tmp_path / "inv.txt"))
    assert bad.returncode == 2 and "*.yml" in bad.stderr
    try:
        import yaml
    except ImportError:
        return
    doc = yaml.safe_load(y)
    hv = doc["all"]["children"]["g"]["hosts"]["c"]
    assert hv == {
        "ansible_connection": "ssh",
        "ansible_host": "192.0.2.7",
        "ansible_user": "ops",
        "ansible_port": 2222,
        "rank": 0,
        "role": "head",
        "builder_fleet": "g",
        "builder_lane": "demo",
    }


# ------------------------------------------------------------------ reports


def _report() -> AuditReport:
    a = HostResult(
        "a",
        "f",
        "drift",
        checks=[
            CheckOutcome("gpu::name", "gpu", "fail", "GPU 0 name: expected 'X', found 'Y'"),
            CheckOutcome("memory::available", "memory", "pass"),
            CheckOutcome("fabric::mtu", "fabric", "skip", "no /dev/infiniband"),
        ],
    )
    b = HostResult("b", "f", "unreachable", "Connection refused")
    return AuditReport([a, b], "fast", "preflight", ["gpu", "memory", "fabric"], 1.0)


def test_burn_figures_and_the_fleets_median() -> None:
    """Each host's burn figures in the JSON and the burn table; a host under 85% of the fleet's median
    TFLOPS is flagged, and a hardware finding fails as `unhealthy` (JUnit type too)."""
    def host(name: str, tflops: float, verdict: str = "pass") -> HostResult:
        data = {"burn": {"tflops": tflops, "clock_mhz": 2171, "power_w": 86.0, "temperature_c": 60, "verdict": verdict}}
        status = "fail" if verdict != "pass" else "pass"
        if verdict != "pass":
            data["kind"] = "hardware"
        return HostResult(name, "f", "unhealthy" if verdict != "pass" else "pass",
                               checks=[CheckOutcome("burn::gpu", "burn", status, "m", data)])
    rep = AuditReport([host("s1", 82.0), host("s2", 80.5), host("s3", 31.2, "latched"), host("s4", 84.0)],
                           "fast", "preflight", ["burn"])
    j = rep.to_json()
    assert j["exit"] == 1 and list(j["burn"]["outliers"]) == ["s3"]
    assert j["hosts"]["s1"]["checks"]["burn::gpu"]["facts"]["burn"]["tflops"] == 82.0
    cols, rows = burn_rows(rep)
    assert cols[1] == "TFLOPS" and rows[2] == ["s3", "31.2", "2171", "86", "60", "latched", "SLOW"]
    assert b'type="unhealthy"' in junit_xml(rep)
    assert AuditReport([HostResult("a", "f", "pass")], "fast", "preflight", []).to_json().get("burn") is None


def test_matrix_json_junit_exit() -> None:
    rep = _report()
    assert rep.exit_code == 3
    cols, rows = matrix_rows(rep)
    assert cols == ["check", "a", "b"]
    assert rows == [
        ["gpu::name", "FAIL", "unreachable"],
        ["memory::available", "pass", "unreachable"],
        ["fabric::mtu", "skip", "unreachable"],
    ]
    j = rep.to_json()
    assert j["hosts"]["a"]["message"] == "gpu::name: GPU 0 name: expected 'X', found 'Y'"
    assert j["hosts"]["b"]["status"] == "unreachable" and j["exit"] == 3
    root = ET.fromstring(junit_xml(rep))
    suites = {s.get("name"): s for s in root}
    assert suites["a"].get("failures") == "1" and suites["a"].get("skipped") == "1"
    assert suites["b"].get("errors") == "1"
    rep.hosts[1].status = "pass"
    assert rep.exit_code == 1
    rep.hosts[0].status = "pass"
    assert rep.exit_code == 0


# ------------------------------------------------------------------ local backend, FAKE nvidia-smi


def local_project(tmp_path: Path, expect: dict[str, Any], **kw: Any) -> tuple[Path, dict[str, str]]:
    paths = auditlib.make_project(tmp_path / "proj", **kw)
    hosts = [auditlib.local_host(tmp_path)]
    (paths["hosts"] / "l.toml").write_text(auditlib.fleet_toml("l", hosts, expect=expect))
    auditlib.install_fake(tmp_path / "bin", tmp_path / "nvstate")
    env = {
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "FAKE_NVSMI_DIR": str(tmp_path / "nvstate"),
    }
    return paths["pins"].parent, env


H200 = {"gpu_name": "NVIDIA H200", "compute_cap": "9.0", "driver_version": "580.159.04", "cuda_version": "13.0",
        "gpu_clock_mhz": 1980, "docker": False}


def run_local(root: Path, env: dict[str, str], *args: str) -> tuple[int, dict[str, Any], str]:
    r = cli(root, "audit", "--fleet", "l", "--json", *args, env=env)
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else {}), r.stderr


def test_local_gpu_checks_on_h200_capture(tmp_path: Path) -> None:
    root, env = local_project(tmp_path, H200)
    rc, data, err = run_local(root, env, "--only", "gpu")
    checks = data["hosts"]["me"]["checks"]
    assert rc == 0, err
    for c in (
        "count",
        "name",
        "compute_capability",
        "driver_version",
        "cuda_version",
        "persistence_mode",
        "clock_ceiling",
        "clock_event_reasons",
        "no_other_compute_process",
    ):
        assert checks[f"gpu::{c}"]["status"] == "pass", (c, checks[f"gpu::{c}"])
    latch = checks["gpu::clock_latch"]
    assert latch["status"] == "skip" and "GPU idle" in latch["message"], latch


@pytest.mark.slow
@pytest.mark.parametrize("state", ["idle", "foreign", "own", "final/burning"])
def test_local_gpu_checks_replay_the_h200_states(tmp_path: Path, state: str) -> None:
    """The H200's replies of 2026-12-04 in each state (tests/data/gpu-states), through the same checks:
    idle and busy with the lane's own process pass, a foreign process (another load, a burn run by
    hand) is named. The compute process is a real process here, started with (own) or without the
    BUILDER_* variables of a rank."""
    root, env = local_project(tmp_path, H200)
    nv = tmp_path / "nvstate"
    folder = auditlib.STATES.with_name(auditlib.STATES.name + "-final") if "/" in state else auditlib.STATES
    state = state.split("/")[-1]
    (nv / "query").write_text((folder / f"{state}-query.txt").read_text())
    (nv / "sample").write_text((folder / f"{state}-sample.txt").read_text())
    apps = (folder / f"{state}-apps.txt").read_text()
    own = {"BUILDER_LANE": "demo", "BUILDER_FLEET": "l", "BUILDER_HOST": "me", "BUILDER_RANK": "0"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={k: v for k, v in os.environ.items() if not k.startswith("BUILDER_")}
                            | (own if state == "own" else {}))
    try:
        if apps.strip():
            (nv / "apps").write_text(f"{proc.pid}," + apps.split(",", 1)[1])
        rc, data, err = run_local(root, env, "--only", "gpu")
    finally:
        proc.kill()
        proc.wait()
    checks = data["hosts"]["me"]["checks"]
    bad = {k: v["message"] for k, v in checks.items() if v["status"] not in ("pass", "skip")}
    if state in ("foreign", "burning"):
        assert rc == 1 and set(bad) == {"gpu::no_other_compute_process"}, err
        used = apps.split(",")[2].strip()
        assert f"pid {proc.pid} python3 ({used} MiB)" in bad["gpu::no_other_compute_process"]
        assert data["hosts"]["me"]["status"] == "drift"
    else:
        assert rc == 0 and bad == {}, err
        assert checks["gpu::clock_event_reasons"]["status"] == "pass"  # 0x4 under load (foreign, own)


def test_local_busy_healthy_gpu_passes_and_slowdowns_are_unhealthy(tmp_path: Path) -> None:
    """The H200 at its power cap under load (0x4, the captured burn sample) passes; a thermal slowdown
    and a latch fail as hardware findings (the host `unhealthy`, every failing reason shown)."""
    root, env = local_project(tmp_path, H200)
    busy = auditlib.busy_sample()
    (tmp_path / "nvstate" / "sample").write_text(busy)
    q = auditlib.capture_sections()["query csv header"].replace("0x0000000000000001", "0x0000000000000004")
    (tmp_path / "nvstate" / "query").write_text(q)
    rc, data, err = run_local(root, env, "--only", "gpu")
    assert rc == 0 and data["hosts"]["me"]["status"] == "pass", err
    assert data["hosts"]["me"]["checks"]["gpu::clock_latch"]["status"] == "pass"  # busy and judged
    (tmp_path / "nvstate" / "query").write_text(q.replace("0x0000000000000004", "0x0000000000000064"))
    latched = busy.replace(", 1440, 1980, 690.", ", 690, 1980, 150.")
    assert latched != busy
    (tmp_path / "nvstate" / "sample").write_text(latched)
    rc, data, err = run_local(root, env, "--only", "gpu")
    host = data["hosts"]["me"]
    assert rc == 1 and host["status"] == "unhealthy", err
    bad = {k: v["message"] for k, v in host["checks"].items() if v["status"] != "pass"}
    assert set(bad) == {"gpu::clock_event_reasons", "gpu::clock_latch"}, bad
    assert "sw_thermal_slowdown, hw_thermal_slowdown (0x64)" in bad["gpu::clock_event_reasons"]
    assert "power-cycle" in bad["gpu::clock_latch"] and "690 MHz" in bad["gpu::clock_latch"]
    # the host's line names both, not only the first
    assert "gpu::clock_event_reasons" in host["message"] and "gpu::clock_latch" in host["message"]


def test_local_gpu_samples_fall_back_where_the_driver_refuses_a_field(tmp_path: Path) -> None:
    """A driver that refuses a field of builder.gpu.burn.SAMPLE_FIELDS (the fake answers only the
    fallback's list) is sampled with FALLBACK_SAMPLE_FIELDS: the latch is still judged."""
    from builder.gpu.burn import FALLBACK_SAMPLE_FIELDS

    root, env = local_project(tmp_path, H200)
    nv = tmp_path / "nvstate"
    capture = json.loads((nv / "capture.json").read_text())
    (nv / "capture.json").write_text(json.dumps(capture | {"sample_fields": ",".join(FALLBACK_SAMPLE_FIELDS)}))
    cols = auditlib.busy_sample().split(", ")
    busy = ", ".join(cols[:6] + cols[8:])  # (no temperature, no utilization)
    (nv / "sample").write_text(busy)
    q = auditlib.capture_sections()["query csv header"].replace("0x0000000000000001", "0x0000000000000004")
    (nv / "query").write_text(q)
    rc, data, err = run_local(root, env, "--only", "gpu")
    assert rc == 0 and data["hosts"]["me"]["checks"]["gpu::clock_latch"]["status"] == "pass", err
    (nv / "sample").write_text(busy.replace(", 1440, 1980, 690.", ", 690, 1980, 150."))
    rc, data, err = run_local(root, env, "--only", "gpu")
    latch = data["hosts"]["me"]["checks"]["gpu::clock_latch"]
    assert rc == 1 and latch["status"] == "fail" and "690 MHz" in latch["message"], err


def test_local_burn_defers_where_the_lanes_own_process_holds_the_gpu(tmp_path: Path) -> None:
    """With the lane's own rank on the GPU the burn skips and records `deferred` (deploy's burn window
    runs it on those hosts between stop and start)."""
    smi = str(tmp_path / "bin" / "nvidia-smi")
    root, env = local_project(tmp_path, H200 | {"burn": {"command": [smi, "--fake-burn", "4"], "seconds": 4}})
    own = {"BUILDER_LANE": "demo", "BUILDER_FLEET": "l", "BUILDER_HOST": "me", "BUILDER_RANK": "0"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={k: v for k, v in os.environ.items() if not k.startswith("BUILDER_")} | own)
    try:
        (tmp_path / "nvstate" / "apps").write_text(f"{proc.pid}, python3, 1024\n")
        rc, data, err = run_local(root, env, "--only", "burn")
    finally:
        proc.kill()
        proc.wait()
    check = data["hosts"]["me"]["checks"]["burn::gpu"]
    assert rc == 0 and check["status"] == "skip" and check["facts"] == {"deferred": True}, (check, err)


@pytest.mark.slow
def test_local_burn_reports_its_figures(tmp_path: Path) -> None:
    """`--only burn` with the FAKE load (the fake nvidia-smi's --fake-burn): TFLOPS, clock, power and
    the verdict in the JSON; a latched GPU fails naming the fix; no burn in the profile skips."""
    smi = str(tmp_path / "bin" / "nvidia-smi")
    burn = {"command": [smi, "--fake-burn", "4"], "seconds": 4}
    root, env = local_project(tmp_path, H200 | {"burn": burn})
    rc, data, err = run_local(root, env, "--only", "burn")
    check = data["hosts"]["me"]["checks"]["burn::gpu"]
    assert rc == 0 and check["status"] == "pass", err
    figures = check["facts"]["burn"]
    assert figures["verdict"] == "pass" and figures["tflops"] == 628.97 and figures["clock_mhz"] == 1440
    assert data["burn"]["hosts"]["me"]["tflops"] == 628.97
    (tmp_path / "nvstate" / "sample-busy").write_text(
        auditlib.busy_sample().replace(", 1440, 1980, 690.", ", 690, 1980, 150."))
    (tmp_path / "nvstate" / "tflops").write_text("210.5")
    rc, data, err = run_local(root, env, "--only", "burn")
    host = data["hosts"]["me"]
    assert rc == 1 and host["status"] == "unhealthy", err
    assert host["checks"]["burn::gpu"]["facts"]["burn"]["verdict"] == "latched"
    assert "unplugged for 30 to 60 s" in host["message"] and "clock latch" in err  # (for people)
    root2, env2 = local_project(tmp_path / "none", H200)
    rc, data, err = run_local(root2, env2, "--only", "burn")
    assert rc == 0 and data["hosts"]["me"]["checks"]["burn::gpu"]["status"] == "skip"
    root3, env3 = local_project(tmp_path / "off", H200 | {"burn": burn | {"enabled": False}})
    rc, data, err = run_local(root3, env3, "--only", "burn")
    check = data["hosts"]["me"]["checks"]["burn::gpu"]
    assert rc == 0 and check["status"] == "skip" and "enabled = false" in check["message"]


def test_local_gpu_drift_expected_vs_found(tmp_path: Path) -> None:
    wrong = H200 | {"gpu_name": "NVIDIA GB10", "compute_cap": "12.1", "gpu_clock_mhz": 2200}
    root, env = local_project(tmp_path, wrong)
    q = auditlib.capture_sections()["query csv header"].replace("0x0000000000000001", "0x0000000000000044")
    (tmp_path / "nvstate" / "query").write_text(q)  # the power cap (healthy) and a hardware thermal slowdown
    rc, data, err = run_local(root, env, "--only", "gpu")
    assert rc == 1 and data["hosts"]["me"]["status"] == "unhealthy"
    checks = data["hosts"]["me"]["checks"]
    bad = {k: v["message"] for k, v in checks.items() if v["status"] != "pass"}
    assert bad == {
        "gpu::name": "GPU 0 name: expected 'NVIDIA GB10', found 'NVIDIA H200'",
        "gpu::compute_capability": "GPU 0 compute capability: expected 12.1, found 9.0",
        "gpu::clock_ceiling": "GPU 0 max SM clock: expected >= 2200 MHz, found 1980 MHz",
        "gpu::clock_event_reasons": "clock event reasons: expected no hardware, thermal or power-brake slowdown, "
        "found GPU 0: hw_thermal_slowdown (0x44) (check the cooling and the power supply)",
        "gpu::clock_latch": "GPU idle: the latch shows only under load (burn::gpu judges it)",
    }, err
    assert "me: unhealthy: gpu::name: GPU 0 name" in err  # every reason, for people, beside the JSON


@pytest.mark.slow
def test_local_gpu_absent(tmp_path: Path) -> None:
    root, env = local_project(tmp_path, {"gpu_count": 0, "docker": False})
    env["PATH"] = "/usr/bin:/bin"  # no nvidia-smi
    rc, data, _ = run_local(root, env, "--only", "gpu")
    st = {v["status"] for v in data["hosts"]["me"]["checks"].values()}
    assert st == {"skip"} and rc == 0
    # a GPU expected and no nvidia-smi: fail, not skip
    f = root / "hosts" / "l.toml"
    f.write_text(f.read_text().replace("gpu_count = 0", "gpu_count = 1"))
    rc, data, _ = run_local(root, env, "--only", "gpu")
    assert rc == 1
    msgs = {v["message"] for v in data["hosts"]["me"]["checks"].values()}
    assert "nvidia-smi: expected on PATH (1 GPU(s) expected), found none" in msgs


@pytest.mark.slow
def test_local_models_engram_release_without_install(tmp_path: Path) -> None:
    """Nothing installed: model files absent fail, the apply record's absence fails release, the
    image's missing build record (a lock, no `builder image`) fails the image checks."""
    root, env = local_project(tmp_path, {"docker": False, "gpu_count": 0})
    rc, data, err = run_local(root, env, "--only", "models,release,engram,memory,storage,image", "--mode", "full")
    checks = data["hosts"]["me"]["checks"]
    assert checks["image::present_by_id"]["status"] == "fail"
    assert "expected a build record for input address" in checks["image::present_by_id"]["message"]
    assert checks["models::files_present"]["status"] == "fail"
    assert str(tmp_path / "m" / "tiny" / "config.json") in checks["models::files_present"]["message"]
    assert checks["release::record_identity"]["status"] == "fail"
    assert "apply record: expected" in checks["release::record_identity"]["message"]
    assert checks["engram::own_rank_files"]["status"] == "skip"
    assert rc == 1


@pytest.mark.slow
def test_local_without_lock_skips_lock_checks(tmp_path: Path) -> None:
    root, env = local_project(tmp_path, {"docker": False}, lock=False)
    rc, data, err = run_local(root, env, "--only", "models,release,image,gpu")
    checks = data["hosts"]["me"]["checks"]
    assert rc == 0, err
    for c in ("models::files_present", "release::record_identity", "release::record_image", "image::present_by_id",
              "image::diff_ids"):
        assert checks[c]["status"] == "skip" and "no lock file" in checks[c]["message"], (c, checks[c])
    assert checks["gpu::name"]["status"] == "skip"  # no gpu_name expected here
    assert checks["gpu::count"]["status"] == "pass"


def test_local_missing_inputs_fail_rather_than_skip(tmp_path: Path) -> None:
    """With a lock: no build record for its image, and an apply record without `files` or
    `manifest_sha256`, fail saying what was expected (a real Spark has them)."""
    root, env = local_project(tmp_path, {"docker": False, "gpu_count": 0})
    lock_hash = load_lock(root / "pins.lock").lock_hash()
    rec = {"host": "me", "fleet": "l", "lane": "demo", "rank": 0, "lock_hash": lock_hash, "image": {}}
    (tmp_path / "b" / "state").mkdir(parents=True)
    (tmp_path / "b" / "state" / "applied.json").write_text(json.dumps(rec))
    rc, data, err = run_local(root, env, "--only", "image,release")
    checks = data["hosts"]["me"]["checks"]
    assert rc == 1, err
    want = "image demo: expected a build record for input address "
    for c in ("image::present_by_id", "image::tag_points_at_image", "image::diff_ids", "image::labels",
              "release::record_image"):
        assert checks[c]["status"] == "fail" and checks[c]["message"].startswith(want), (c, checks[c])
        assert "(run `builder image demo`), found none" in checks[c]["message"]
    assert checks["release::manifest_hash"] == {
        "status": "fail", "message": "apply record: expected manifest_sha256 (the manifest's hash), found none"}
    assert checks["release::launch_files_unchanged"] == {
        "status": "fail",
        "message": "apply record: expected files (the release files, start.sh, stop.sh, rank.env), found none"}
    assert checks["release::record_identity"]["status"] == checks["release::record_lock"]["status"] == "pass"


@pytest.mark.skipif(any(Path("/sys/class/infiniband").glob("*")), reason="this machine has RDMA devices")
def test_local_rdma_expected_but_absent_fails(tmp_path: Path) -> None:
    root, env = local_project(tmp_path, {"docker": False, "gpu_count": 0})  # (expect.rdma: true by default)
    rc, data, err = run_local(root, env, "--only", "fabric")
    checks = data["hosts"]["me"]["checks"]
    assert rc == 1, err
    for c, v in checks.items():
        assert v["status"] == "fail" and v["message"].startswith("expected RDMA devices (expect.rdma = true"), (c, v)
        assert "found none in /sys/class/infiniband" in v["message"]
    f = root / "hosts" / "l.toml"
    f.write_text(f.read_text().replace("docker = false", "docker = false\nrdma = false"))
    rc, data, err = run_local(root, env, "--only", "fabric")
    assert rc == 0, err
    for v in data["hosts"]["me"]["checks"].values():
        assert v == {"status": "skip", "message": "RDMA not expected on this host (expect.rdma = false)"}


def _probe_checks(tmp_path: Path) -> Path:
    """A checks folder whose one check writes down how its pytest was started."""
    d = tmp_path / "checks"
    d.mkdir()
    (d / "pytest.ini").write_text("[pytest]\n")
    (d / "conftest.py").write_text(
        "def pytest_addoption(parser):\n"
        "    parser.addoption('--builder-expect')\n"
        "    parser.addoption('--builder-results')\n"
    )
    (d / "test_probe.py").write_text(
        "import json, os, sys\n"
        "def test_probe(pytestconfig):\n"
        "    with open(pytestconfig.option.builder_results, 'w') as f:\n"
        "        json.dump({'args': list(pytestconfig.invocation_params.args),\n"
        "                   'expect': pytestconfig.option.builder_expect,\n"
        "                   'hosts': pytestconfig.option.hosts, 'pid': os.getpid()}, f)\n"
    )
    return d


def test_each_host_runs_pytest_in_a_process_of_its_own(tmp_path: Path) -> None:
    """pytest per host, in a process of its own, with public options only: the check modules,
    testinfra's plugin, the host, and its expectations and results files."""
    checks = _probe_checks(tmp_path)
    got = []
    for i, hosts in enumerate(["local://", "docker://spark-a"]):  # (no command runs: nothing is contacted)
        res = tmp_path / f"r{i}.json"
        args = runner.pytest_args(checks, ["probe"], [f"--hosts={hosts}", f"--builder-expect=E{i}",
                                                      f"--builder-results={res}"])
        assert runner.run_pytest(args, tmp_path / f"log{i}", checks, 60) == 0, (tmp_path / f"log{i}").read_text()
        got.append(json.loads(res.read_text()))
        assert got[-1]["args"] == args
    assert [g["expect"] for g in got] == ["E0", "E1"] and [g["hosts"] for g in got] == ["local://", "docker://spark-a"]
    assert got[0]["pid"] != got[1]["pid"]


def test_a_host_that_runs_past_its_bound_is_killed_and_unreachable(tmp_path: Path) -> None:
    checks = _probe_checks(tmp_path)
    (checks / "test_probe.py").write_text("import time\ndef test_probe():\n    time.sleep(300)\n")
    args = runner.pytest_args(checks, ["probe"], ["--hosts=local://"])
    start = time.monotonic()
    assert runner.run_pytest(args, tmp_path / "log", checks, 3) is None
    assert time.monotonic() - start < 60


def test_checks_on_testinfras_own_host_fixture_get_each_hosts_own_host(tmp_path: Path) -> None:
    """A checks folder without builder's `host` fixture: testinfra's own, parametrized by each host's
    `--hosts`, gives each host's checks that host."""
    checks = _probe_checks(tmp_path)
    (checks / "test_probe.py").write_text(
        "import json\n"
        "def test_probe(host, pytestconfig):\n"
        "    with open(pytestconfig.option.builder_results, 'w') as f:\n"
        "        json.dump({'host': host.backend.get_pytest_id()}, f)\n"
    )
    got = []
    for i, spec in enumerate(["docker://spark-a", "local://"]):  # (no command runs: nothing is contacted)
        res = tmp_path / f"r{i}.json"
        args = runner.pytest_args(checks, ["probe"], [f"--hosts={spec}", "--builder-expect=E",
                                                      f"--builder-results={res}"])
        assert runner.run_pytest(args, tmp_path / f"log{i}", checks, 60) == 0
        got.append(json.loads(res.read_text())["host"])
    assert got == ["docker://spark-a", "local"]


def two_local_hosts(tmp_path: Path, checks: dict[str, str]) -> AuditOptions:
    """A fleet `l` of two hosts on this machine, audited with a copy of the real checks/ (its
    conftest and checklib) whose modules are `checks` (name -> source; "" for the real module)."""
    paths = auditlib.make_project(tmp_path / "proj")
    me = auditlib.local_host(tmp_path)
    hosts = [me, {**me, "name": "me2", "rank": 1, "role": "worker"}]
    (paths["hosts"] / "l.toml").write_text(auditlib.fleet_toml("l", hosts, expect={"docker": False}))
    d = tmp_path / "checks"
    d.mkdir()
    for name in ("conftest.py", "checklib.py", "pytest.ini", *checks):
        src = checks.get(name) or (ROOT / "checks" / name).read_text()
        (d / name).write_text(src)
    return AuditOptions(
        root=paths["pins"].parent, pins=paths["pins"], lock=paths["lock"], store=paths["store"], fleet="l",
        only=[n[5:-3] for n in checks], checks_dir=d, workdir=tmp_path / "work",
    )


def test_a_check_module_that_does_not_import_is_reported_by_every_host(tmp_path: Path) -> None:
    """Each host is `error` (exit 1), its message naming the module and the error."""
    opts = two_local_hosts(tmp_path, {"test_memory.py": "", "test_storage.py": "import no_such_module_here\n"})
    report = run_audit(opts)
    assert report.exit_code == 1
    assert [h.name for h in report.hosts] == ["me", "me2"]
    for h in report.hosts:
        assert h.status == "error", (h.name, h.status, h.message)
        assert h.message == "checks/test_storage.py: ModuleNotFoundError: No module named 'no_such_module_here'"
        assert h.checks == []  # (pytest runs nothing after a collection error)
        assert "no_such_module_here" in (tmp_path / "work" / "l" / h.name / "pytest.log").read_text()
    assert report.to_json()["hosts"]["me"]["message"].startswith("checks/test_storage.py: ")


def test_a_module_that_fails_at_import_time_or_does_not_parse_is_error(tmp_path: Path) -> None:
    opts = two_local_hosts(tmp_path, {"test_memory.py": "x = undefined_name\n", "test_storage.py": "def f(:\n"})
    report = run_audit(opts)
    assert report.exit_code == 1
    for h in report.hosts:
        assert h.status == "error"
        assert h.message == "checks/test_memory.py: NameError: name 'undefined_name' is not defined (+1 more)"


@pytest.mark.parametrize("empty", [["test_storage.py"], ["test_memory.py", "test_storage.py"]])
def test_a_selected_module_with_no_checks_is_error_not_pass(tmp_path: Path, empty: list[str]) -> None:
    """A selection (--only) that runs no check of a concern, or a checks folder with no checks at
    all: `error`, never a host that "passes" with nothing checked."""
    mods = {n: ("import os\n" if n in empty else "") for n in ("test_memory.py", "test_storage.py")}
    report = run_audit(two_local_hosts(tmp_path, mods))
    assert report.exit_code == 1
    code = 5 if len(empty) == 2 else 0  # (5: pytest collected nothing)
    for h in report.hosts:
        assert h.status == "error"
        assert h.message == f"no check ran from {', '.join('checks/' + n for n in empty)} (pytest exit {code})"


def test_stale_results_of_a_kept_workdir_do_not_stand_for_this_run(tmp_path: Path) -> None:
    opts = two_local_hosts(tmp_path, {"test_memory.py": ""})
    assert run_audit(opts).exit_code == 0
    assert opts.checks_dir is not None
    (opts.checks_dir / "conftest.py").write_text("raise RuntimeError('conftest broken')\n")
    report = run_audit(opts)
    assert report.exit_code == 1
    for h in report.hosts:
        assert h.status == "error" and h.message.startswith("the checks did not report (pytest exit 4)"), h.message


def test_results_problem_from_the_exit_status_alone(tmp_path: Path) -> None:
    ok = [CheckOutcome("memory::available", "memory", "pass")]
    assert runner.results_problem(0, ok, [], ["memory"], tmp_path / "checks", tmp_path / "log") == ""
    assert runner.results_problem(1, ok, [], ["memory"], tmp_path / "checks", tmp_path / "log") == ""
    (tmp_path / "log").write_text("x\nINTERNALERROR> boom\n")
    got = runner.results_problem(3, ok, [], ["memory"], tmp_path / "checks", tmp_path / "log")
    assert got == "the checks stopped (pytest exit 3): INTERNALERROR> boom"


def test_local_fields_a_gpu_does_not_report_are_unknown(tmp_path: Path) -> None:
    """[N/A] (as GB10 reports fields it does not have) is neither a pass nor a failure: the check skips
    and says what is used instead."""
    root, env = local_project(tmp_path, H200)
    q = auditlib.capture_sections()["query csv header"]
    head, row = q.strip().splitlines()
    cols, names = row.split(", "), [c.split(" [")[0] for c in head.split(", ")]
    for field in ("persistence_mode", "clocks.max.sm"):
        cols[names.index(field)] = "[N/A]"
    (tmp_path / "nvstate" / "query").write_text(f"{head}\n{', '.join(cols)}\n")
    rc, data, err = run_local(root, env, "--only", "gpu")
    checks = data["hosts"]["me"]["checks"]
    assert rc == 0, err
    ceiling, persistence = checks["gpu::clock_ceiling"], checks["gpu::persistence_mode"]
    assert ceiling["status"] == "skip" and "judged under load" in ceiling["message"]
    assert persistence["status"] == "skip" and "[N/A]" in persistence["message"]


def test_the_hosts_of_a_loaded_fleet_are_taken_from_it(tmp_path: Path) -> None:
    """An audit given a loaded fleet (a deploy's) selects its hosts from it: every host in rank order,
    or the named ones (the burn window's `fleet/host`), and refuses a host or fleet it does not have."""
    from builder.audit.selection import Loaded, audit_targets
    from builder.errors import ConfigError
    from builder.inputs.hosts import load_fleet

    path = tmp_path / "hosts" / "f.toml"
    path.parent.mkdir()
    path.write_text(auditlib.fleet_toml("f", [{"name": "a", "ssh": "spark@a", "rank": 0, "role": "head"},
                                              {"name": "b", "ssh": "spark@b", "rank": 1, "role": "worker"}]))
    loaded = Loaded(path, load_fleet(path))
    path.unlink()  # (not read again)

    def opts(**kw: Any) -> AuditOptions:
        return AuditOptions(root=tmp_path, pins=tmp_path / "pins.toml", lock=tmp_path / "pins.lock",
                                 store=tmp_path / "s", loaded=loaded, **kw)

    assert [t.name for t in audit_targets(opts(fleet="f"))] == ["a", "b"]
    assert [t.name for t in audit_targets(opts(names=["f/b"]))] == ["b"]
    with pytest.raises(ConfigError, match="no host named 'f/c'"):
        audit_targets(opts(names=["f/c"]))
    with pytest.raises(ConfigError, match="fleet 'f', not 'g'"):
        audit_targets(opts(fleet="g"))


def test_every_failing_reason_of_a_host_in_the_table_and_json(tmp_path: Path) -> None:
    """Two checks of one host fail: the text report and --json each name both, with their reasons."""
    wrong = H200 | {"gpu_name": "NVIDIA GB10", "driver_version": "1.0"}
    root, env = local_project(tmp_path, wrong)
    rc, data, err = run_local(root, env, "--only", "gpu")
    assert rc == 1, err
    problems = data["hosts"]["me"]["problems"]
    assert [p["check"] for p in problems] == ["gpu::name", "gpu::driver_version"], problems
    assert "GB10" in problems[0]["message"] and "1.0" in problems[1]["message"], problems
    r = cli(root, "audit", "--fleet", "l", "--only", "gpu", env=env | {"COLUMNS": "400"})
    assert r.returncode == 1, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("│ me ")]
    for p in problems:
        assert any(p["check"] in ln and p["message"] in ln for ln in rows), (p, r.stdout)
