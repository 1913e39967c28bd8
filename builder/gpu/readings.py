"""What nvidia-smi reports, as models: one GPU, one compute process, and a probe's whole report."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from builder.gpu.events import is_throttled


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

