"""The node's CPU, memory, /scratch and network, as the node agent exports
them next to its GPUs' fields.

A node is a set of namespaces on a host, so the host-wide files
(``/proc/stat``, ``/proc/meminfo``) would describe the host, not the node.
CPU time and memory in use are read from the node's cgroup instead: the
cgroup of the node's init (PID 1 in the node's PID namespace), under
cgroup v2 (``cpu.stat``, ``memory.current``) or v1 (``cpuacct.usage``,
``memory.usage_in_bytes``), whichever the host has. The network counters
of ``/proc/net/dev`` are already the node's own (its network namespace);
``/scratch`` is the node's local disk. Anything that cannot be read is
left out of the scrape, never reported as 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class NodeStats:
    cpu_seconds: float | None = None
    memory_used_bytes: float | None = None
    scratch_size_bytes: float | None = None
    scratch_free_bytes: float | None = None
    # interface -> (received bytes, transmitted bytes)
    network: dict[str, tuple[float, float]] = field(default_factory=dict)


def _cgroups(proc_cgroup: Path) -> dict[str, str]:
    """controller (or "" for v2's unified hierarchy) -> path."""
    out: dict[str, str] = {}
    try:
        text = proc_cgroup.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            out[controller] = parts[2]
    return out


def _read_number(path: Path) -> float | None:
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cpu_seconds(root: Path, groups: dict[str, str]) -> float | None:
    if "cpuacct" in groups:
        rel = groups["cpuacct"].lstrip("/")
        for mount in ("cpuacct", "cpu,cpuacct", "cpuacct,cpu"):
            ns = _read_number(root / mount / rel / "cpuacct.usage")
            if ns is not None:
                return ns / 1e9
    if "" in groups:
        try:
            text = (root / groups[""].lstrip("/") / "cpu.stat").read_text()
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return float(value) / 1e6
    return None


def _memory_bytes(root: Path, groups: dict[str, str]) -> float | None:
    if "memory" in groups:
        rel = groups["memory"].lstrip("/")
        used = _read_number(root / "memory" / rel / "memory.usage_in_bytes")
        if used is not None:
            return used
    if "" in groups:
        return _read_number(root / groups[""].lstrip("/") / "memory.current")
    return None


def _network(net_dev: Path) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    try:
        lines = net_dev.read_text().splitlines()[2:]
    except OSError:
        return out
    for line in lines:
        name, sep, rest = line.partition(":")
        fields = rest.split()
        if not sep or len(fields) < 9 or name.strip() == "lo":
            continue
        out[name.strip()] = (float(fields[0]), float(fields[8]))
    return out


def read_node_stats(
    *,
    proc: Path = Path("/proc"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    scratch: Path = Path("/scratch"),
) -> NodeStats:
    groups = _cgroups(proc / "1" / "cgroup")
    stats = NodeStats(
        cpu_seconds=_cpu_seconds(cgroup_root, groups),
        memory_used_bytes=_memory_bytes(cgroup_root, groups),
        network=_network(proc / "net" / "dev"),
    )
    try:
        st = os.statvfs(scratch)
    except OSError:
        pass
    else:
        stats.scratch_size_bytes = float(st.f_blocks * st.f_frsize)
        stats.scratch_free_bytes = float(st.f_bavail * st.f_frsize)
    return stats
