"""Passive health findings: from a GPU's and a node's observed state to
alerts with a kind and a severity (contract section 6).

Both the NVML and the simulated backend report the same ``GpuHealth`` per
GPU; :func:`gpu_findings` and :func:`node_findings` turn snapshots into
``Finding`` values the agent sends with its heartbeat. The server keeps one
open alert per (node, kind, gpu) and resolves it when the finding stops.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class AlertKind(StrEnum):
    XID = "xid"
    ECC_DBE = "ecc_dbe"
    ROW_REMAP_FAILURE = "row_remap_failure"
    GPU_MISSING = "gpu_missing"  # fell off the bus / count mismatch
    THERMAL_THROTTLE = "thermal_throttle"
    PCIE_REPLAY = "pcie_replay"
    IB_PORT_DOWN = "ib_port_down"
    IB_PORT_FLAP = "ib_port_flap"
    FS_READONLY = "fs_readonly"
    DISK_PRESSURE = "disk_pressure"
    MEMORY_PRESSURE = "memory_pressure"
    PID_PRESSURE = "pid_pressure"
    DAEMON_RESTART_LOOP = "daemon_restart_loop"
    HEARTBEAT_MISSED = "heartbeat_missed"


# Xid codes that mean the GPU needs hands-on repair (NVIDIA's Xid catalogue):
# 48 double-bit ECC, 63/64 row remapping, 74 NVLink, 79 fallen off the bus,
# 92 high single-bit ECC rate, 94/95 contained/uncontained ECC, 119/120 GSP.
FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
XID_FELL_OFF_BUS = 79

# Defaults; the server may pass its own.
PCIE_REPLAYS_PER_MIN = 100.0
DISK_FREE_MIN = 0.05
MEMORY_AVAILABLE_MIN = 0.05
PIDS_FREE_MIN = 0.05
RESTARTS_IN_WINDOW = 3


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """One GPU's health as a backend observes it."""

    index: int
    present: bool = True
    xids: tuple[int, ...] = ()
    ecc_dbe: int = 0
    row_remap_failure: bool = False
    thermal_throttle: bool = False
    pcie_replays_per_min: float = 0.0


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str
    severity: str
    message: str
    gpu: int | None = None
    code: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gpu_findings(
    gpus: Iterable[GpuHealth],
    *,
    expected: int,
    pcie_replays_per_min: float = PCIE_REPLAYS_PER_MIN,
) -> list[Finding]:
    out: list[Finding] = []
    seen = 0
    for g in gpus:
        if not g.present:
            out.append(
                Finding(
                    AlertKind.GPU_MISSING,
                    Severity.CRITICAL,
                    f"GPU {g.index} has fallen off the bus",
                    gpu=g.index,
                )
            )
            continue
        seen += 1
        for code in sorted(set(g.xids)):
            fatal = code in FATAL_XIDS
            kind = AlertKind.GPU_MISSING if code == XID_FELL_OFF_BUS else AlertKind.XID
            out.append(
                Finding(
                    kind,
                    Severity.CRITICAL if fatal else Severity.WARNING,
                    f"GPU {g.index}: Xid {code}"
                    + (" (fallen off the bus)" if code == XID_FELL_OFF_BUS else "")
                    + (" (fatal)" if fatal else ""),
                    gpu=g.index,
                    code=code,
                )
            )
        if g.ecc_dbe:
            out.append(
                Finding(
                    AlertKind.ECC_DBE,
                    Severity.CRITICAL,
                    f"GPU {g.index}: {g.ecc_dbe} double-bit ECC error(s)",
                    gpu=g.index,
                    details={"count": g.ecc_dbe},
                )
            )
        if g.row_remap_failure:
            out.append(
                Finding(
                    AlertKind.ROW_REMAP_FAILURE,
                    Severity.CRITICAL,
                    f"GPU {g.index}: row remapping failed",
                    gpu=g.index,
                )
            )
        if g.thermal_throttle:
            out.append(
                Finding(
                    AlertKind.THERMAL_THROTTLE,
                    Severity.WARNING,
                    f"GPU {g.index} is thermally throttled",
                    gpu=g.index,
                )
            )
        if g.pcie_replays_per_min > pcie_replays_per_min:
            out.append(
                Finding(
                    AlertKind.PCIE_REPLAY,
                    Severity.WARNING,
                    f"GPU {g.index}: {g.pcie_replays_per_min:.0f} PCIe replays/min "
                    f"(> {pcie_replays_per_min:.0f})",
                    gpu=g.index,
                    details={"per_min": g.pcie_replays_per_min},
                )
            )
    if seen < expected and not any(f.kind == AlertKind.GPU_MISSING for f in out):
        out.append(
            Finding(AlertKind.GPU_MISSING, Severity.CRITICAL, f"{seen} of {expected} GPUs visible")
        )
    return out


