"""GPU backends. ``SimulatedGpus`` stands in where no GPU exists: it reports
the node's device nodes as healthy GPUs of the node's type. The NVML backend
(real GPUs) lands with the health-check work and implements the same
``GpuBackend`` protocol."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuclusters.core.catalog import GPU_TYPES


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    name: str
    memory_gib: int
    device: str
    present: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GpuBackend(Protocol):
    def inventory(self) -> list[GpuInfo]: ...


class SimulatedGpus:
    def __init__(self, gpu_type: str, *, dev_dir: Path = Path("/dev"), count: int = 8) -> None:
        self.gpu_type = gpu_type
        self.dev_dir = dev_dir
        self.count = count

    def inventory(self) -> list[GpuInfo]:
        spec = GPU_TYPES.get(self.gpu_type)
        memory = spec.memory_gib if spec else 0
        out = []
        for i in range(self.count):
            dev = self.dev_dir / f"nvidia{i}"
            out.append(
                GpuInfo(
                    index=i,
                    name=f"Simulated {self.gpu_type}",
                    memory_gib=memory,
                    device=str(dev),
                    present=os.path.exists(dev),
                )
            )
        return out
