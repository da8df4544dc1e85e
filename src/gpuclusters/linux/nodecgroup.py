"""A node's share of the host: its cgroup, its limits, and joining it.

Every node (GPU, controller, login, control plane) gets cgroup
``gpc-<id[:12]>`` (``NodeLayout.cgroup_name``) with CPU, memory and pids
limits (:class:`NodeLimits`), so that one node cannot starve the host or
its neighbours. Its processes live in the leaf ``gpc-<id>/node``: the
node's init joins it before it forks anything, so every daemon (sshd,
slurmd and Slurm jobs, containerd, kubelet) and the helpers the control
plane's file and daemon operations go through are in it. Pods go below
``gpc-<id>`` too, in the ``kubepods`` tree kubelet makes under its
``cgroupRoot`` (``/gpc-<id>``), so they count against the same limits.
(A leaf for the node's own processes because cgroup v2 allows no process
in a cgroup whose controllers are handed down to children.)

* **cgroup v1** (this development machine): the directories under every
  mounted controller; limits in ``memory.limit_in_bytes`` and ``pids.max``;
  CPU as a *weight*, ``cpu.shares`` (1024 per CPU of the share), not a
  quota: v1 refuses a child's CFS quota above its parent's (EINVAL), so a
  node quota of 1.75 CPUs made runc fail on every pod with a CPU limit of 2
  (kubelet sizes limits by the machine's CPUs, not by a quota it is under).
* **cgroup v2** (Debian 12 hosts): one directory in the unified hierarchy,
  ``cpu``, ``memory`` and ``pids`` enabled down to it
  (``cgroup.subtree_control``); limits in ``cpu.max``, ``memory.max`` and
  ``pids.max``.

Commands the control plane runs in a node with ``nsenter`` (layer setup,
``clusters ssh --as-root``) stay in the server's cgroup: they are the
operator's, not the node's users'.

:func:`host_share` is the default: the host minus a reserve for the host
agent and the system (:data:`RESERVE_CPUS`, :data:`RESERVE_MEMORY`,
:data:`RESERVE_PIDS`). Blocking file work; callers use
``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
LEAF = "node"
CFS_PERIOD_US = 100_000
V1_SHARES_PER_CPU = 1024
# What every node leaves to the host: a quarter of a CPU, 5 % of memory (at
# least 512 MiB) and 4096 pids (the kernel's pid_max is shared).
RESERVE_CPUS = 0.25
RESERVE_MEMORY_FRACTION = 0.05
RESERVE_MEMORY = 512 * 1024**2
RESERVE_PIDS = 4096
V2_CONTROLLERS = ("cpu", "memory", "pids")


@dataclass(frozen=True, slots=True)
class NodeLimits:
    """One node's limits; None: no limit of that kind."""

    cpus: float | None = None
    memory_bytes: int | None = None
    pids: int | None = None


def host_share(cpus: int, memory_bytes: int, pid_max: int, *, fraction: float = 1.0) -> NodeLimits:
    """The limits of a node that may use ``fraction`` of the host (1.0 on a
    GPU host: its nodes are sized to it) once the reserve is taken."""
    if not 0 < fraction <= 1:
        raise ValueError(f"node share {fraction} outside (0, 1]")
    reserve_mem = max(RESERVE_MEMORY, int(memory_bytes * RESERVE_MEMORY_FRACTION))
    return NodeLimits(
        cpus=round(max(0.1, (cpus - RESERVE_CPUS) * fraction), 2),
        memory_bytes=max(256 * 1024**2, int((memory_bytes - reserve_mem) * fraction)),
        pids=max(1024, int((pid_max - RESERVE_PIDS) * fraction)),
    )


def this_host_share(fraction: float = 1.0) -> NodeLimits:
    pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = 32768
    return host_share(os.cpu_count() or 1, pages * page, pid_max, fraction=fraction)


def is_v2(root: Path = CGROUP_ROOT) -> bool:
    return (root / "cgroup.controllers").exists()


