"""Clock event reasons (formerly "throttle" reasons): the bitmask ``clocks_event_reasons.active`` reports."""

from __future__ import annotations

from builder.gpu.values import GpuParseError, shown

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

#: The bits that mean trouble: a hardware slowdown, a thermal slowdown or the power brake. The software
#: power cap (0x4, ``sw_power_cap``) is not among them: a healthy GPU running flat out sits at its power
#: cap and sets it within a second (lessons.md §9.1: an H200 under a fp16 matmul, 580-695 W, 0x4 set).
THROTTLE_MASK = (
    EVENT_REASON_BITS["hw_slowdown"]
    | EVENT_REASON_BITS["sw_thermal_slowdown"]
    | EVENT_REASON_BITS["hw_thermal_slowdown"]
    | EVENT_REASON_BITS["hw_power_brake_slowdown"]
)
_MAX_MASK = (1 << 64) - 1


def decode_event_reasons(mask: int) -> list[str]:
    """Names of the set bits of a clocks_event_reasons bitmask; unknown bits as 'unknown_0x...'."""
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0 or mask > _MAX_MASK:
        raise GpuParseError(f"clock event reasons: expected a 64-bit mask, got {shown(repr(mask))}")
    names = [name for name, bit in EVENT_REASON_BITS.items() if mask & bit]
    unknown = mask & ~sum(EVENT_REASON_BITS.values())
    if unknown:
        names.append(f"unknown_{unknown:#x}")
    return names


def is_throttled(mask: int) -> bool:
    """True when a hardware, thermal or power-brake slowdown holds the clocks down (idle, app clocks,
    sync boost and the software power cap of a GPU at full load don't count)."""
    decode_event_reasons(mask)
    return bool(mask & THROTTLE_MASK)


def trouble_reasons(mask: int) -> list[str]:
    """The names of the set bits that mean trouble (:data:`THROTTLE_MASK`), every one of them."""
    return decode_event_reasons(mask & THROTTLE_MASK)

