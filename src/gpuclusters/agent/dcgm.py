"""Per-GPU fields under the names NVIDIA's dcgm-exporter publishes.

An operator's dashboards and alerts for dcgm-exporter work unchanged on
our node agents' metrics: the metric names, their units and the labels
``gpu``, ``UUID``, ``device`` and ``modelName`` are dcgm-exporter's
(its default counters file, ``default-counters.csv``). Values come from
NVML on real GPUs (:meth:`NvmlGpus.fields`) and from the simulated backend
elsewhere (:meth:`SimulatedGpus.fields`), so the whole metrics path runs
the same on the embedded fleet as on a GPU host.

:data:`FIELDS` is the one table of what is exported: the attribute of
:class:`GpuFields` it reads, the metric's name, its type and its help
text. A field a GPU or driver cannot answer is ``None`` and left out of
the scrape (dcgm-exporter leaves it out too), never reported as 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuclusters.core.telemetry import THERMAL_THROTTLE_MASK

__all__ = ["FIELDS", "THERMAL_THROTTLE_MASK", "Field", "GpuFields"]


@dataclass(frozen=True, slots=True)
class GpuFields:
    """One GPU's fields at one moment."""

    index: int
    uuid: str
    device: str  # nvidia<minor>
    model: str
    util_pct: float | None = None
    mem_copy_util_pct: float | None = None
    fb_used_mib: float | None = None
    fb_free_mib: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    energy_mj: float | None = None  # millijoules since the driver loaded
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    xid_last: int | None = None  # the last Xid error seen on the GPU, 0 for none
    ecc_sbe_vol_total: float | None = None
    ecc_dbe_vol_total: float | None = None
    pcie_replay_total: float | None = None
    nvlink_crc_flit_errors_total: float | None = None
    throttle_reasons: int | None = None  # NVML's clocks-event-reasons bit mask


@dataclass(frozen=True, slots=True)
class Field:
    attr: str
    name: str
    help: str


# dcgm-exporter exports its counters (DCGM's "total" fields) as Prometheus
# counters without the ``_total`` suffix; prometheus_client would add one to
# a CounterMetricFamily, so they are written as gauges with dcgm-exporter's
# exact names. Their values only grow, and ``rate()``/``increase()`` work on
# them as on dcgm-exporter's.
FIELDS: tuple[Field, ...] = (
    Field("util_pct", "DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
    Field("mem_copy_util_pct", "DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %)."),
    Field("fb_used_mib", "DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
    Field("fb_free_mib", "DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."),
    Field("temp_c", "DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."),
    Field("power_w", "DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
    Field(
        "energy_mj",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "Total energy consumption since boot (in mJ).",
    ),
    Field("sm_clock_mhz", "DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."),
    Field("mem_clock_mhz", "DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz)."),
    Field("xid_last", "DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered."),
    Field(
        "ecc_sbe_vol_total",
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "Total number of single-bit volatile ECC errors.",
    ),
    Field(
        "ecc_dbe_vol_total",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "Total number of double-bit volatile ECC errors.",
    ),
    Field(
        "pcie_replay_total",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "Total number of PCIe retries.",
    ),
    Field(
        "nvlink_crc_flit_errors_total",
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "Total number of NVLink flow-control CRC errors.",
    ),
    Field(
        "throttle_reasons",
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        "Current clock throttle reasons (bit mask).",
    ),
)