@dataclass(frozen=True, slots=True)
class NodeState:
    """Host-level observations of one node."""

    scratch_writable: bool = True
    disk_free_fraction: float = 1.0
    memory_available_fraction: float = 1.0
    pids_free_fraction: float = 1.0
    # daemon name -> restarts seen in the agent's window
    daemon_restarts: dict[str, int] = field(default_factory=dict)
    # InfiniBand port -> (state, state changes in the window)
    ib_ports: dict[str, tuple[str, int]] = field(default_factory=dict)


def node_findings(state: NodeState) -> list[Finding]:
    out: list[Finding] = []
    if not state.scratch_writable:
        out.append(
            Finding(AlertKind.FS_READONLY, Severity.CRITICAL, "local NVMe (/scratch) is read-only")
        )
    if state.disk_free_fraction < DISK_FREE_MIN:
        out.append(
            Finding(
                AlertKind.DISK_PRESSURE,
                Severity.WARNING,
                f"/scratch {state.disk_free_fraction:.0%} free",
            )
        )
    if state.memory_available_fraction < MEMORY_AVAILABLE_MIN:
        out.append(
            Finding(
                AlertKind.MEMORY_PRESSURE,
                Severity.WARNING,
                f"{state.memory_available_fraction:.0%} of memory available",
            )
        )
    if state.pids_free_fraction < PIDS_FREE_MIN:
        out.append(
            Finding(
                AlertKind.PID_PRESSURE,
                Severity.WARNING,
                f"{state.pids_free_fraction:.0%} of PIDs free",
            )
        )
    for name, restarts in sorted(state.daemon_restarts.items()):
        if restarts >= RESTARTS_IN_WINDOW:
            out.append(
                Finding(
                    AlertKind.DAEMON_RESTART_LOOP,
                    Severity.WARNING,
                    f"{name} restarted {restarts} times recently",
                    details={"daemon": name, "restarts": restarts},
                )
            )
    for port, (port_state, changes) in sorted(state.ib_ports.items()):
        if port_state.upper() != "ACTIVE":
            out.append(
                Finding(
                    AlertKind.IB_PORT_DOWN,
                    Severity.CRITICAL,
                    f"InfiniBand port {port} is {port_state}",
                    details={"port": port},
                )
            )
        elif changes >= RESTARTS_IN_WINDOW:
            out.append(
                Finding(
                    AlertKind.IB_PORT_FLAP,
                    Severity.WARNING,
                    f"InfiniBand port {port} changed state {changes} times",
                    details={"port": port},
                )
            )
    return out


def alert_key(f: Finding | dict[str, Any]) -> tuple[str, int | None, str]:
    """What identifies one open alert of a node: kind, GPU, and the
    daemon or port it is about (so two ports down are two alerts)."""
    if isinstance(f, Finding):
        kind, gpu, details = f.kind, f.gpu, f.details
    else:
        kind, gpu, details = f["kind"], f.get("gpu"), f.get("details") or {}
    sub = str(details.get("daemon") or details.get("port") or "")
    return (str(kind), gpu, sub)
