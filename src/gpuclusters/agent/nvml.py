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
from pathlib import Path
from types import ModuleType
from typing import Any

from gpuclusters.agent.gpus import GpuBackend, GpuInfo, SimulatedGpus

log = logging.getLogger(__name__)
GIB = 1024**3


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlGpus:
    """The node's GPUs as NVML sees them. ``nvml`` is the ``pynvml`` module
    (injectable for tests); NVML is initialised once and shut down by
    :meth:`close`."""

    def __init__(self, nvml: ModuleType, *, dev_dir: Path = Path("/dev")) -> None:
        self._nvml = nvml
        self.dev_dir = dev_dir
        self._lock = threading.Lock()  # NVML calls from the agent and the plugin
        nvml.nvmlInit()
        self.count = int(nvml.nvmlDeviceGetCount())
        # Remember what each index was, so a GPU that stops answering keeps
        # its identity in the inventory (reported absent, not forgotten).
        self._known: dict[int, GpuInfo] = {}

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
