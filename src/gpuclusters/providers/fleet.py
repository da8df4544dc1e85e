"""Fleet files: the inventory of hosts, as YAML.

hosts:
  - name: h100-a-01
    gpu_type: H100_SXM
    region: local-1
    ib_island: island-a
    nvme_gib: 7680       # optional
    num_gpus: 8          # optional; only 8 is supported
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpuclusters.core.catalog import GPU_TYPES
from gpuclusters.core.enums import GPUS_PER_NODE
from gpuclusters.providers.base import HostSpec


class FleetFileError(ValueError):
    pass


def load_fleet(path: Path) -> list[HostSpec]:
    try:
        data: Any = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise FleetFileError(f"cannot read fleet file {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("hosts"), list):
        raise FleetFileError(f"fleet file {path}: expected a mapping with a 'hosts' list")
    hosts: list[HostSpec] = []
    seen: set[str] = set()
    for i, raw in enumerate(data["hosts"]):
        where = f"fleet file {path}: hosts[{i}]"
        if not isinstance(raw, dict):
            raise FleetFileError(f"{where}: expected a mapping")
        try:
            host = HostSpec(
                name=str(raw["name"]),
                gpu_type=str(raw["gpu_type"]),
                region=str(raw["region"]),
                ib_island=str(raw["ib_island"]),
                num_gpus=int(raw.get("num_gpus", GPUS_PER_NODE)),
                nvme_gib=int(raw.get("nvme_gib", 7680)),
            )
        except KeyError as exc:
            raise FleetFileError(f"{where}: missing field {exc.args[0]}") from exc
        if host.gpu_type not in GPU_TYPES:
            raise FleetFileError(
                f"{where}.gpu_type: unknown GPU type {host.gpu_type!r}; known: {sorted(GPU_TYPES)}"
            )
        if host.num_gpus != GPUS_PER_NODE:
            raise FleetFileError(f"{where}.num_gpus: hosts have {GPUS_PER_NODE} GPUs")
        if host.name in seen:
            raise FleetFileError(f"{where}.name: duplicate host name {host.name!r}")
        seen.add(host.name)
        hosts.append(host)
    return hosts
