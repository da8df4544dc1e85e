"""Passive checks in the node agent: observe the node, turn what is seen
into findings (``core.health.findings``), send them with each heartbeat.

What is observed:

* **GPUs** through the backend's ``health()``: NVML on real GPUs (Xid
  events, ECC double-bit counters, row-remap failures, throttle reasons,
  PCIe replay counters); on the embedded fleet the simulated backend reads
  injected faults from ``/run/gpuclusters/faults.json`` (the node's own
  ``/run``, wiped by a reboot like a real GPU's error state).
* **The node**: whether ``/scratch`` takes a write (read-only filesystem;
  also injectable), free space there, available memory, free PIDs,
  InfiniBand port states from sysfs where present, and restart loops of
  the node's daemons (slurmd, kubelet, containerd), counted from changes of
  the pid files under ``/run/gpuclusters-daemons``.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from gpuclusters.core.health.findings import (
    Finding,
    GpuHealth,
    NodeState,
    gpu_findings,
    node_findings,
)

FAULTS_FILE = Path("/run/gpuclusters/faults.json")
DAEMON_DIR = Path("/run/gpuclusters-daemons")
WATCHED_DAEMONS = ("slurmd", "kubelet", "containerd")
IB_SYSFS = Path("/sys/class/infiniband")
RESTART_WINDOW_S = 600.0


def read_faults(path: Path = FAULTS_FILE) -> dict[str, Any]:
    """Injected faults: ``{"gpus": {"3": {"xids": [79], ...}}, "disk_ro": true}``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def simulated_gpu_health(
    count: int, present: list[bool], faults: dict[str, Any]
) -> list[GpuHealth]:
    per_gpu = faults.get("gpus") or {}
    out = []
    for i in range(count):
        f = per_gpu.get(str(i)) or {}
        out.append(
            GpuHealth(
                index=i,
                present=present[i] and not f.get("fell_off_bus", False),
                xids=tuple(int(x) for x in f.get("xids", [])),
                ecc_dbe=int(f.get("ecc_dbe", 0)),
                row_remap_failure=bool(f.get("row_remap_failure", False)),
                thermal_throttle=bool(f.get("thermal", False)),
                pcie_replays_per_min=float(f.get("pcie_replays_per_min", 0.0)),
            )
        )
    return out


def _fraction(free: float, total: float) -> float:
    return free / total if total > 0 else 1.0


def _scratch_writable(scratch: Path) -> bool:
    probe = scratch / f".gpuclusters-health-{os.getpid()}"
    try:
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError:
        return False
    return True


def _memory_available() -> float:
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return 1.0
    return _fraction(info.get("MemAvailable", 0), info.get("MemTotal", 0))


def _pids_free() -> float:
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        used = sum(1 for p in Path("/proc").iterdir() if p.name.isdigit())
    except (OSError, ValueError):
        return 1.0
    return _fraction(pid_max - used, pid_max)


def _ib_ports(root: Path = IB_SYSFS) -> dict[str, str]:
    ports: dict[str, str] = {}
    if not root.is_dir():
        return ports
    for state in root.glob("*/ports/*/state"):
        try:
            # "4: ACTIVE"
            ports[f"{state.parts[-4]}/{state.parts[-2]}"] = state.read_text().split(":")[-1].strip()
        except OSError:
            continue
    return ports


class NodeWatcher:
    """Keeps what passive checks need across heartbeats: daemon pids and IB
    port states seen recently, to count restarts and flaps in a window."""

    def __init__(
        self,
        *,
        scratch: Path = Path("/scratch"),
        daemon_dir: Path = DAEMON_DIR,
        faults_file: Path = FAULTS_FILE,
        window_s: float = RESTART_WINDOW_S,
    ) -> None:
        self.scratch = scratch
        self.daemon_dir = daemon_dir
        self.faults_file = faults_file
        self.window_s = window_s
        self._pids: dict[str, str] = {}
        self._restarts: dict[str, deque[float]] = {}
        self._ib: dict[str, str] = {}
        self._flaps: dict[str, deque[float]] = {}

    def _changes(
        self, seen: dict[str, str], log: dict[str, deque[float]], now_values: dict[str, str]
    ) -> dict[str, int]:
        now = time.monotonic()
        for name, value in now_values.items():
            before = seen.get(name)
            if before is not None and before != value:
                log.setdefault(name, deque()).append(now)
            seen[name] = value
        out = {}
        for name, times in log.items():
            while times and now - times[0] > self.window_s:
                times.popleft()
            out[name] = len(times)
        return out

    def node_state(self, faults: dict[str, Any]) -> NodeState:
        pids = {}
        for name in WATCHED_DAEMONS:
            try:
                pids[name] = (self.daemon_dir / f"{name}.pid").read_text().split()[0]
            except (OSError, IndexError):
                continue
        restarts = self._changes(self._pids, self._restarts, pids)
        ib_now = _ib_ports()
        flaps = self._changes(self._ib, self._flaps, ib_now)
        disk_free = 1.0
        try:
            st = os.statvfs(self.scratch)
            disk_free = _fraction(st.f_bavail, st.f_blocks)
        except OSError:
            pass
        return NodeState(
            scratch_writable=not faults.get("disk_ro", False) and _scratch_writable(self.scratch),
            disk_free_fraction=disk_free,
            memory_available_fraction=_memory_available(),
            pids_free_fraction=_pids_free(),
            daemon_restarts=restarts,
            ib_ports={p: (s, flaps.get(p, 0)) for p, s in ib_now.items()},
        )

    def findings(self, gpus: list[GpuHealth], *, expected_gpus: int) -> list[Finding]:
        faults = read_faults(self.faults_file)
        return gpu_findings(gpus, expected=expected_gpus) + node_findings(self.node_state(faults))
