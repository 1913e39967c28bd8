"""One value of nvidia-smi's output, and its failures: the errors, the value readers (``[N/A]`` and
``[Not Supported]`` read as None; a unit kept or dropped), and the markers of a failed call."""

from __future__ import annotations

import re
from collections.abc import Callable

from builder.errors import BuilderError

_MAX_SHOWN = 60  # characters of a bad value quoted in an error


class GpuError(BuilderError):
    """nvidia-smi is missing, failed, or printed something this module cannot read."""


class GpuParseError(GpuError):
    """Text from nvidia-smi that does not have the expected shape."""



_NA_RE = re.compile(r"^\[[^\]]*\]$")  # [N/A], [Not Supported], [Unknown Error], [Insufficient Permissions]
_NA_WORDS = {"", "n/a", "not supported", "not available", "unknown", "unknown error"}
_NUM_RE = re.compile(r"^([+-]?\d{1,18}(?:\.\d{1,9})?)\s*(mhz|mib|gib|w|%|c)?$", re.IGNORECASE)
_HEX_RE = re.compile(r"^0x([0-9a-fA-F]{1,16})$")
PSTATE_RE = re.compile(r"^P\d{1,2}$")
CAP_RE = re.compile(r"^\d{1,3}\.\d{1,3}$")
VERSION_RE = re.compile(r"^\d{1,5}(?:\.\d{1,5}){1,3}$")
CUDA_RE = re.compile(r"^\d{1,3}\.\d{1,3}$")


def shown(value: str) -> str:
    """A value as an error quotes it: ascii, and cut."""
    v = value if len(value) <= _MAX_SHOWN else value[:_MAX_SHOWN] + "..."
    return ascii(v)


def is_na(value: str) -> bool:
    return bool(_NA_RE.match(value)) or value.lower() in _NA_WORDS


def as_int(value: str, what: str) -> int | None:
    if is_na(value):
        return None
    m = _NUM_RE.match(value)
    if not m or "." in m.group(1):
        raise GpuParseError(f"nvidia-smi: {what}: expected a whole number, got {shown(value)}")
    return int(m.group(1))


def as_float(value: str, what: str) -> float | None:
    if is_na(value):
        return None
    m = _NUM_RE.match(value)
    if not m:
        raise GpuParseError(f"nvidia-smi: {what}: expected a number, got {shown(value)}")
    return float(m.group(1))


def as_bool(value: str, what: str) -> bool | None:
    if is_na(value):
        return None
    v = value.lower()
    if v in ("enabled", "on", "1", "yes"):
        return True
    if v in ("disabled", "off", "0", "no"):
        return False
    raise GpuParseError(f"nvidia-smi: {what}: expected Enabled or Disabled, got {shown(value)}")


def as_mask(value: str, what: str) -> int | None:
    if is_na(value):
        return None
    m = _HEX_RE.match(value)
    if not m:
        raise GpuParseError(
            f"nvidia-smi: {what}: expected a hex bitmask like 0x0000000000000001, got {shown(value)}"
        )
    return int(m.group(1), 16)


def as_text(value: str, what: str) -> str | None:
    if is_na(value):
        return None
    if not value.isprintable():
        raise GpuParseError(f"nvidia-smi: {what}: unprintable characters in {shown(value)}")
    return value


def matching(regex: re.Pattern[str], kind: str) -> Callable[[str, str], str | None]:
    def parse(value: str, what: str) -> str | None:
        if is_na(value):
            return None
        if not regex.match(value):
            raise GpuParseError(f"nvidia-smi: {what}: expected {kind}, got {shown(value)}")
        return value

    return parse




def canonical_field(field: str) -> str:
    """'memory.free [MiB]' (a header name) -> 'memory.free'."""
    return field.split(" [", 1)[0].strip()


BAD_FIELD_RE = re.compile(r'Field "([^"]*)" is not a valid field to query')
_FAILURE_MARKERS = (
    "NVIDIA-SMI has failed",
    "No devices were found",
    "couldn't communicate with the NVIDIA driver",
    "Failed to initialize NVML",
    "Unable to determine the device handle",
    "is not a valid field",
)


def check_failure(text: str, what: str) -> None:
    m = BAD_FIELD_RE.search(text)
    if m:
        raise GpuParseError(
            f"nvidia-smi {what}: field {shown(m.group(1))} is not a valid field to query on this driver"
        )
    for marker in _FAILURE_MARKERS:
        if marker in text:
            line = next((ln.strip() for ln in text.splitlines() if marker in ln), marker)
            raise GpuError(f"nvidia-smi {what}: {shown(line)[1:-1]}")


def lines_of(text: str) -> list[str]:
    if not isinstance(text, str):
        raise GpuParseError(f"nvidia-smi: expected text, got {type(text).__name__}")
    return [ln.strip() for ln in text.splitlines() if ln.strip()]

