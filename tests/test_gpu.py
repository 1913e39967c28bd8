"""builder.gpu on real H200 captures (driver 580.159.04), plus fuzzing: BuilderError or a valid result."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder import gpu
from builder.errors import BuilderError

DATA = Path(__file__).parent / "data" / "nvidia-smi"
PROBE = DATA / "h200-nvidia-smi-probe.txt"

# The fields of the capture's "query csv noheader,nounits" section, in the order it printed them.
NOUNITS_FIELDS = [
    "index",
    "uuid",
    "driver_version",
    "persistence_mode",
    "clocks.sm",
    "clocks.max.sm",
    "clocks.applications.graphics",
    "clocks_event_reasons.active",
    "memory.total",
    "memory.free",
]


def section(name: str) -> str:
    """The lines under '== NAME' in the probe capture, up to the next '== ' heading."""
    out: list[str] = []
    inside = False
    for line in PROBE.read_text().splitlines():
        if line.startswith("== "):
            inside = line[3:].strip() == name
            continue
        if inside:
            out.append(line)
    assert out, name
    return "\n".join(out) + "\n"


def live(name: str) -> Path | None:
    p = DATA / f"h200-live-{name}.txt"
    return p if p.exists() else None


# ---------------------------------------------------------------- real captures


def test_query_with_header_and_units_maps_every_field() -> None:
    text = section("query csv header")
    (g,) = gpu.parse_query(text, gpu.QUERY_FIELDS)
    assert g.index == 0
    assert g.uuid == "GPU-19edd016-0734-b172-2c2f-316f0b8222a7"
    assert g.name == "NVIDIA H200"
    assert g.pci_bus_id == "00000000:00:06.0"
    assert g.driver_version == "580.159.04"
    assert g.vbios_version == "96.00.A5.00.1A"
    assert g.persistence_mode is True
    assert g.pstate == "P0"
    assert (g.clocks_sm_mhz, g.clocks_max_sm_mhz) == (555, 1980)
    assert (g.clocks_mem_mhz, g.clocks_max_mem_mhz) == (3201, 3201)
    assert g.clocks_applications_graphics_mhz == 1980
    assert g.clocks_applications_memory_mhz == 3201
    assert g.clocks_default_applications_graphics_mhz == 1980
    assert g.event_reasons == 0x1
    assert gpu.decode_event_reasons(g.event_reasons) == ["gpu_idle"]
    assert g.throttled is False
    assert (g.memory_total_mib, g.memory_used_mib, g.memory_free_mib) == (143771, 0, 143156)
    assert g.ecc_mode is True and g.mig_mode is False
    assert g.power_limit_w == 700.0
    assert g.compute_cap == "9.0"


def test_query_noheader_nounits_maps_by_requested_order() -> None:
    (g,) = gpu.parse_query(section("query csv noheader,nounits"), NOUNITS_FIELDS)
    assert g.uuid == "GPU-19edd016-0734-b172-2c2f-316f0b8222a7"
    assert g.driver_version == "580.159.04"
    assert g.persistence_mode is True
    assert g.clocks_sm_mhz == 510 and g.clocks_max_sm_mhz == 1980
    assert g.clocks_applications_graphics_mhz == 1980
    assert g.event_reasons == 1 and gpu.decode_event_reasons(g.event_reasons) == ["gpu_idle"]
    assert g.memory_total_mib == 143771 and g.memory_free_mib == 143156
    assert g.name is None and g.compute_cap is None  # not requested


def test_old_throttle_spelling_is_the_same_attribute() -> None:
    (g,) = gpu.parse_query(section("old throttle spelling"), ["clocks_throttle_reasons.active"])
    assert g.index == 0 and g.event_reasons == 1


def test_bad_field_error_is_one_clear_line() -> None:
    with pytest.raises(gpu.GpuParseError) as e:
        gpu.parse_query(section("bad field"), ["index", "not.a.field"])
    msg = str(e.value)
    assert "not.a.field" in msg and "not a valid field" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "name", ["nvidia-smi --version", "nvidia-smi (summary head)", "-q head (driver/cuda)"]
)
def test_versions_from_every_form(name: str) -> None:
    v = gpu.parse_version(section(name))
    assert v["driver"] == "580.159.04"
    assert v["cuda"] == "13.0"


def test_version_output_details() -> None:
    v = gpu.parse_version(section("nvidia-smi --version"))
    assert v == {"driver": "580.159.04", "cuda": "13.0", "nvml": "580.159", "nvidia_smi": "580.159.04"}


def test_version_from_xml_tags() -> None:
    v = gpu.parse_version(section("nvidia-smi -q -x (cuda/driver tags)"))
    assert (v["driver"], v["cuda"]) == ("580.159.04", "13.0")


def test_version_missing_is_an_error() -> None:
    with pytest.raises(gpu.GpuParseError, match="neither a driver nor a CUDA version"):
        gpu.parse_version(section("topo -m"))


@pytest.mark.parametrize("name", ["query", "version", "apps"])
def test_live_h200_captures(name: str) -> None:
    """The raw outputs of the recorded H200 run (docs/h200-run.md), when present."""
    p = live(name)
    if p is None:
        pytest.skip(f"no live capture {name} recorded")
    text = p.read_text()
    if name == "query":
        (g,) = gpu.parse_query(text, gpu.QUERY_FIELDS)
        assert g.name == "NVIDIA H200" and g.compute_cap == "9.0"
        assert g.memory_total_mib == 143771
        assert g.driver_version is not None and g.driver_version.startswith("580.")
    elif name == "version":
        v = gpu.parse_version(text)
        assert v["cuda"] == "13.0" and (v["driver"] or "").startswith("580.")
    else:
        assert all(a.pid > 0 for a in gpu.parse_compute_apps(text))


# ---------------------------------------------------------------- quirks and shapes


def test_not_available_values_become_none() -> None:
    # GB10 style: unified memory, so the memory fields and some clocks say [N/A]
    line = (
        "0, GPU-0000, NVIDIA GB10, 0000000F:01:00.0, 580.95.05, [N/A], Enabled, P0, 2405, 3003, "
        "[N/A], [N/A], [N/A], [N/A], [N/A], 0x0000000000000000, [N/A], [N/A], [N/A], [N/A], [N/A], "
        "[Not Supported], 12.1\n"
    )
    (g,) = gpu.parse_query(line, gpu.QUERY_FIELDS)
    assert g.name == "NVIDIA GB10" and g.compute_cap == "12.1"
    assert g.memory_total_mib is None and g.memory_used_mib is None and g.memory_free_mib is None
    assert g.clocks_mem_mhz is None and g.vbios_version is None and g.power_limit_w is None
    assert g.ecc_mode is None and g.mig_mode is None
    assert g.event_reasons == 0 and gpu.decode_event_reasons(g.event_reasons) == []


def test_several_gpus_and_blank_lines() -> None:
    text = "0, NVIDIA H200, 9.0\n\n1, NVIDIA H200, 9.0\r\n"
    gpus = gpu.parse_query(text, ["index", "name", "compute_cap"])
    assert [g.index for g in gpus] == [0, 1]


def test_unknown_fields_are_kept_as_text() -> None:
    (g,) = gpu.parse_query("0, 37, Default\n", ["index", "temperature.gpu", "compute_mode"])
    assert g.temperature_c == 37 and g.other == {"compute_mode": "Default"}


def test_empty_output_means_no_gpus() -> None:
    assert gpu.parse_query("", gpu.QUERY_FIELDS) == []


@pytest.mark.parametrize(
    ("text", "fields", "needle"),
    [
        ("0, x\n", ["index"], "2 values for 1 fields"),
        ("zero\n", ["index"], "whole number"),
        ("0, Maybe\n", ["index", "persistence_mode"], "Enabled or Disabled"),
        ("0, 0x1z\n", ["index", "clocks_event_reasons.active"], "hex bitmask"),
        ("0, nine\n", ["index", "compute_cap"], "compute capability"),
        ("0, X9\n", ["index", "pstate"], "performance state"),
        ("0\n0\n", ["index"], "same GPU index"),
        ("-1\n", ["index"], "negative index"),
        ("[N/A]\n", ["index"], "index is not available"),
    ],
)
def test_malformed_rows_name_the_problem(text: str, fields: list[str], needle: str) -> None:
    with pytest.raises(gpu.GpuParseError, match=needle) as e:
        gpu.parse_query(text, fields)
    assert "\n" not in str(e.value)


def test_driver_failure_text_is_a_gpu_error() -> None:
    text = (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n"
    )
    with pytest.raises(gpu.GpuError, match="NVIDIA-SMI has failed"):
        gpu.parse_query(text)


def test_event_reasons() -> None:
    assert gpu.decode_event_reasons(0) == []
    assert gpu.decode_event_reasons(0x1FF) == list(gpu.EVENT_REASON_BITS)
    assert gpu.decode_event_reasons(0x1 | 0x400) == ["gpu_idle", "unknown_0x400"]
    # the software power cap is a healthy GPU at full load, not trouble
    for fine in (0x1, 0x2, 0x4, 0x10, 0x4 | 0x10):
        assert not gpu.is_throttled(fine)
    for bit in (0x8, 0x20, 0x40, 0x80):
        assert gpu.is_throttled(bit | 0x4)
    assert gpu.trouble_reasons(0x4 | 0x8 | 0x40) == ["hw_slowdown", "hw_thermal_slowdown"]
    for bad in (-1, 1 << 64, "1", 1.0, True):
        with pytest.raises(gpu.GpuParseError):
            gpu.decode_event_reasons(bad)  # type: ignore[arg-type]


def test_compute_apps() -> None:
    assert gpu.parse_compute_apps("") == []
    assert gpu.parse_compute_apps("No running processes found\n") == []
    apps = gpu.parse_compute_apps("1234, /usr/bin/python3, 80123\n99, /opt/a, b/vllm, [N/A]\n")
    assert [(a.pid, a.process_name, a.used_memory_mib) for a in apps] == [
        (1234, "/usr/bin/python3", 80123),
        (99, "/opt/a, b/vllm", None),
    ]
    with pytest.raises(gpu.GpuParseError, match="pid"):
        gpu.parse_compute_apps("abc, x, 1\n")
    with pytest.raises(gpu.GpuParseError, match="3 values"):
        gpu.parse_compute_apps("12\n")


def recorded_h200(*, lacks_compute_cap: bool = False) -> gpu.Runner:
    """nvidia-smi on the recorded H200: each command docs/h200-probe.sh ran is answered with what it printed
    (h200-live-*.txt); any other command has no recorded answer and fails the test. With `lacks_compute_cap`,
    an older driver: a query naming that field is refused as the H200 refused a field it lacks ("bad field"
    in the probe capture, exit 2)."""
    nounits = "--format=csv,noheader,nounits"
    answers = {
        ("nvidia-smi", "--query-gpu=" + ",".join(gpu.QUERY_FIELDS), nounits): "query",
        ("nvidia-smi", "--query-gpu=" + ",".join(gpu.FALLBACK_FIELDS), nounits): "fallback",
        ("nvidia-smi", "--version"): "version",
        ("nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", nounits): "apps",
    }
    refusal = section("bad field").split("rc=")[0].replace("not.a.field", "compute_cap")

    def run(argv: list[str]) -> tuple[int, str, str]:
        if lacks_compute_cap and any(a.startswith("--query-gpu=") and "compute_cap" in a for a in argv):
            return 2, refusal, ""
        name = answers.get(tuple(argv))
        assert name is not None, f"no recorded answer of nvidia-smi to {argv}"
        return 0, (DATA / f"h200-live-{name}.txt").read_text(), ""

    return run


def test_the_probe_reads_the_recorded_h200_and_an_older_drivers_answer() -> None:
    """The probe's commands, answered as the H200 answered them, give its GPU; a driver that refuses
    compute_cap gets the older field list, which it answers, and the same GPU less what that list lacks."""
    new = gpu.probe(recorded_h200())
    assert not new.fallback and (new.driver_version, new.cuda_version) == ("580.159.04", "13.0")
    (g,) = new.gpus
    assert (g.name, g.compute_cap, g.memory_total_mib, g.clocks_max_sm_mhz) == ("NVIDIA H200", "9.0", 143771, 1980)
    old = gpu.probe(recorded_h200(lacks_compute_cap=True))
    assert old.fallback and old.fields == gpu.FALLBACK_FIELDS and old.compute_apps == new.compute_apps == []
    (o,) = old.gpus
    assert o.compute_cap is None and o.vbios_version is None and o.mig_mode is None
    shared = ("index", "uuid", "name", "pci_bus_id", "driver_version", "persistence_mode", "clocks_max_sm_mhz",
              "clocks_max_mem_mhz", "event_reasons", "memory_total_mib", "power_limit_w")
    assert {k: getattr(o, k) for k in shared} == {k: getattr(g, k) for k in shared}


# ---------------------------------------------------------------- probe with a real executable


def _fake_smi(tmp_path: Path, body: str) -> Path:
    """A real executable standing in for nvidia-smi (there is no GPU on the CI machine)."""
    p = tmp_path / "nvidia-smi"
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def test_probe_local_runs_the_executable(tmp_path: Path) -> None:
    query = section("query csv header").splitlines()[1]
    body = f"""case "$1" in
  --query-gpu=*) echo '{query}' ;;
  --version) printf '%s' '{section("nvidia-smi --version")}' ;;
  --query-compute-apps=*) echo '4242, /usr/bin/python3, 1024' ;;
  *) exit 9 ;;
