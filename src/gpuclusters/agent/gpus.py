"""GPU backends. ``SimulatedGpus`` stands in where no GPU exists: it reports
the node's device nodes as healthy GPUs of the node's type. ``NvmlGpus``
(``agent/nvml.py``) reads real GPUs through NVML and implements the same
``GpuBackend`` protocol; ``detect_backend`` picks one.

Every GPU carries a ``uuid`` in NVIDIA's format
(``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``): the Kubernetes device plugin
advertises GPUs by it and containers see it in ``NVIDIA_VISIBLE_DEVICES``. A
real GPU's UUID comes from NVML; a simulated GPU's is derived from the node's
identity and the GPU's index, so it is stable across agent restarts and
distinct between nodes and between the GPUs of one node.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuclusters.agent.dcgm import THERMAL_THROTTLE_MASK, GpuFields
from gpuclusters.core.catalog import GPU_TYPES
from gpuclusters.core.health.findings import GpuHealth
from gpuclusters.core.telemetry import GpuSample

MACHINE_ID_FILE = Path("/etc/machine-id")


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    name: str
    memory_gib: int
    device: str
    present: bool
    uuid: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class GpuBackend(Protocol):
    name: str
    count: int

    def inventory(self) -> list[GpuInfo]: ...

    def health(self) -> list[GpuHealth]:
        """Each GPU's health now (passive checks)."""
        ...

    def telemetry(self) -> list[GpuSample]:
        """Each present GPU's utilisation, memory in use and temperature now."""
        ...

    def fields(self) -> list[GpuFields]:
        """Each present GPU's dcgm-exporter fields now (``agent.dcgm``)."""
        ...


def simulated_gpu_uuid(node_key: str, index: int) -> str:
    """A stable NVIDIA-style UUID for simulated GPU ``index`` of the node
    identified by ``node_key`` (its node id, or its machine-id)."""
    h = hashlib.sha256(f"gpuclusters-simulated-gpu\0{node_key}\0{index}".encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _machine_key() -> str:
    try:
        key = MACHINE_ID_FILE.read_text().strip()
    except OSError:
        key = ""
    return key or socket.gethostname()


class SimulatedGpus:
    """``count`` GPUs of ``gpu_type``; GPU *i* is present while
    ``<dev_dir>/nvidia<i>`` exists. ``node_id`` seeds the GPUs' UUIDs; without
    it the machine-id (else the hostname) does."""

    name = "simulated"

    def __init__(
        self,
        gpu_type: str,
        *,
        dev_dir: Path = Path("/dev"),
        count: int = 8,
        node_id: str | None = None,
        faults_file: Path = Path("/run/gpuclusters/faults.json"),
    ) -> None:
        self.gpu_type = gpu_type
        self.faults_file = faults_file
        self.dev_dir = dev_dir
        self.count = count
        self.node_key = node_id or _machine_key()
        self._uuids = [simulated_gpu_uuid(self.node_key, i) for i in range(count)]

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
                    uuid=self._uuids[i],
                )
            )
        return out

    def telemetry(self, now: float | None = None) -> list[GpuSample]:
        """Plausible, smoothly varying load: each GPU follows its own slow
        wave (period 5 minutes, phase from its UUID) with a little jitter;
        memory in use follows the load, temperature follows it with a
        floor of an idle GPU's. Deterministic for a node and a time, so
        tests can check what the charts get."""
        now = time.time() if now is None else now
        spec = GPU_TYPES.get(self.gpu_type)
        memory = float(spec.memory_gib if spec else 80)
        out = []
        for g in self.inventory():
            if not g.present:
                continue
            seed = int(g.uuid[4:12], 16)
            phase = (seed % 1000) / 1000 * 2 * math.pi
            tick = hashlib.sha256(f"{seed}:{int(now // 5)}".encode()).hexdigest()
            jitter = (int(tick[:4], 16) / 0xFFFF - 0.5) * 10
            wave = 40 * math.sin(2 * math.pi * now / 300 + phase)
            load = min(100.0, max(0.0, 55 + wave + jitter))
            out.append(
                GpuSample(
                    index=g.index,
                    utilization_pct=round(load, 1),
                    memory_used_gib=round(memory * (0.1 + 0.8 * load / 100), 1),
                    temperature_c=round(31 + 0.42 * load, 1),
                )
            )
        return out

    def fields(self, now: float | None = None) -> list[GpuFields]:
        """:meth:`telemetry`'s load, with power and clocks that follow it, a
        steady energy counter, and the injected faults (``faults_file``):
        an injected Xid is the GPU's last Xid, injected double-bit ECC
        errors its volatile DBE count, an injected thermal fault its
        thermal throttle bits. What a fault-free simulated GPU reports for
        errors is 0, as a healthy real GPU does."""
        from gpuclusters.agent.health import read_faults

        now = time.time() if now is None else now
        spec = GPU_TYPES.get(self.gpu_type)
        memory_mib = float(spec.memory_gib if spec else 80) * 1024
        faults = read_faults(self.faults_file).get("gpus") or {}
        by_index = {g.index: g for g in self.inventory()}
        out = []
        for t in self.telemetry(now):
            g = by_index[t.index]
            f = faults.get(str(t.index)) or {}
            xids = [int(x) for x in f.get("xids", [])]
            used = t.memory_used_gib * 1024
            power = round(90 + 6 * t.utilization_pct, 1)
            out.append(
                GpuFields(
                    index=t.index,
                    uuid=g.uuid,
                    device=Path(g.device).name,
                    model=g.name,
                    util_pct=t.utilization_pct,
                    mem_copy_util_pct=round(t.utilization_pct * 0.6, 1),
                    fb_used_mib=round(used),
                    fb_free_mib=round(memory_mib - used),
                    temp_c=t.temperature_c,
                    power_w=power,
                    # as if the GPU had drawn its mean power since the epoch
                    energy_mj=round(now * 390 * 1000),
                    sm_clock_mhz=round(1100 + 8.8 * t.utilization_pct),
                    mem_clock_mhz=2619,
                    xid_last=xids[-1] if xids else 0,
                    ecc_sbe_vol_total=0,
                    ecc_dbe_vol_total=int(f.get("ecc_dbe", 0)),
                    pcie_replay_total=0,
                    nvlink_crc_flit_errors_total=0,
                    throttle_reasons=THERMAL_THROTTLE_MASK if f.get("thermal") else 0,
                )
            )
        return out

    def health(self) -> list[GpuHealth]:
        """Healthy, except for the faults injected into ``faults_file``
        (``gpuclusters nodes inject-fault``)."""
        from gpuclusters.agent.health import read_faults, simulated_gpu_health

        present = [g.present for g in self.inventory()]
        return simulated_gpu_health(self.count, present, read_faults(self.faults_file))
