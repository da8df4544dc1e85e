"""What the host agent reports about its host: the node agent's host
inventory (``gpuclusters.agent.inventory``: GPUs through NVML, NVMe, InfiniBand
ports, CPUs, memory) plus what the server places by: the simulated GPU type
of a host without GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuclusters.agent.inventory import collect
from gpuclusters.hostagent.config import AgentConfig


def host_inventory(cfg: AgentConfig, *, root: Path = Path("/")) -> dict[str, Any]:
    data: dict[str, Any] = dict(collect(root=root).to_json())
    if not data.get("gpu_count"):
        # No NVIDIA GPUs here: nodes get the simulated backend (docs/hosts.md).
        data["simulated_gpu_type"] = cfg.simulated_gpu_type
    return data