def _v1_hierarchies(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [
        h
        for h in sorted(root.iterdir())
        # "unified": the v2 hierarchy of a hybrid setup holds no controllers
        if not h.is_symlink() and h.name != "unified" and (h / "cgroup.procs").exists()
    ]


def node_dirs(name: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """The node's cgroup in every hierarchy (v1) or the unified one (v2)."""
    if is_v2(root):
        return [root / name]
    return [h / name for h in _v1_hierarchies(root)]


def leaf_procs(name: str, root: Path = CGROUP_ROOT) -> list[str]:
    """The ``cgroup.procs`` files a process of the node joins (writing
    ``0``: ``_nodeops.join_cgroups``)."""
    return [str(d / LEAF / "cgroup.procs") for d in node_dirs(name, root)]


def _write(path: Path, value: str) -> None:
    # The kernel makes the knobs; a missing one (a controller this kernel
    # lacks) is skipped rather than created as a plain file.
    if path.exists():
        path.write_text(value)


def _copy_cpuset(parent: Path, child: Path) -> None:
    # A new cpuset cgroup starts with no CPUs and no memory nodes: it gets
    # its parent's, or nothing could join it.
    for knob in ("cpuset.cpus", "cpuset.mems"):
        mine = child / knob
        if mine.exists() and not mine.read_text().strip():
            mine.write_text((parent / knob).read_text())


def make(name: str, limits: NodeLimits, root: Path = CGROUP_ROOT) -> None:
    """Create the node's cgroup and its ``node`` leaf, and set its limits
    (idempotent: limits are rewritten)."""
    if is_v2(root):
        _make_v2(root, name, limits)
        return
    for h in _v1_hierarchies(root):
        top = h / name
        for d in (top, top / LEAF):
            d.mkdir(exist_ok=True)
            _copy_cpuset(d.parent, d)
        shares = V1_SHARES_PER_CPU if limits.cpus is None else limits.cpus * V1_SHARES_PER_CPU
        _write(top / "cpu.shares", str(max(2, int(shares))))
        if limits.memory_bytes is not None:
            _write(top / "memory.limit_in_bytes", str(limits.memory_bytes))
        _write(top / "pids.max", "max" if limits.pids is None else str(limits.pids))


def _make_v2(root: Path, name: str, limits: NodeLimits) -> None:
    available = set((root / "cgroup.controllers").read_text().split())
    wanted = [c for c in V2_CONTROLLERS if c in available]
    top = root / name
    top.mkdir(exist_ok=True)
    enable = " ".join("+" + c for c in wanted)
    for d in (root, top) if enable else ():
        # Not ours to hand down (a container's cgroup with processes in it,
        # a controller the parent keeps): the node then runs without those
        # limits; their knobs are missing and skipped below.
        with contextlib.suppress(OSError):
            _write(d / "cgroup.subtree_control", enable)
    (top / LEAF).mkdir(exist_ok=True)
    cpu = "max" if limits.cpus is None else str(int(limits.cpus * CFS_PERIOD_US))
    _write(top / "cpu.max", f"{cpu} {CFS_PERIOD_US}")
    _write(top / "memory.max", "max" if limits.memory_bytes is None else str(limits.memory_bytes))
    _write(top / "pids.max", "max" if limits.pids is None else str(limits.pids))


# What a delegatee owns in the cgroup handed to it (cgroup v2's delegation
# model, and the same files on v1): creating children, moving processes
# between them, handing controllers down; never the limits of the
# delegated cgroup itself, which its parent (the host) sets.
_DELEGATED_FILES = ("cgroup.procs", "tasks", "cgroup.subtree_control", "cgroup.threads")


def delegate(name: str, uid: int, gid: int, root: Path = CGROUP_ROOT) -> None:
    """Hand the node's cgroup to its user namespace's root (host ids
    ``uid``/``gid``): the directory and :data:`_DELEGATED_FILES` of
    ``gpc-<id>``, and all of its ``node`` leaf. On v1 this is delegation by
    ownership, per hierarchy; on v2 the usual delegation."""
    for top in node_dirs(name, root):
        owned = [top, *(top / f for f in _DELEGATED_FILES)]
        leaf = top / LEAF
        owned += [leaf, *leaf.iterdir()] if leaf.is_dir() else []
        for path in owned:
            if path.exists():
                os.chown(path, uid, gid)


def top_procs(name: str, root: Path = CGROUP_ROOT) -> list[str]:
    """The ``cgroup.procs`` of the node's cgroup itself: where a node's
    boot stands when it makes the node's cgroup namespace, whose root is
    then ``gpc-<id>`` (the node's init moves on into the leaf)."""
    return [str(d / "cgroup.procs") for d in node_dirs(name, root)]


def hierarchies(root: Path = CGROUP_ROOT) -> list[tuple[str, str]]:
    """``(directory name, mount options)`` of each v1 hierarchy, or of the
    v2 one (``("", "")``): what a node mounts again inside its cgroup
    namespace, at the same places, so that it sees its own subtree as the
    whole of each."""
    if is_v2(root):
        return [("", "")]
    out = []
    for h in _v1_hierarchies(root):
        opts = _v1_options(h)
        if opts:
            out.append((h.name, opts))
    return out


def _v1_options(path: Path) -> str:
    # The controllers (or name=...) a v1 hierarchy was mounted with, from
    # mountinfo's super options.
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(fields) > 4 and fields[4] == str(path) and post_fields[:1] == ["cgroup"]:
            opts = post_fields[2].split(",") if len(post_fields) > 2 else []
            keep = [o for o in opts if o not in ("rw", "ro") and not o.startswith("release_agent")]
            return ",".join(keep)
    return ""