esac
"""
    report = gpu.probe_local(str(_fake_smi(tmp_path, body)))
    assert report.driver_version == "580.159.04" and report.cuda_version == "13.0"
    assert report.gpus[0].name == "NVIDIA H200" and report.fallback is False
    assert [a.pid for a in report.compute_apps] == [4242]


def test_probe_falls_back_on_an_old_driver(tmp_path: Path) -> None:
    row = "0, GPU-1, Tesla V100, 0000:00:04.0, 470.1.2, Enabled, P0, 1380, 1530, 877, 877, 0x1, "
    row += "16160, 0, 16160, 300.00"
    body = f"""case "$1" in
  *compute_cap*) echo 'Field "compute_cap" is not a valid field to query.'; exit 2 ;;
  --query-gpu=*) echo '{row}' ;;
  --version) exit 1 ;;
  --query-compute-apps=*) ;;
  *) echo '| NVIDIA-SMI 470.1.2    Driver Version: 470.1.2    CUDA Version: 11.4 |' ;;
esac
"""
    report = gpu.probe_local(str(_fake_smi(tmp_path, body)))
    assert report.fallback and report.fields == gpu.FALLBACK_FIELDS
    assert report.cuda_version == "11.4" and report.driver_version == "470.1.2"
    assert report.gpus[0].event_reasons == 1 and report.compute_apps == []


def test_probe_local_missing_or_hanging(tmp_path: Path) -> None:
    with pytest.raises(gpu.GpuError, match="not found"):
        gpu.probe_local(str(tmp_path / "no-such-nvidia-smi"))
    hang = _fake_smi(tmp_path, "exec sleep 30\n")
    with pytest.raises(gpu.GpuError, match="no answer"):
        gpu.probe_local(str(hang), timeout=0.5)


def test_probe_local_failure_exit(tmp_path: Path) -> None:
    smi = _fake_smi(tmp_path, "echo 'No devices were found'; exit 6\n")
    with pytest.raises(gpu.GpuError, match="No devices were found"):
        gpu.probe_local(str(smi))


def test_probe_uses_path_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(gpu.GpuError, match="not found on PATH"):
        gpu.probe_local()
    assert os.environ["PATH"] == str(tmp_path)


# ---------------------------------------------------------------- fuzzing

_REAL_QUERY = section("query csv header").splitlines()[1]
_TOKENS = [
    "[N/A]", "[Not Supported]", "0x0000000000000001", "0x", "9.0", "Enabled", "Disabled", "P0", "MHz",
    ",", ", ", "\n", "\r\n", " ", "-1", "1e9", "99999999999999999999999", "\x00", "é", "[", "]",
    'Field "x" is not a valid field to query.', "CUDA Version: ", "Driver Version: ", "13.0",
    "580.159.04", "NVIDIA-SMI has failed", "\ud800",
]  # fmt: skip


@st.composite
def mutated(draw: st.DrawFn, base: str) -> str:
    """The real text with random cuts, insertions and replacements."""
    text = base
    for _ in range(draw(st.integers(0, 6))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 12)))
        ins = draw(st.one_of(st.sampled_from(_TOKENS), st.text(max_size=8)))
        text = text[:i] + ins + text[j:]
    return text


def _texts(base: str) -> st.SearchStrategy[str]:
    return st.one_of(mutated(base), st.text(max_size=200), st.lists(st.sampled_from(_TOKENS)).map("".join))


FUZZ = settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))


def _valid_or_builder_error(fn, *args):  # type: ignore[no-untyped-def]
    try:
        return fn(*args)
    except BuilderError as e:
        assert "\n" not in str(e) and str(e)
        return None


@FUZZ
@given(_texts(_REAL_QUERY + "\n"), st.sampled_from([gpu.QUERY_FIELDS, gpu.FALLBACK_FIELDS, NOUNITS_FIELDS]))
def test_fuzz_parse_query(text: str, fields: list[str]) -> None:
    out = _valid_or_builder_error(gpu.parse_query, text, fields)
    if out is not None:
        assert all(isinstance(g, gpu.GpuInfo) for g in out)


@FUZZ
@given(_texts(section("nvidia-smi --version") + section("nvidia-smi (summary head)")))
def test_fuzz_parse_version(text: str) -> None:
    out = _valid_or_builder_error(gpu.parse_version, text)
    if out is not None:
        assert out["driver"] is not None or out["cuda"] is not None


@FUZZ
@given(_texts("1234, /usr/bin/python3, 80123\n99, /opt/vllm, [N/A]\n"))
def test_fuzz_parse_compute_apps(text: str) -> None:
    out = _valid_or_builder_error(gpu.parse_compute_apps, text)
    if out is not None:
        assert all(a.pid > 0 for a in out)


@FUZZ
@given(st.one_of(st.integers(), st.text(max_size=5), st.none(), st.floats()))
def test_fuzz_event_reasons(mask: object) -> None:
    _valid_or_builder_error(gpu.decode_event_reasons, mask)
    _valid_or_builder_error(gpu.is_throttled, mask)
