"""The NVML backend: real GPUs, read through nvidia-ml-py (``pynvml``).

Used where the NVIDIA driver is loaded (``nvmlInit`` succeeds and finds GPUs);
:func:`detect_backend` falls back to ``SimulatedGpus`` elsewhere, and the
embedded fleet forces the simulated backend (its device nodes are
simulated, whatever the host has). A GPU that NVML can no longer query (it
fell off the bus, Xid 79) stays in the inventory as ``present=False``, so
the device plugin reports it unhealthy and the heartbeat shows it missing.
The index is NVML's; the device node is ``/dev/nvidia<minor>``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from gpuclusters.agent.dcgm import GpuFields
from gpuclusters.agent.gpus import GpuBackend, GpuInfo, SimulatedGpus
from gpuclusters.core.health.findings import GpuHealth
from gpuclusters.core.telemetry import GpuSample

log = logging.getLogger(__name__)
GIB = 1024**3


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _num(value: Any) -> float | None:
    return None if value is None else float(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


class NvmlGpus:
    """The node's GPUs as NVML sees them. ``nvml`` is the ``pynvml`` module
    (injectable for tests); NVML is initialised once and shut down by
    :meth:`close`."""

    name = "nvml"

    def __init__(self, nvml: ModuleType, *, dev_dir: Path = Path("/dev")) -> None:
        self._nvml = nvml
        self.dev_dir = dev_dir
        self._lock = threading.Lock()  # NVML calls from the agent and the plugin
        nvml.nvmlInit()
        self.count = int(nvml.nvmlDeviceGetCount())
        # Remember what each index was, so a GPU that stops answering keeps
        # its identity in the inventory (reported absent, not forgotten).
        self._known: dict[int, GpuInfo] = {}
        self._replays: dict[int, tuple[float, int]] = {}
        # The last Xid of each GPU: health() drains NVML's event set, and the
        # metrics export (DCGM_FI_DEV_XID_ERRORS) reports what it saw last.
        self._last_xid: dict[int, int] = {}
        self._watch_xids()

    def _read(self, index: int) -> GpuInfo:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
        return GpuInfo(
            index=index,
            name=_text(nvml.nvmlDeviceGetName(handle)),
            memory_gib=round(int(nvml.nvmlDeviceGetMemoryInfo(handle).total) / GIB),
            device=str(self.dev_dir / f"nvidia{minor}"),
            present=True,
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        )

    def telemetry(self) -> list[GpuSample]:
        """NVML's utilisation rate, memory in use and core temperature of
        each GPU that answers (one that does not is left out: its absence
        is the inventory's and the health checks' business)."""
        nvml = self._nvml
        out = []
        with self._lock:
            for i in range(self.count):
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(i)
                    util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                    used = nvml.nvmlDeviceGetMemoryInfo(handle).used
                    temp = nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
                except nvml.NVMLError:
                    continue
                out.append(GpuSample(i, float(util), round(int(used) / GIB, 2), float(temp)))
        return out

    def fields(self) -> list[GpuFields]:
        """dcgm-exporter's fields of each GPU that answers, from the NVML
        calls DCGM itself makes for them; a call the GPU or driver does not
        support leaves its field out (None)."""
        nvml = self._nvml
        mib = 1024**2
        out = []
        with self._lock:
            for i in range(self.count):
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(i)
                    uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                    minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
                    model = _text(nvml.nvmlDeviceGetName(handle))
                except nvml.NVMLError:
                    continue

                def ask(fn: str, *args: Any, handle: Any = handle) -> Any:
                    try:
                        return getattr(nvml, fn)(handle, *args)
                    except (nvml.NVMLError, AttributeError):
                        return None

                util = ask("nvmlDeviceGetUtilizationRates")
                mem = ask("nvmlDeviceGetMemoryInfo")
                power = ask("nvmlDeviceGetPowerUsage")  # mW
                sbe = ask(
                    "nvmlDeviceGetTotalEccErrors",
                    getattr(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0),
                    getattr(nvml, "NVML_VOLATILE_ECC", 0),
                )
                dbe = ask(
                    "nvmlDeviceGetTotalEccErrors",
                    getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                    getattr(nvml, "NVML_VOLATILE_ECC", 0),
                )
                crc = None
                for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
                    n = ask(
                        "nvmlDeviceGetNvLinkErrorCounter",
                        link,
                        getattr(nvml, "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2),
                    )
                    if n is not None:
                        crc = (crc or 0) + int(n)
                out.append(
                    GpuFields(
                        index=i,
                        uuid=uuid,
                        device=f"nvidia{minor}",
                        model=model,
                        util_pct=float(util.gpu) if util is not None else None,
                        mem_copy_util_pct=float(util.memory) if util is not None else None,
                        fb_used_mib=round(int(mem.used) / mib) if mem is not None else None,
                        fb_free_mib=round(int(mem.free) / mib) if mem is not None else None,
                        temp_c=_num(ask("nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU)),
                        power_w=int(power) / 1000 if power is not None else None,
                        energy_mj=_num(ask("nvmlDeviceGetTotalEnergyConsumption")),
                        sm_clock_mhz=_num(
                            ask("nvmlDeviceGetClockInfo", getattr(nvml, "NVML_CLOCK_SM", 1))
                        ),
                        mem_clock_mhz=_num(
                            ask("nvmlDeviceGetClockInfo", getattr(nvml, "NVML_CLOCK_MEM", 2))
                        ),
                        xid_last=self._last_xid.get(i, 0),
                        ecc_sbe_vol_total=_num(sbe),
                        ecc_dbe_vol_total=_num(dbe),
                        pcie_replay_total=_num(ask("nvmlDeviceGetPcieReplayCounter")),
                        nvlink_crc_flit_errors_total=crc,
                        throttle_reasons=_int(ask("nvmlDeviceGetCurrentClocksThrottleReasons")),
                    )
                )
        return out

    def inventory(self) -> list[GpuInfo]:
        out = []
        with self._lock:
            for i in range(self.count):
                try:
                    info = self._read(i)
                except self._nvml.NVMLError as exc:
                    known = self._known.get(i)
                    log.warning("GPU %d does not answer NVML: %s", i, exc)
                    info = GpuInfo(
                        index=i,
                        name=known.name if known else "unknown",
                        memory_gib=known.memory_gib if known else 0,
                        device=known.device if known else str(self.dev_dir / f"nvidia{i}"),
                        present=False,
                        uuid=known.uuid if known else f"GPU-unknown-{i}",
                    )
                else:
                    self._known[i] = info
                out.append(info)
        return out

    def _xids(self) -> dict[int, list[int]]:
        """Xid events since the last call, by GPU index (non-blocking)."""
        nvml = self._nvml
        out: dict[int, list[int]] = {}
        if self._events is None:
            return out
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:  # timeout: no more events
                return out
            index = self._index_of.get(str(data.device), -1)
            out.setdefault(index, []).append(int(data.eventData))

    def _watch_xids(self) -> None:
        nvml = self._nvml
        self._events: Any = None
        self._index_of: dict[str, int] = {}
        try:
            self._events = nvml.nvmlEventSetCreate()
            for i in range(self.count):
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                self._index_of[str(handle)] = i
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self._events
                )
        except (nvml.NVMLError, AttributeError) as exc:
            log.info("Xid events unavailable: %s", exc)
            self._events = None

    def _gpu_health(self, index: int, xids: list[int]) -> GpuHealth:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)

        def ask(fn: str, *args: Any) -> Any:
            try:
                return getattr(nvml, fn)(handle, *args)
            except (nvml.NVMLError, AttributeError):
                return None  # not supported on this GPU or driver

        dbe = ask(
            "nvmlDeviceGetTotalEccErrors",
            getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
            getattr(nvml, "NVML_VOLATILE_ECC", 0),
        )
        remap = ask("nvmlDeviceGetRemappedRows")  # (corr, unc, pending, failure)
        reasons = ask("nvmlDeviceGetCurrentClocksThrottleReasons") or 0
        thermal_mask = getattr(nvml, "nvmlClocksThrottleReasonHwThermalSlowdown", 0x40) | getattr(
            nvml, "nvmlClocksThrottleReasonSwThermalSlowdown", 0x20
        )
        replays = ask("nvmlDeviceGetPcieReplayCounter")
        if xids:
            self._last_xid[index] = xids[-1]
        now = time.monotonic()
        rate = 0.0
        if replays is not None:
            before = self._replays.get(index)
            if before is not None and now > before[0]:
                rate = max(0.0, (replays - before[1]) / ((now - before[0]) / 60.0))
            self._replays[index] = (now, int(replays))
        return GpuHealth(
            index=index,
            present=True,
            xids=tuple(xids),
            ecc_dbe=int(dbe or 0),
            row_remap_failure=bool(remap and len(remap) > 3 and remap[3]),
            thermal_throttle=bool(int(reasons) & thermal_mask),
            pcie_replays_per_min=rate,
        )

    def health(self) -> list[GpuHealth]:
        present = {g.index: g.present for g in self.inventory()}
        out = []
        with self._lock:
            xids = self._xids()
            for i in range(self.count):
                if not present.get(i, False):
                    out.append(GpuHealth(index=i, present=False))
                    continue
                try:
                    out.append(self._gpu_health(i, xids.get(i, [])))
                except self._nvml.NVMLError:
                    out.append(GpuHealth(index=i, present=False))
        return out

    def close(self) -> None:
        with self._lock, contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


def detect_backend(
    gpu_type: str, *, node_id: str | None = None, choice: str | None = None
) -> GpuBackend:
    """``choice`` (or ``GPUCLUSTERS_AGENT_GPU_BACKEND``): ``nvml``,
    ``simulated`` or ``auto`` (the default: NVML when it loads and sees at
    least one GPU, else simulated). ``nvml`` that cannot load is an error."""
    choice = (choice or os.environ.get("GPUCLUSTERS_AGENT_GPU_BACKEND") or "auto").lower()
    if choice not in ("auto", "nvml", "simulated"):
        raise ValueError(f"GPU backend must be auto, nvml or simulated, not {choice!r}")
    if choice != "simulated":
        try:
            import pynvml

            backend = NvmlGpus(pynvml)
            if backend.count > 0:
                log.info("GPU backend: NVML, %d GPU(s)", backend.count)
                return backend
            backend.close()
            if choice == "nvml":
                raise RuntimeError("NVML sees no GPU on this machine")
        except ImportError:
            if choice == "nvml":
                raise
        except Exception as exc:  # pynvml.NVMLError: no driver, no library
            if choice == "nvml":
                raise RuntimeError(f"NVML unavailable: {exc}") from exc
            log.info("NVML unavailable (%s); simulated GPUs", exc)
    return SimulatedGpus(gpu_type, node_id=node_id)
