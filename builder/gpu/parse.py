"""The parsers: text in, models out. They never raise anything but a GpuError (one line), whatever
the text, so the audit can report garbage from a host as a finding."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from builder.gpu.fields import COMPUTE_APPS_FIELDS, FIELD_MAP, QUERY_FIELDS
from builder.gpu.readings import ComputeApp, GpuInfo
from builder.gpu.values import (
    CUDA_RE,
    VERSION_RE,
    GpuParseError,
    as_int,
    as_text,
    canonical_field,
    check_failure,
    lines_of,
    shown,
)


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
    lines = lines_of(text)
    check_failure(text, "--query-gpu")
    keys = [canonical_field(str(f)) for f in fields]
    gpus: list[GpuInfo] = []
    for n, line in enumerate(lines, start=1):
        values = [v.strip() for v in line.split(",")]
        if n == 1 and _looks_like_header(values, keys):
            continue  # '--format=csv' without noheader
        if len(values) != len(keys):
            got = f"{len(values)} values for {len(keys)} fields"
            raise GpuParseError(f"nvidia-smi --query-gpu: line {n}: {got}: {shown(line)}")
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
        name = canonical_field(v)
        if name == k:
            continue
        if name in FIELD_MAP and k in FIELD_MAP and FIELD_MAP[name][0] == FIELD_MAP[k][0]:
            continue
        return False
    return True


def _row(values: list[str], keys: list[str], line_no: int, row_index: int) -> GpuInfo:
    attrs: dict[str, Any] = {}
    other: dict[str, str | None] = {}
    for key, value in zip(keys, values, strict=True):
        what = f"--query-gpu line {line_no}: {key}"
        if key in FIELD_MAP:
            attr, parser = FIELD_MAP[key]
            if attr in attrs:
                raise GpuParseError(f"nvidia-smi {what}: field requested twice under two names")
            attrs[attr] = parser(value, what)
        else:
            other[key] = as_text(value, what)
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
    lines_of(text)
    check_failure(text, "--version")
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
        ("driver", VERSION_RE),
        ("nvml", VERSION_RE),
        ("nvidia_smi", VERSION_RE),
        ("cuda", CUDA_RE),
    ):
        v = out[key]
        if v is not None and not regex.match(v):
            raise GpuParseError(f"nvidia-smi --version: malformed {key} version {shown(v)}")
    return out



def parse_compute_apps(text: str) -> list[ComputeApp]:
    """Parse ``--query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits``.

    Empty output (or "No running processes found") means no processes. The process name
    may contain commas: pid is the first column and used_memory the last.
    """
    lines = lines_of(text)
    check_failure(text, "--query-compute-apps")
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
                f"nvidia-smi --query-compute-apps: line {n}: expected 3 values: {shown(line)}"
            )
        what = f"--query-compute-apps line {n}"
        pid = as_int(head.strip(), what + ": pid")
        if pid is None or pid <= 0:
            raise GpuParseError(
                f"nvidia-smi {what}: pid: expected a positive number, got {shown(head.strip())}"
            )
        pname = name.strip()
        if not pname.isprintable():
            raise GpuParseError(f"nvidia-smi {what}: process_name: unprintable characters in {shown(pname)}")
        apps.append(
            ComputeApp(pid=pid, process_name=pname, used_memory_mib=as_int(mem.strip(), what + ": used_memory"))
        )
    return apps

