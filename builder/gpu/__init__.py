"""nvidia-smi output parsing and a GPU probe (a package: ``values``, ``events``, ``models``, ``fields``,
``parse``, ``probe``; everything public is here), and the burn gate's judgment (``burn``, imported as
``builder.gpu.burn``: the audit's side only).

Only text in, models out: the parsers never raise anything but a BuilderError subclass
(one line) whatever the text, so the audit can report garbage from a host as a finding.
Facts this package relies on (lessons.md §9.1, captured on an H200 with driver 580.159.04):

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

from builder.gpu.events import EVENT_REASON_BITS, THROTTLE_MASK, decode_event_reasons, is_throttled, trouble_reasons
from builder.gpu.fields import COMPUTE_APPS_FIELDS, FALLBACK_FIELDS, QUERY_FIELDS
from builder.gpu.parse import (
    compute_apps_command,
    parse_compute_apps,
    parse_query,
    parse_version,
    query_command,
)
from builder.gpu.probe import Runner, local_runner, probe, probe_commands, probe_local
from builder.gpu.readings import ComputeApp, GpuInfo, GpuReport
from builder.gpu.values import GpuError, GpuParseError

__all__ = [
    "COMPUTE_APPS_FIELDS", "EVENT_REASON_BITS", "FALLBACK_FIELDS", "QUERY_FIELDS", "THROTTLE_MASK", "ComputeApp",
    "GpuError", "GpuInfo", "GpuParseError", "GpuReport", "Runner", "compute_apps_command", "decode_event_reasons",
    "is_throttled", "local_runner", "parse_compute_apps", "parse_query", "parse_version", "probe", "probe_commands",
    "probe_local", "query_command", "trouble_reasons",
]
