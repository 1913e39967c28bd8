"""The burn gate's judgment (builder.gpu.burn) and its host side (builder.hostscripts.burnload, gpuprocs,
matmul), replaying the H200 captures of 2026-12-04 (tests/data/gpu-states) and the latched GB10 and
thermally throttled H200 built from the recipes' figures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builder import gpu
from builder.gpu import burn as B
from builder.hostscripts import burnload as hburn
from builder.hostscripts import gpuprocs, matmul

DATA = Path(__file__).parent / "data" / "gpu-states"
H200 = DATA / "h200-2026-12-04"


def _facts(path: Path) -> dict:
    return json.loads(path.read_text())


def test_h200_burn_passes_at_its_power_cap() -> None:
    res = B.judge(_facts(H200 / "burn-facts.json"), B.BANDS["NVIDIA H200"])
    assert res.verdict == "pass", res.message
    assert res.tflops == pytest.approx(628.97)
    # the sustained clock and power under load, not the idle start (torch's import) or the end
    assert 1395 <= (res.clock_mhz or 0) <= 1485 and 680 <= (res.power_w or 0) <= 695
    assert res.reasons == ["sw_power_cap"] and res.samples >= 20
    alone = [json.loads((H200 / f"alone-{i}.json").read_text())["tflops"] for i in (1, 2)]
    for a in alone:  # the burn's figure is the matmul's own, timed alone in the same run
        assert abs(res.tflops - a) / a < 0.15


def test_latched_gb10_fails_naming_the_fix() -> None:
    res = B.judge(_facts(DATA / "built" / "gb10-latched-burn.json"), B.BANDS["NVIDIA GB10"])
    assert res.verdict == "latched"
    assert (res.clock_mhz or 0) < 1000 and (res.power_w or 99) < 20
    assert "clock latch" in res.message and "unplugged for 30 to 60 s" in res.message
    assert "reboot does not clear" in res.fix


def test_healthy_gb10_passes() -> None:
    res = B.judge(_facts(DATA / "built" / "gb10-healthy-burn.json"), B.BANDS["NVIDIA GB10"])
    assert res.verdict == "pass", res.message
    assert res.clock_mhz is not None and res.clock_mhz > 2100


def test_thermal_throttle_fails_naming_every_bit() -> None:
    res = B.judge(_facts(DATA / "built" / "h200-thermal-burn.json"), B.BANDS["NVIDIA H200"])
    assert res.verdict == "throttled"
    assert "sw_thermal_slowdown" in res.message and "hw_thermal_slowdown" in res.message
    assert "sw_power_cap" not in res.message.split(":")[1]  # the power cap is not named as trouble
    assert res.fix == B.THROTTLE_FIX


def test_slow_but_not_latched() -> None:
    facts = _facts(H200 / "burn-facts.json")
    facts["stdout"] = json.dumps({"tflops": 300.0})
    res = B.judge(facts, B.BANDS["NVIDIA H200"])
    assert res.verdict == "slow" and "expected >= 450" in res.message and not res.fix


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"timed_out": True, "rc": None}, "did not finish"),
        ({"stdout": "", "stderr": "docker: Error response from daemon: no such image\n", "rc": 125}, "no such image"),
        ({"stdout": json.dumps({"error": "torch sees no CUDA device"}), "rc": 1}, "torch sees no CUDA device"),
        ({"samples": [{"t": 2.0, "rc": 9, "out": "NVIDIA-SMI has failed"}]}, "no sample showed GPU 0 busy"),
    ],
)
def test_burn_errors_say_why(change: dict, says: str) -> None:
    facts = _facts(H200 / "burn-facts.json") | change
    res = B.judge(facts, B.BANDS["NVIDIA H200"])
    assert res.verdict == "error" and says in res.message and "GPU 0" in res.message, res.message


def test_every_verdict_names_the_gpu_it_judged() -> None:
    """The burn loads GPU 0 (checks/test_burn.py): pass and fail alike say which GPU was judged."""
    for path, band in ((H200 / "burn-facts.json", "NVIDIA H200"), (DATA / "built" / "gb10-latched-burn.json",
                       "NVIDIA GB10"), (DATA / "built" / "h200-thermal-burn.json", "NVIDIA H200")):
        res = B.judge(_facts(path), B.BANDS[band])
        assert res.message.startswith("GPU 0"), res.message


def test_band_for_and_profile_floor() -> None:
    assert B.band_for("NVIDIA GB10") == B.BANDS["NVIDIA GB10"]
    assert B.band_for("NVIDIA A100") is None
    own = B.band_for("NVIDIA A100", 200)
    assert own is not None and own.min_tflops == 200 and own.latch_clock_mhz == 0
    floor = B.band_for("NVIDIA H200", 500.0)
    assert floor is not None and floor.min_tflops == 500.0 and floor.source == "the host profile (min_tflops)"
    assert floor.latch_clock_mhz == B.BANDS["NVIDIA H200"].latch_clock_mhz  # the rest is the model's band


def test_fleet_outliers_name_the_slow_host() -> None:
    out = B.fleet_outliers({"spark1": 82.0, "spark2": 80.5, "spark3": 31.2, "spark4": 84.0})
    assert list(out) == ["spark3"] and "median" in out["spark3"]
    assert B.fleet_outliers({"a": 80.0}) == {}
    assert B.fleet_outliers({"a": 80.0, "b": 79.0, "c": 81.0}) == {}


def test_captured_states_read_rightly() -> None:
    """Idle: low clocks, the idle bit; busy (foreign or the lane's own): the power cap, no trouble."""
    for state, clock_max, cap in (("idle", 400, False), ("foreign", 1980, True), ("own", 1980, True)):
        (g,) = gpu.parse_query((H200 / f"{state}-query.txt").read_text())
        assert g.name == "NVIDIA H200" and (g.clocks_sm_mhz or 0) <= clock_max
        assert not g.throttled, state
        assert ("sw_power_cap" in gpu.decode_event_reasons(g.event_reasons or 0)) is cap
        (s,) = gpu.parse_query((H200 / f"{state}-sample.txt").read_text(), B.SAMPLE_FIELDS)
        assert B.busy(s) is cap
    assert gpu.parse_compute_apps((H200 / "idle-apps.txt").read_text()) == []
    (foreign,) = gpu.parse_compute_apps((H200 / "foreign-apps.txt").read_text())
    assert json.loads((H200 / "foreign-procs.json").read_text())["pids"][str(foreign.pid)] == {}
    (own,) = gpu.parse_compute_apps((H200 / "own-apps.txt").read_text())
    env = json.loads((H200 / "own-procs.json").read_text())["pids"][str(own.pid)]
    assert env["BUILDER_LANE"] == "demo" and env["BUILDER_RANK"] == "0"


def test_sampler_runs_a_real_load(tmp_path: Path) -> None:
    """builder.hostscripts.burnload: a real process as the load, a real executable answering the samples."""
    smi = tmp_path / "smi"
    row = "0, NVIDIA H200, 1440, 1980, 690.00, 700.00, 63, 99, 0x0000000000000004, 723"
    smi.write_text(f"#!/bin/sh\necho '{row}'\n")
    smi.chmod(0o755)
    load = [sys.executable, "-c", "import time, json; time.sleep(3); print(json.dumps({'tflops': 600.0}))"]
    facts = hburn.run({"command": load, "timeout": 20, "interval": 0.25, "query": [str(smi)]})
    assert facts["rc"] == 0 and not facts["timed_out"] and facts["samples"][0]["t"] == -1.0
    assert len(facts["samples"]) >= 2  # (a loaded machine starts the sampler's children slowly)
    res = B.judge(facts, B.BANDS["NVIDIA H200"])
    assert res.verdict == "pass" and res.tflops == 600.0 and res.clock_mhz == 1440


def test_sampler_kills_a_hung_load(tmp_path: Path) -> None:
    facts = hburn.run({"command": [sys.executable, "-c", "import time; time.sleep(60)"], "timeout": 0.6,
                       "interval": 0.2, "query": ["true"]})
    assert facts["timed_out"] and facts["rc"] is None and facts["seconds"] < 5
    missing = hburn.run({"command": [str(tmp_path / "nope")], "timeout": 5, "query": ["true"]})
    assert missing["rc"] == 127


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_ends_the_load_it_runs_in_a_session_of_its_own(tmp_path: Path, sig: signal.Signals) -> None:
    """The burn's step ended on the host (its ssh channel gone: the watchdog TERMs the step's group, which
    the load, in a session of its own, is not in): burnload ends the load before it exits, 128 + 15; killed
    before it could (the watchdog's KILL on a starved host), the load dies with it (its parent-death signal)."""
    started = tmp_path / "load.pid"
    load = [sys.executable, "-c", f"import os, time; open({str(started)!r}, 'w').write(str(os.getpid())); "
                                  "time.sleep(300)"]
    req = json.dumps({"command": load, "timeout": 600, "interval": 0.2, "query": ["true"]})
    proc = subprocess.Popen([sys.executable, hburn.__file__, req], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not (started.exists() and started.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    pid = int(started.read_text())
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM and "ended by signal 15" in err, err
    else:
        assert proc.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # (killed and reaped by burnload before it exits)
            os.kill(pid, 0)
            time.sleep(0.05)


def test_gpuprocs_reads_the_builder_variables() -> None:
    env = gpuprocs.builder_env(b"PATH=/bin\0BUILDER_LANE=demo\0BUILDER_RANK=1\0X=BUILDER_LANE=no\0")
    assert env == {"BUILDER_LANE": "demo", "BUILDER_RANK": "1"}
    got = gpuprocs.read([os.getpid(), 2**22 + 7])
    assert isinstance(got["pids"][str(os.getpid())], dict)
    assert got["pids"][str(2**22 + 7)] is None and got["why"][str(2**22 + 7)]


def test_matmul_request_and_arithmetic() -> None:
    assert matmul.request(["x"])["size"] == 4096
    assert matmul.tflops(4096, 54880, 12.003) == pytest.approx(628.4, rel=1e-3)  # alone-1.json's figures
    for bad in ('{"dtype": "int8"}', '{"seconds": 0}', '{"size": 3}'):
        with pytest.raises(ValueError):
            matmul.request(["x", bad])


def test_matmul_needs_torch_alone_and_is_sent_as_it_is() -> None:
    """The load runs in the lane's image: its top level is the standard library; torch only in burn()."""
    import ast

    from builder import hostscripts as hs

    src = hs.source("matmul")
    assert src == hs.MATMUL
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    tree = ast.parse(src)
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    assert all((getattr(n, "module", None) or n.names[0].name).split(".")[0] in stdlib for n in top)
    inner = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) and n not in top for a in n.names}
    assert inner == {"torch"}


def test_the_profiles_command_is_filled_in_one_pass() -> None:
    """checks/test_burn.py fills {image}, {matmul} and {request}; the matmul's source is not searched again."""
    from tests.lib.checkmods import check_module

    burn = check_module("burn")
    spark = ["docker", "run", "--rm", "--gpus", "all", "{image}", "python3", "-c", "{matmul}", "{request}"]
    argv = burn.command({"command": spark, "seconds": 12}, {"image": {"image_id": "sha256:ab"}})
    assert argv[5] == "sha256:ab" and argv[8] == hostscripts_source("matmul") and json.loads(argv[9]) == {"seconds": 12}
    with pytest.raises(pytest.fail.Exception, match="the lane's image is unknown: no lock"):
        burn.command({"command": spark, "seconds": 12}, {"image": None, "image_reason": "no lock"})


def hostscripts_source(name: str) -> str:
    from builder import hostscripts as hs

    return hs.source(name)


@pytest.mark.parametrize("run", ["h200-2026-12-04-audit", "h200-2026-12-04-final"])
def test_the_recorded_h200_audits_say_what_the_docs_say(run: str) -> None:
    """docs/burn-h200.md's figures are these files': idle and the lane's own load pass, the foreign load
    is named (and refuses the burn), and the burn is within 15% of the matmul timed alone."""
    d = DATA / run

    def audit(state: str) -> dict:
        assert (d / f"{state}-audit.txt").read_text().rstrip().endswith("exit " + ("1" if state in (
            "foreign", "burning") else "0"))
        return json.loads((d / f"{state}-audit.json").read_text())

    assert audit("idle")["hosts"]["h200"]["status"] == "pass"
    own = audit("own")["hosts"]["h200"]
    assert own["status"] == "pass" and own["checks"]["burn::gpu"]["status"] == "skip"
    foreign = audit("foreign")["hosts"]["h200"]
    (pid,) = [a.pid for a in gpu.parse_compute_apps((d / "foreign-apps.txt").read_text())]
    assert foreign["status"] == "drift" and f"pid {pid} python3" in foreign["message"]
    bad = {k for k, v in foreign["checks"].items() if v["status"] == "fail"}
    assert bad == {"gpu::no_other_compute_process", "burn::gpu"}
    assert foreign["checks"]["gpu::clock_event_reasons"]["status"] == "pass"  # 0x4 at full load
    burned = audit("burn")["burn"]["hosts"]["h200"]
    alone = [json.loads((d / f"alone-{i}.json").read_text())["tflops"] for i in (1, 2)]
    assert burned["verdict"] == "pass" and all(abs(burned["tflops"] - a) / a < 0.15 for a in alone)
    if (d / "burning-audit.json").exists():
        busy = audit("burning")["hosts"]["h200"]["checks"]
        assert busy["gpu::clock_latch"]["status"] == busy["gpu::clock_event_reasons"]["status"] == "pass"
    doc_states_the_recorded_figures(run, burned, pid)


DOCS = Path(__file__).resolve().parents[1] / "docs"


def doc_states_the_recorded_figures(run: str, burned: dict, pid: int) -> None:
    """docs/burn-h200.md's row for the audited burn and its foreign process's pid are the recorded ones."""
    import re

    doc = (DOCS / "burn-h200.md").read_text()
    when, nth = {"h200-2026-12-04-audit": ("16:43", 1), "h200-2026-12-04-final": ("16:51", 2)}[run]
    row = re.search(rf"^\| {when}, through `builder audit --only burn` \| \| ([\d.]+) TFLOPS, (\d+) MHz, "
                    r"([\d.]+) W, (\d+) C \|", doc, re.M)
    assert row, f"docs/burn-h200.md: no row for the {when} audit's burn"

    def shown(value: float, text: str) -> str:
        return f"{value:.{len(text.partition('.')[2])}f}"

    tflops, clock, power, temp = row.groups()
    assert (shown(burned["tflops"], tflops), int(clock), shown(burned["power_w"], power), int(temp)) == (
        tflops, burned["clock_mhz"], power, burned["temperature_c"])
    pids = re.search(r"^\| foreign \|.*?\| pid (\d+) / (\d+) / (\d+) `python3`", doc, re.M)
    assert pids and int(pids.group(1 + nth)) == pid, "docs/burn-h200.md: the foreign process's pid"
    assert f"pid {pid}" in doc.split("| foreign |", 1)[1].split("\n", 1)[0]  # (its audit row names it)


def test_sampler_cleans_up_before_and_after_a_killed_load(tmp_path: Path) -> None:
    """A container outlives its killed CLI: the profile's cleanup runs before the load and after the kill."""
    marks = tmp_path / "marks"
    cleanup = [sys.executable, "-c", f"open({str(marks)!r}, 'a').write('x'); raise SystemExit(3)"]
    facts = hburn.run({"command": [sys.executable, "-c", "import time; time.sleep(60)"], "timeout": 0.6,
                       "interval": 0.2, "query": ["true"], "cleanup": cleanup})
    assert facts["timed_out"] and marks.read_text() == "xx"
    assert [(c["when"], c["rc"]) for c in facts["cleanup"]] == [("before", 3), ("after timeout", 3)]
    res = B.judge(facts, B.BANDS["NVIDIA H200"])
    assert res.verdict == "error" and "its cleanup failed (exit 3)" in res.message
    marks.unlink()
    done = hburn.run({"command": ["true"], "timeout": 5, "query": ["true"], "cleanup": cleanup})
    assert done["rc"] == 0 and marks.read_text() == "x"  # (a load that ends cleans up after itself)


def test_sampler_falls_back_where_a_field_is_refused(tmp_path: Path) -> None:
    """One unknown field fails the whole query (lessons.md §9.1): a driver that refuses
    temperature.gpu is sampled with FALLBACK_SAMPLE_FIELDS, and the result says so."""
    smi = tmp_path / "smi"
    row = "0, NVIDIA H200, 1440, 1980, 690.00, 700.00, 0x0000000000000004, 723"
    smi.write_text("#!/bin/sh\ncase \"$1\" in *temperature.gpu*)\n"
                   "  echo 'Field \"temperature.gpu\" is not a valid field to query.'; exit 2;;\nesac\n"
                   f"echo '{row}'\n")
    smi.chmod(0o755)
    load = [sys.executable, "-c", "import time, json; time.sleep(1); print(json.dumps({'tflops': 600.0}))"]
    req = {"command": load, "timeout": 20, "interval": 0.25, "query": B.sample_command(str(smi)),
           "fallback": B.sample_command(str(smi), fallback=True)}
    facts = hburn.run(req)
    assert facts["fields"] == "fallback" and all(s["rc"] == 0 for s in facts["samples"]), facts["samples"]
    res = B.judge(facts, B.BANDS["NVIDIA H200"])
    assert res.verdict == "pass" and res.clock_mhz == 1440 and res.samples >= 1, res.message
    refused = hburn.run(req | {"fallback": None})
    assert refused["fields"] == "query" and refused["samples"][0]["rc"] == 2
    assert B.judge(refused, B.BANDS["NVIDIA H200"]).verdict == "error"
