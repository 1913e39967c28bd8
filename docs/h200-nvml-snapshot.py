"""One NVML reading of every GPU and its compute processes, as JSON on stdout (the capture script
docs/h200-gpu-states.sh runs it beside nvidia-smi; it needs nvidia-ml-py)."""

from __future__ import annotations

import json
import time

import pynvml as N


def snapshot() -> dict[str, object]:
    N.nvmlInit()
    try:
        gpus = []
        for i in range(N.nvmlDeviceGetCount()):
            h = N.nvmlDeviceGetHandleByIndex(i)
            procs = N.nvmlDeviceGetComputeRunningProcesses(h)
            gpus.append({
                "index": i,
                "name": N.nvmlDeviceGetName(h),
                "clocks_sm_mhz": N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM),
                "clocks_max_sm_mhz": N.nvmlDeviceGetMaxClockInfo(h, N.NVML_CLOCK_SM),
                "power_draw_w": N.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "power_limit_w": N.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
                "temperature_c": N.nvmlDeviceGetTemperature(h, N.NVML_TEMPERATURE_GPU),
                "utilization_pct": N.nvmlDeviceGetUtilizationRates(h).gpu,
                "event_reasons": hex(N.nvmlDeviceGetCurrentClocksEventReasons(h)),
                "memory_used_mib": N.nvmlDeviceGetMemoryInfo(h).used >> 20,
                "processes": [{"pid": p.pid, "used_mib": (p.usedGpuMemory or 0) >> 20} for p in procs],
            })
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "driver": N.nvmlSystemGetDriverVersion(), "cuda": N.nvmlSystemGetCudaDriverVersion_v2(),
                "gpus": gpus}
    finally:
        N.nvmlShutdown()


if __name__ == "__main__":
    print(json.dumps(snapshot(), indent=1))
