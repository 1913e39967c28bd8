"""nvidia-smi output parsing and a local GPU probe.

Only text in, models out: the parsers never raise anything but a BuilderError subclass
(one line) whatever the text, so the audit can report garbage from a host as a finding.
Facts this module relies on (lessons.md §9.1, captured on an H200 with driver 580.159.04):

- one ``--query-gpu`` call gives one line per GPU; parse ``csv,noheader,nounits`` and map
  columns by the order requested (the header names are canonical, not the requested ones);
- values that do not apply read ``[N/A]`` or ``[Not Supported]`` (GB10's unified memory
  reports its memory fields so); a value may keep its unit (``555 MHz``) if ``nounits``
  was dropped, and the parser accepts both;
- one unknown field fails the whole query (``Field "x" is not a valid field to query.``,
  exit 2), so an older driver gets :data:`FALLBACK_FIELDS`;
- the CUDA version is not a query field: it comes from ``nvidia-smi --version`` or the
  summary table header.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from builder.errors import BuilderError

#: The full field list (lessons §9.1), one call for every GPU.
QUERY_FIELDS: list[str] = [
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "driver_version",
    "vbios_version",
    "persistence_mode",
    "pstate",
    "clocks.sm",
    "clocks.max.sm",
    "clocks.mem",
    "clocks.max.mem",
    "clocks.applications.graphics",
    "clocks.applications.memory",
    "clocks.default_applications.graphics",
    "clocks_event_reasons.active",
    "memory.total",
    "memory.used",
    "memory.free",
    "ecc.mode.current",
    "mig.mode.current",
    "power.limit",
    "compute_cap",
]

#: Fields that older drivers (before ``clocks_event_reasons``, ``compute_cap`` and MIG) know.
FALLBACK_FIELDS: list[str] = [
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "driver_version",
    "persistence_mode",
    "pstate",
    "clocks.sm",
    "clocks.max.sm",
    "clocks.mem",
    "clocks.max.mem",
    "clocks_throttle_reasons.active",
    "memory.total",
    "memory.used",
    "memory.free",
    "power.limit",
]

COMPUTE_APPS_FIELDS: list[str] = ["pid", "process_name", "used_memory"]

#: Clock event (formerly "throttle") reason bits, as nvidia-smi and NVML document them.
EVENT_REASON_BITS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}

#: The bits that mean power or thermal limits are holding clocks down.
THROTTLE_MASK = (
    EVENT_REASON_BITS["sw_power_cap"]
    | EVENT_REASON_BITS["hw_slowdown"]
    | EVENT_REASON_BITS["sw_thermal_slowdown"]
    | EVENT_REASON_BITS["hw_thermal_slowdown"]
    | EVENT_REASON_BITS["hw_power_brake_slowdown"]
)

_MAX_MASK = (1 << 64) - 1
_MAX_SHOWN = 60  # characters of a bad value quoted in an error


class GpuError(BuilderError):
    """nvidia-smi is missing, failed, or printed something this module cannot read."""


class GpuParseError(GpuError):
    """Text from nvidia-smi that does not have the expected shape."""


class GpuInfo(BaseModel):
    """One GPU as ``--query-gpu`` reports it. None = not queried, ``[N/A]`` or ``[Not Supported]``."""

    model_config = ConfigDict(extra="forbid")

    index: int
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    driver_version: str | None = None
    vbios_version: str | None = None
    persistence_mode: bool | None = None
    pstate: str | None = None
    clocks_sm_mhz: int | None = None
    clocks_max_sm_mhz: int | None = None
    clocks_mem_mhz: int | None = None
    clocks_max_mem_mhz: int | None = None
    clocks_applications_graphics_mhz: int | None = None
    clocks_applications_memory_mhz: int | None = None
    clocks_default_applications_graphics_mhz: int | None = None
    event_reasons: int | None = Field(default=None, description="clocks_event_reasons.active bitmask")
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    ecc_mode: bool | None = None
    mig_mode: bool | None = None
    power_limit_w: float | None = None
    power_draw_w: float | None = None
    temperature_c: int | None = None
    utilization_pct: int | None = None
    compute_cap: str | None = None
    other: dict[str, str | None] = Field(default_factory=dict, description="requested fields not modelled")

    @property
    def event_reason_names(self) -> list[str]:
        return decode_event_reasons(self.event_reasons) if self.event_reasons is not None else []

    @property
    def throttled(self) -> bool:
        return self.event_reasons is not None and is_throttled(self.event_reasons)


class ComputeApp(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pid: int
    process_name: str
    used_memory_mib: int | None = None


class GpuReport(BaseModel):
    """What :func:`probe` found: versions, GPUs, processes, and the field set that worked."""

    model_config = ConfigDict(extra="forbid")

    driver_version: str | None
    cuda_version: str | None
    gpus: list[GpuInfo]
    compute_apps: list[ComputeApp]
    fields: list[str]
    fallback: bool = False


# ---------------------------------------------------------------- value parsing

_NA_RE = re.compile(r"^\[[^\]]*\]$")  # [N/A], [Not Supported], [Unknown Error], [Insufficient Permissions]
_NA_WORDS = {"", "n/a", "not supported", "not available", "unknown", "unknown error"}
_NUM_RE = re.compile(r"^([+-]?\d{1,18}(?:\.\d{1,9})?)\s*(mhz|mib|gib|w|%|c)?$", re.IGNORECASE)
_HEX_RE = re.compile(r"^0x([0-9a-fA-F]{1,16})$")
_PSTATE_RE = re.compile(r"^P\d{1,2}$")
_CAP_RE = re.compile(r"^\d{1,3}\.\d{1,3}$")
_VERSION_RE = re.compile(r"^\d{1,5}(?:\.\d{1,5}){1,3}$")
_CUDA_RE = re.compile(r"^\d{1,3}\.\d{1,3}$")


def _shown(value: str) -> str:
    v = value if len(value) <= _MAX_SHOWN else value[:_MAX_SHOWN] + "..."
    return ascii(v)


def _is_na(value: str) -> bool:
    return bool(_NA_RE.match(value)) or value.lower() in _NA_WORDS


def _int(value: str, what: str) -> int | None:
    if _is_na(value):
        return None
    m = _NUM_RE.match(value)
    if not m or "." in m.group(1):
        raise GpuParseError(f"nvidia-smi: {what}: expected a whole number, got {_shown(value)}")
    return int(m.group(1))


def _float(value: str, what: str) -> float | None:
    if _is_na(value):
        return None
    m = _NUM_RE.match(value)
    if not m:
        raise GpuParseError(f"nvidia-smi: {what}: expected a number, got {_shown(value)}")
    return float(m.group(1))


def _bool(value: str, what: str) -> bool | None:
    if _is_na(value):
        return None
    v = value.lower()
    if v in ("enabled", "on", "1", "yes"):
        return True
    if v in ("disabled", "off", "0", "no"):
        return False
    raise GpuParseError(f"nvidia-smi: {what}: expected Enabled or Disabled, got {_shown(value)}")


def _mask(value: str, what: str) -> int | None:
    if _is_na(value):
        return None
    m = _HEX_RE.match(value)
    if not m:
        raise GpuParseError(
            f"nvidia-smi: {what}: expected a hex bitmask like 0x0000000000000001, got {_shown(value)}"
        )
    return int(m.group(1), 16)


def _text(value: str, what: str) -> str | None:
    if _is_na(value):
        return None
    if not value.isprintable():
        raise GpuParseError(f"nvidia-smi: {what}: unprintable characters in {_shown(value)}")
    return value


def _matching(regex: re.Pattern[str], kind: str) -> Callable[[str, str], str | None]:
    def parse(value: str, what: str) -> str | None:
        if _is_na(value):
            return None
        if not regex.match(value):
            raise GpuParseError(f"nvidia-smi: {what}: expected {kind}, got {_shown(value)}")
        return value

    return parse


# Every accepted spelling of a field (requested name, alias, canonical header name) -> (attribute, parser)
_Parser = Callable[[str, str], Any]
_FIELD_MAP: dict[str, tuple[str, _Parser]] = {}


def _register(names: Sequence[str], attr: str, parser: _Parser) -> None:
    for n in names:
        _FIELD_MAP[n] = (attr, parser)


_register(["index"], "index", _int)
_register(["uuid", "gpu_uuid"], "uuid", _text)
_register(["name", "gpu_name"], "name", _text)
_register(["pci.bus_id", "gpu_bus_id"], "pci_bus_id", _text)
_register(["driver_version"], "driver_version", _matching(_VERSION_RE, "a version like 580.159.04"))
_register(["vbios_version"], "vbios_version", _text)
_register(["persistence_mode"], "persistence_mode", _bool)
_register(["pstate"], "pstate", _matching(_PSTATE_RE, "a performance state like P0"))
_register(["clocks.sm", "clocks.current.sm"], "clocks_sm_mhz", _int)
_register(["clocks.max.sm"], "clocks_max_sm_mhz", _int)
_register(["clocks.mem", "clocks.current.memory"], "clocks_mem_mhz", _int)
_register(["clocks.max.mem", "clocks.max.memory"], "clocks_max_mem_mhz", _int)
_register(
    ["clocks.applications.graphics", "clocks.applications.gr"], "clocks_applications_graphics_mhz", _int
)
_register(["clocks.applications.memory", "clocks.applications.mem"], "clocks_applications_memory_mhz", _int)
_register(
    ["clocks.default_applications.graphics", "clocks.default_applications.gr"],
    "clocks_default_applications_graphics_mhz",
    _int,
)
_register(["clocks_event_reasons.active", "clocks_throttle_reasons.active"], "event_reasons", _mask)
_register(["memory.total"], "memory_total_mib", _int)
_register(["memory.used"], "memory_used_mib", _int)
_register(["memory.free"], "memory_free_mib", _int)
_register(["ecc.mode.current"], "ecc_mode", _bool)
_register(["mig.mode.current"], "mig_mode", _bool)
_register(["power.limit", "gpu.power.requested_limit"], "power_limit_w", _float)
_register(["power.draw"], "power_draw_w", _float)
_register(["temperature.gpu"], "temperature_c", _int)
_register(["utilization.gpu"], "utilization_pct", _int)
_register(["compute_cap"], "compute_cap", _matching(_CAP_RE, "a compute capability like 9.0"))


def _canonical_field(field: str) -> str:
    """'memory.free [MiB]' (a header name) -> 'memory.free'."""
    return field.split(" [", 1)[0].strip()


_BAD_FIELD_RE = re.compile(r'Field "([^"]*)" is not a valid field to query')
_FAILURE_MARKERS = (
    "NVIDIA-SMI has failed",
    "No devices were found",
    "couldn't communicate with the NVIDIA driver",
    "Failed to initialize NVML",
    "Unable to determine the device handle",
    "is not a valid field",
)


def _check_failure(text: str, what: str) -> None:
    m = _BAD_FIELD_RE.search(text)
    if m:
        raise GpuParseError(
            f"nvidia-smi {what}: field {_shown(m.group(1))} is not a valid field to query on this driver"
        )
    for marker in _FAILURE_MARKERS:
        if marker in text:
            line = next((ln.strip() for ln in text.splitlines() if marker in ln), marker)
            raise GpuError(f"nvidia-smi {what}: {_shown(line)[1:-1]}")


def _lines(text: str) -> list[str]:
    if not isinstance(text, str):
        raise GpuParseError(f"nvidia-smi: expected text, got {type(text).__name__}")
    return [ln.strip() for ln in text.splitlines() if ln.strip()]


# ---------------------------------------------------------------- parsers


def query_command(fields: Sequence[str] = QUERY_FIELDS, nvidia_smi: str = "nvidia-smi") -> list[str]:
    """The argv of one ``--query-gpu`` call for ``fields``."""
    return [nvidia_smi, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"]


def compute_apps_command(nvidia_smi: str = "nvidia-smi") -> list[str]:
    return [
        nvidia_smi,
        "--query-compute-apps=" + ",".join(COMPUTE_APPS_FIELDS),
        "--format=csv,noheader,nounits",
    ]


def parse_query(text: str, fields: Sequence[str] = QUERY_FIELDS) -> list[GpuInfo]:
    """Parse ``--query-gpu=FIELDS --format=csv,noheader,nounits`` output, one GpuInfo per line.

    Columns map by the order of ``fields``; a header line (as with ``csv`` without
    ``noheader``) is recognised and skipped. Empty output means no GPUs.
    """
    if not fields:
        raise GpuParseError("nvidia-smi --query-gpu: no fields requested")
    if len(set(fields)) != len(fields):
        raise GpuParseError("nvidia-smi --query-gpu: a field is requested twice")
    lines = _lines(text)
    _check_failure(text, "--query-gpu")
    keys = [_canonical_field(str(f)) for f in fields]
    gpus: list[GpuInfo] = []
    for n, line in enumerate(lines, start=1):
        values = [v.strip() for v in line.split(",")]
        if n == 1 and _looks_like_header(values, keys):
            continue  # '--format=csv' without noheader
        if len(values) != len(keys):
            got = f"{len(values)} values for {len(keys)} fields"
            raise GpuParseError(f"nvidia-smi --query-gpu: line {n}: {got}: {_shown(line)}")
        try:
            gpus.append(_row(values, keys, n, row_index=len(gpus)))
        except ValidationError as e:  # a safety net: the value parsers already checked the types
            raise GpuParseError(f"nvidia-smi --query-gpu: line {n}: {e.errors()[0]['msg']}") from None
    indexes = [g.index for g in gpus]
    if len(set(indexes)) != len(indexes):
        raise GpuParseError("nvidia-smi --query-gpu: two lines report the same GPU index")
    return gpus


def _looks_like_header(values: list[str], keys: list[str]) -> bool:
    """The csv header spells fields canonically with units ('clocks.current.sm [MHz]')."""
    if len(values) != len(keys):
        return False
    for v, k in zip(values, keys, strict=True):
        name = _canonical_field(v)
        if name == k:
            continue
        if name in _FIELD_MAP and k in _FIELD_MAP and _FIELD_MAP[name][0] == _FIELD_MAP[k][0]:
            continue
        return False
    return True


def _row(values: list[str], keys: list[str], line_no: int, row_index: int) -> GpuInfo:
    attrs: dict[str, Any] = {}
    other: dict[str, str | None] = {}
    for key, value in zip(keys, values, strict=True):
        what = f"--query-gpu line {line_no}: {key}"
        if key in _FIELD_MAP:
            attr, parser = _FIELD_MAP[key]
            if attr in attrs:
                raise GpuParseError(f"nvidia-smi {what}: field requested twice under two names")
            attrs[attr] = parser(value, what)
        else:
            other[key] = _text(value, what)
    if attrs.get("index", row_index) is None:
        raise GpuParseError(f"nvidia-smi --query-gpu line {line_no}: index is not available")
    attrs.setdefault("index", row_index)
    if attrs["index"] < 0:
        raise GpuParseError(f"nvidia-smi --query-gpu line {line_no}: negative index {attrs['index']}")
    if other:
        attrs["other"] = other
    return GpuInfo(**attrs)


_SMI_VERSION_RES: dict[str, re.Pattern[str]] = {
    # nvidia-smi --version
    "nvidia_smi": re.compile(r"^NVIDIA-SMI version\s*:\s*(\S+)\s*$", re.IGNORECASE | re.MULTILINE),
    "nvml": re.compile(r"^NVML version\s*:\s*(\S+)\s*$", re.IGNORECASE | re.MULTILINE),
    # --version says "DRIVER version", -q says "Driver Version", the summary "Driver Version:"
    "driver": re.compile(r"Driver Version\s*:\s*([0-9][0-9.]*)", re.IGNORECASE),
    "cuda": re.compile(r"CUDA Version\s*:\s*([0-9][0-9.]*)", re.IGNORECASE),
}
_XML_RES: dict[str, re.Pattern[str]] = {
    "driver": re.compile(r"<driver_version>\s*([^<\s]+)\s*</driver_version>"),
    "cuda": re.compile(r"<cuda_version>\s*([^<\s]+)\s*</cuda_version>"),
}


def parse_version(text: str) -> dict[str, str | None]:
    """Driver and CUDA versions from ``nvidia-smi --version``, the summary table, ``-q`` or ``-q -x``.

    Returns ``{"driver": "580.159.04", "cuda": "13.0", "nvml": ..., "nvidia_smi": ...}``
    (None for what the text does not hold); raises GpuParseError when it holds neither a
    driver nor a CUDA version, or holds a malformed one.
    """
    _lines(text)
    _check_failure(text, "--version")
    out: dict[str, str | None] = {"driver": None, "cuda": None, "nvml": None, "nvidia_smi": None}
    for key, regex in _SMI_VERSION_RES.items():
        m = regex.search(text)
        if m:
            out[key] = m.group(1)
    for key, regex in _XML_RES.items():
        m = regex.search(text)
        if m and out[key] is None:
            out[key] = m.group(1)
    if out["driver"] is None and out["cuda"] is None:
        raise GpuParseError("nvidia-smi --version: found neither a driver nor a CUDA version in its output")
    for key, regex in (
        ("driver", _VERSION_RE),
        ("nvml", _VERSION_RE),
        ("nvidia_smi", _VERSION_RE),
        ("cuda", _CUDA_RE),
    ):
        v = out[key]
        if v is not None and not regex.match(v):
            raise GpuParseError(f"nvidia-smi --version: malformed {key} version {_shown(v)}")
    return out


def decode_event_reasons(mask: int) -> list[str]:
    """Names of the set bits of a clocks_event_reasons bitmask; unknown bits as 'unknown_0x...'."""
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0 or mask > _MAX_MASK:
        raise GpuParseError(f"clock event reasons: expected a 64-bit mask, got {_shown(repr(mask))}")
    names = [name for name, bit in EVENT_REASON_BITS.items() if mask & bit]
    unknown = mask & ~sum(EVENT_REASON_BITS.values())
    if unknown:
        names.append(f"unknown_{unknown:#x}")
    return names


def is_throttled(mask: int) -> bool:
    """True when a power or thermal limit holds the clocks down (idle and app clocks don't count)."""
    decode_event_reasons(mask)
    return bool(mask & THROTTLE_MASK)


def parse_compute_apps(text: str) -> list[ComputeApp]:
    """Parse ``--query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits``.

    Empty output (or "No running processes found") means no processes. The process name
    may contain commas: pid is the first column and used_memory the last.
    """
    lines = _lines(text)
    _check_failure(text, "--query-compute-apps")
    apps: list[ComputeApp] = []
    for n, line in enumerate(lines, start=1):
        if line.lower().startswith("no running processes"):
            continue
        if n == 1 and line.replace(" ", "").startswith("pid,process_name"):
            continue  # header
        head, sep1, rest = line.partition(",")
        name, sep2, mem = rest.rpartition(",")
        if not sep1 or not sep2:
            raise GpuParseError(
                f"nvidia-smi --query-compute-apps: line {n}: expected 3 values: {_shown(line)}"
            )
        what = f"--query-compute-apps line {n}"
        pid = _int(head.strip(), what + ": pid")
        if pid is None or pid <= 0:
            raise GpuParseError(
                f"nvidia-smi {what}: pid: expected a positive number, got {_shown(head.strip())}"
            )
        pname = name.strip()
        if not pname.isprintable():
            raise GpuParseError(f"nvidia-smi {what}: process_name: unprintable characters in {_shown(pname)}")
        apps.append(
            ComputeApp(pid=pid, process_name=pname, used_memory_mib=_int(mem.strip(), what + ": used_memory"))
        )
    return apps


# ---------------------------------------------------------------- running nvidia-smi

#: run(argv) -> (exit status, stdout, stderr); lets the audit run the same probe over testinfra.
Runner = Callable[[list[str]], tuple[int, str, str]]


def probe_commands(nvidia_smi: str = "nvidia-smi") -> list[list[str]]:
    """What :func:`probe` runs when nothing fails: the GPU query, the versions, the compute apps."""
    return [query_command(QUERY_FIELDS, nvidia_smi), [nvidia_smi, "--version"], compute_apps_command(nvidia_smi)]


def probe(run: Runner, nvidia_smi: str = "nvidia-smi") -> GpuReport:
    """Query every GPU (falling back to :data:`FALLBACK_FIELDS`), the versions and the compute apps."""
    query, version, apps_cmd = probe_commands(nvidia_smi)
    fields, fallback = list(QUERY_FIELDS), False
    rc, out, err = run(query)
    if rc != 0 and _BAD_FIELD_RE.search(out + err):
        fields, fallback = list(FALLBACK_FIELDS), True
        rc, out, err = run(query_command(fields, nvidia_smi))
    if rc != 0:
        _check_failure(out + "\n" + err, "--query-gpu")
        raise GpuError(f"nvidia-smi --query-gpu: exit status {rc}: {_first_line(err or out)}")
    gpus = parse_query(out, fields)

    rc, vout, verr = run(version)
    if rc != 0:  # drivers before ~525 have no --version: read the summary table header
        rc, vout, verr = run([nvidia_smi])
        if rc != 0:
            raise GpuError(f"nvidia-smi: exit status {rc}: {_first_line(verr or vout)}")
    versions = parse_version(vout)

    rc, aout, aerr = run(apps_cmd)
    if rc != 0:
        raise GpuError(f"nvidia-smi --query-compute-apps: exit status {rc}: {_first_line(aerr or aout)}")
    apps = parse_compute_apps(aout)

    driver = versions["driver"] or next((g.driver_version for g in gpus if g.driver_version), None)
    return GpuReport(
        driver_version=driver,
        cuda_version=versions["cuda"],
        gpus=gpus,
        compute_apps=apps,
        fields=fields,
        fallback=fallback,
    )


def _first_line(text: str) -> str:
    for ln in text.splitlines():
        if ln.strip():
            return _shown(ln.strip())[1:-1]
    return "(no output)"


def local_runner(timeout: float = 30.0) -> Runner:
    """A Runner that runs argv on this machine with a timeout; failures become GpuError."""

    def run(argv: list[str]) -> tuple[int, str, str]:
        try:
            p = subprocess.run(
                argv, capture_output=True, text=True, errors="replace", timeout=timeout, check=False
            )
        except FileNotFoundError:
            raise GpuError(f"{argv[0]}: not found (is the NVIDIA driver installed?)") from None
        except subprocess.TimeoutExpired:
            raise GpuError(f"{argv[0]}: no answer within {timeout:g} s ({' '.join(argv[1:2])})") from None
        except OSError as e:
            raise GpuError(f"{argv[0]}: cannot run: {e.strerror}") from None
        return p.returncode, p.stdout, p.stderr

    return run


def probe_local(nvidia_smi: str = "nvidia-smi", timeout: float = 30.0) -> GpuReport:
    """Run nvidia-smi here and parse its report; GpuError when it is missing, hangs or fails."""
    path = shutil.which(nvidia_smi)
    if path is None:
        raise GpuError(f"{nvidia_smi}: not found on PATH (is the NVIDIA driver installed?)")
    return probe(local_runner(timeout), path)
