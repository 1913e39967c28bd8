"""The ``--query-gpu`` fields: the full list, the older drivers' list, and how each is read (every
accepted spelling of a field: the requested name, an alias, the canonical header name)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from builder.gpu.values import (
    CAP_RE,
    PSTATE_RE,
    VERSION_RE,
    as_bool,
    as_float,
    as_int,
    as_mask,
    as_text,
    matching,
)

# (the runs both lists share, in the order both request them)
_IDENTITY = ["index", "uuid", "name", "pci.bus_id", "driver_version"]
_CLOCKS = ["clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem"]
_MEMORY = ["memory.total", "memory.used", "memory.free"]

#: The full field list (lessons §9.1), one call for every GPU.
QUERY_FIELDS: list[str] = [
    *_IDENTITY, "vbios_version", "persistence_mode", "pstate", *_CLOCKS,
    "clocks.applications.graphics", "clocks.applications.memory", "clocks.default_applications.graphics",
    "clocks_event_reasons.active", *_MEMORY, "ecc.mode.current", "mig.mode.current", "power.limit", "compute_cap",
]

#: Fields that older drivers (before ``clocks_event_reasons``, ``compute_cap`` and MIG) know.
FALLBACK_FIELDS: list[str] = [
    *_IDENTITY, "persistence_mode", "pstate", *_CLOCKS, "clocks_throttle_reasons.active", *_MEMORY, "power.limit",
]

COMPUTE_APPS_FIELDS: list[str] = ["pid", "process_name", "used_memory"]

# Every accepted spelling of a field (requested name, alias, canonical header name) -> (attribute, parser)
Parser = Callable[[str, str], Any]
FIELD_MAP: dict[str, tuple[str, Parser]] = {}


def _register(names: Sequence[str], attr: str, parser: Parser) -> None:
    for n in names:
        FIELD_MAP[n] = (attr, parser)


_register(["index"], "index", as_int)
_register(["uuid", "gpu_uuid"], "uuid", as_text)
_register(["name", "gpu_name"], "name", as_text)
_register(["pci.bus_id", "gpu_bus_id"], "pci_bus_id", as_text)
_register(["driver_version"], "driver_version", matching(VERSION_RE, "a version like 580.159.04"))
_register(["vbios_version"], "vbios_version", as_text)
_register(["persistence_mode"], "persistence_mode", as_bool)
_register(["pstate"], "pstate", matching(PSTATE_RE, "a performance state like P0"))
_register(["clocks.sm", "clocks.current.sm"], "clocks_sm_mhz", as_int)
_register(["clocks.max.sm"], "clocks_max_sm_mhz", as_int)
_register(["clocks.mem", "clocks.current.memory"], "clocks_mem_mhz", as_int)
_register(["clocks.max.mem", "clocks.max.memory"], "clocks_max_mem_mhz", as_int)
_register(
    ["clocks.applications.graphics", "clocks.applications.gr"], "clocks_applications_graphics_mhz", as_int
)
_register(["clocks.applications.memory", "clocks.applications.mem"], "clocks_applications_memory_mhz", as_int)
_register(
    ["clocks.default_applications.graphics", "clocks.default_applications.gr"],
    "clocks_default_applications_graphics_mhz",
    as_int,
)
_register(["clocks_event_reasons.active", "clocks_throttle_reasons.active"], "event_reasons", as_mask)
_register(["memory.total"], "memory_total_mib", as_int)
_register(["memory.used"], "memory_used_mib", as_int)
_register(["memory.free"], "memory_free_mib", as_int)
_register(["ecc.mode.current"], "ecc_mode", as_bool)
_register(["mig.mode.current"], "mig_mode", as_bool)
_register(["power.limit", "gpu.power.requested_limit"], "power_limit_w", as_float)
_register(["power.draw"], "power_draw_w", as_float)
_register(["temperature.gpu"], "temperature_c", as_int)
_register(["utilization.gpu"], "utilization_pct", as_int)
_register(["compute_cap"], "compute_cap", matching(CAP_RE, "a compute capability like 9.0"))
