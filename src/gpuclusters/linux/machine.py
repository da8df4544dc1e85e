"""One node's whole life on the host: boot, power off, wipe, destroy.

A node is "up" when its pinned namespaces exist (its netns under
/run/netns, its mount, UTS, IPC and PID namespaces under the ns dir), its
init (PID 1 of its PID namespace) runs and its veth is on the cluster
bridge. The namespaces are nsfs bind mounts and the init is a child of the
host's init, so the node survives the server.

* :func:`boot` makes whatever is missing, in order: netns + veth + address
  (:mod:`.network`), per-node directories and the files the node starts
  with (written straight into the overlay's upper layer, before it is
  mounted), then the mount, UTS and IPC namespaces (``unshare`` running
  :mod:`._nsinit`), which forks the node's init into a new PID namespace;
  that namespace is pinned here from the init's ``/proc/<pid>/ns/pid``.
  Idempotent: a fully booted node costs a few ``stat``s.
* :func:`power_off` kills the node's init (the kernel then kills every
  process of its PID namespace), whatever else is left in its namespaces
  and cgroup, and unpins the namespaces, which unmounts everything inside
  them (the kernel drops a mount namespace with its last reference). The
  netns and the directories stay: that is a reboot's first half.
* :func:`wipe` empties the per-node disks (root, overlay uppers, /tmp,
  /scratch): a reprovision's middle step.
* :func:`destroy` = power off + delete veth and netns + remove the node
  directory. Before removing anything it checks that nothing is mounted
  below the node directory in the host's namespace, so a stray bind of the
  shared volume can never be deleted through it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import marshal
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuclusters.core.idblocks import IdBlock
from gpuclusters.linux import network, nodebase, nodecgroup, procs, sysmount, userns
from gpuclusters.linux.devices import DeviceSet
from gpuclusters.linux.layout import NODE_ENV, STATE_DIRS, NodeLayout
from gpuclusters.linux.run import CommandError, run

NSINIT = Path(__file__).with_name("_nsinit.py")
_HEX = frozenset("0123456789abcdef")
OVERLAID = ("etc", "var")


class MachineError(RuntimeError):
    """A node could not be booted or torn down; the message says which step."""


@dataclass(frozen=True, slots=True)
class Daemon:
    """A daemon a node starts at boot (as ``NodeShell.spawn`` would)."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NodeBoot:
    """Everything needed to boot one node."""

    layout: NodeLayout
    hostname: str
    network_index: int
    address: str
    run_dir: Path
    gpus: int = 0
    shared_dir: Path | None = None
    node_info: dict[str, Any] = field(default_factory=dict)
    masks: tuple[Path, ...] = ()
    shares: tuple[Path, ...] = ()
    daemons: tuple[Daemon, ...] = ()
    # Per-cluster files bound read-only over the node's /etc/hosts and
    # /etc/resolv.conf: one name table for the whole cluster network, kept
    # current by the provider; and no DNS server, so lookups fail at once
    # instead of timing out (Slurm resolves peers on every RPC).
    hosts_file: Path | None = None
    resolv_file: Path | None = None
    # The host's real GPU/fabric devices (linux/devices.py): bound into the
    # node instead of the ``gpus`` simulated device nodes.
    devices: DeviceSet | None = None
    # The node's share of the host (linux/nodecgroup.py).
    limits: nodecgroup.NodeLimits = field(default_factory=nodecgroup.NodeLimits)
    # The project's host id block, for a node in a user namespace
    # (``layout.userns``; linux/userns.py).
    host_ids: IdBlock | None = None
    # The node image's root (scripts/build-node-image); None: the host's.
    image: Path | None = None


def missing_parts(node: NodeLayout, *, bridge: str) -> list[str]:
    """What of a booted node is not there (empty: the node is up)."""
    missing = []
    if not sysmount.is_ns_file(node.netns_path):
        missing.append("network namespace")
    if not sysmount.is_ns_file(node.mnt_file):
        missing.append("mount namespace")
    elif not boot_completed(node):
        missing.append("completed boot")
    if not sysmount.is_ns_file(node.uts_file):
        missing.append("UTS namespace")
    if not sysmount.is_ns_file(node.ipc_file):
        missing.append("IPC namespace")
    if init_pid(node) is None:
        missing.append("init")
    if not network.link_exists(bridge):
        missing.append("cluster bridge")
    if not network.link_exists(node.veth):
        missing.append("veth")
    elif not network.attached(node.veth, bridge):
        missing.append("place on the cluster bridge")
    return missing


def _machine_id(node_id: str) -> str:
    # 32 lowercase hex digits; our ids (uuid4 hex) already are one.
    if len(node_id) == 32 and set(node_id) <= _HEX:
        return node_id
    return hashlib.sha256(node_id.encode()).hexdigest()[:32]


_private_dirs: set[Path] = set()


def _ensure_ns_dir(path: Path) -> None:
    # Once per process and directory: nothing of ours unmounts it again.
    if path not in _private_dirs or not path.is_dir():
        sysmount.ensure_private_dir(path)
        _private_dirs.add(path)


def _prepare_dirs(b: NodeBoot) -> None:
    node = b.layout
    for path in (node.root, *(node.work(n) for n in OVERLAID)):
        path.mkdir(parents=True, exist_ok=True)
    # /tmp and the local NVMe are for every user of the node, like /tmp.
    for path in (node.tmp, node.scratch):
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o1777)
    for name in STATE_DIRS:
        (node.state / name).mkdir(parents=True, mode=0o700, exist_ok=True)
    nodecgroup.make(node.cgroup_name, b.limits)
    etc = node.upper("etc")
    # The node's own accounts, and no host secret readable (nodebase.py):
    # taken from the image's /etc when it boots from one.
    nodebase.prepare_etc(etc, host_etc=b.image / "etc" if b.image else nodebase.HOST_ETC)
    nodebase.ensure_var_skeleton(node.var_base)
    (node.upper("var") / "log" / "gpuclusters").mkdir(parents=True, exist_ok=True)
    b.run_dir.mkdir(parents=True, exist_ok=True)
    # Written into the upper layer before the overlay is mounted: the node
    # sees them as its own /etc files, the host's /etc never changes.
    info = json.dumps(b.node_info, indent=1, sort_keys=True) + "\n"
    (etc / "gpuclusters" / "node.json").write_text(info)
    (etc / "hostname").write_text(b.hostname + "\n")
    (etc / "machine-id").write_text(_machine_id(node.node_id) + "\n")
    hosts = etc / "hosts"
    if not hosts.exists():  # later edits by the node (or a layer) are kept
        hosts.write_text(
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{b.address}\t{b.hostname}\n"
        )
    if node.userns:
        _own(b)
    _ensure_ns_dir(node.ns_dir)
    for f in node.ns_files:
        f.touch()  # namespaces are bound onto existing files


def _own(b: NodeBoot) -> None:
    """Give what the node owns on the host to its id block: its cgroup (by
    delegation) and its directories. The directories are shifted once, on
    the node's first boot (recorded in ``ids``); afterwards only what the
    server (re)writes there each boot, the /etc layer, is shifted again."""
    node, ids = b.layout, b.host_ids
    if ids is None:
        raise MachineError(f"node {node.node_id} runs in a user namespace but has no id block")
    nodecgroup.delegate(node.cgroup_name, ids.first, ids.first)
    marker = node.ids_file
    if marker.exists() and marker.read_text().strip() == str(ids.first):
        userns.shift_tree(node.upper("etc"), ids)
        return
    for path in node.disks:
        userns.shift_tree(path, ids)
    marker.write_text(f"{ids.first}\n")


def _nsinit_spec(b: NodeBoot) -> dict[str, Any]:
    node = b.layout
    return {
        "hostname": b.hostname,
        "netns": str(node.netns_path),
        "root": str(node.root),
        "image": str(b.image) if b.image else None,
        "overlays": [
            {
                "target": f"/{n}",
                # /etc over the image's or the host's (packages'
                # configuration, with the node's own accounts and secrets
                # hidden in the upper layer), /var over a skeleton: nothing
                # of the host's data.
                "lower": str(node.var_base) if n == "var" else f"{b.image or ''}/{n}",
                "upper": str(node.upper(n)),
                "work": str(node.work(n)),
            }
            for n in OVERLAID
        ],
        "run_dir": str(b.run_dir),
        "cgroups": nodecgroup.leaf_procs(node.cgroup_name),
        "tmp": str(node.tmp),
        "scratch": str(node.scratch),
        "shared": str(b.shared_dir) if b.shared_dir else None,
        "gpus": b.gpus,
        "devices": b.devices.to_nsinit() if b.devices is not None else None,
        "masks": [str(p) for p in b.masks],
        "shares": [str(p) for p in b.shares],
        "daemons": [
            {"name": d.name, "argv": list(d.argv), "env": {**NODE_ENV, **d.env}} for d in b.daemons
        ],
        "binds": [
            {"source": str(node.state / name), "target": target}
            for name, target in STATE_DIRS.items()
        ],
        "etc_binds": [
            {"source": str(src), "target": target}
            for src, target in ((b.hosts_file, "/etc/hosts"), (b.resolv_file, "/etc/resolv.conf"))
            if src is not None
        ],
        **(_userns_spec(b) if node.userns else {}),
    }


def _userns_spec(b: NodeBoot) -> dict[str, Any]:
    node = b.layout
    return {
        "userns": str(node.user_file),
        "owner": b.host_ids.first if b.host_ids else 0,
        "cgroup_top": nodecgroup.top_procs(node.cgroup_name),
        "cgroup_mounts": [[name, opts] for name, opts in nodecgroup.hierarchies()],
    }


async def boot(b: NodeBoot, *, bridge: str) -> bool:
    """Make what is missing of the node; returns whether its mount namespace
    was (re)made, and so its boot daemons started."""
    node = b.layout
    made_netns = False
    if node.userns:
        if b.host_ids is None:
            raise MachineError(f"node {node.node_id} runs in a user namespace but has no id block")
        _ensure_ns_dir(node.ns_dir)
        had_netns = sysmount.is_ns_file(node.netns_path)
        # A new user namespace comes with its netns (one helper for both).
        if await userns.ensure(node.user_file, b.host_ids, netns=node.netns_path):
            if had_netns:
                # A netns made before this user namespace is not owned by it
                # (root in the node could not manage its links): made again.
                await asyncio.to_thread(_power_off, node)
                await network.delete_node_link(node)
            else:
                made_netns = True
    fresh_netns = made_netns | await network.ensure_node_link(
        node,
        bridge=bridge,
        index=b.network_index,
        address=b.address,
        owner=node.user_file if node.userns else None,
    )
    pinned = [sysmount.is_ns_file(f) for f in node.ns_files]
    if all(pinned) and boot_completed(node):
        return False
    if any(pinned) or not fresh_netns:
        # Leftovers of an earlier life (half a pair after a crash mid-boot,
        # processes still in the netns, holding the old mounts): gone first.
        await asyncio.to_thread(_power_off, node)
    await asyncio.to_thread(_prepare_dirs, b)
    nsinit = [sys.executable, "-I", "-S", str(NSINIT)]
    # In a user namespace the boot makes the node's namespaces itself
    # (owned by it); they are pinned below from its init.
    argv = (
        nsinit
        if node.userns
        else [
            "unshare",
            f"--mount={node.mnt_file}",
            f"--uts={node.uts_file}",
            f"--ipc={node.ipc_file}",
            "--propagation",
            "private",
            "--",
            *nsinit,
        ]
    )
    try:
        done = await run(argv, stdin=marshal.dumps(_nsinit_spec(b)), timeout_s=30)
    except CommandError:
        _private_dirs.discard(node.ns_dir)  # check it again next time
        raise
    await asyncio.to_thread(_pin_init, node, done.stdout.decode())
    await asyncio.to_thread(_mark_booted, node)
    return True


def _pin_init(node: NodeLayout, report: str) -> None:
    """Pin the PID namespace of the init _nsinit reported (``init <pid>``)
    and record the init's pid and start time."""
    words = report.split()
    if len(words) != 2 or words[0] != "init" or not words[1].isdigit():
        raise MachineError(f"node boot reported {report.strip()!r}, not its init")
    pid = int(words[1])
    start = procs.start_time(pid)
    if start is None:
        raise MachineError(f"the node's init (pid {pid}) died right after boot")
    pins = [("pid", node.pid_file)]
    if node.userns:
        pins += [
            ("mnt", node.mnt_file),
            ("uts", node.uts_file),
            ("ipc", node.ipc_file),
            ("cgroup", node.cgroup_file),
        ]
    for kind, path in pins:
        sysmount.mount(f"/proc/{pid}/ns/{kind}", str(path), None, sysmount.MS_BIND, None)
    node.init_file.write_text(f"{pid} {start}\n")


def init_pid(node: NodeLayout) -> int | None:
    """The host pid of the node's init, if it runs: the recorded process,
    with its recorded start time (pids are reused), in the pinned PID
    namespace."""
    try:
        pid_s, start = node.init_file.read_text().split()
        pid = int(pid_s)
    except (OSError, ValueError):
        return None
    if procs.start_time(pid) != start:
        return None
    pinned = sysmount.ns_inode(node.pid_file)
    return pid if pinned is not None and procs.pid_ns(pid) == pinned else None


def _boot_marker(node: NodeLayout) -> Path:
    return node.dir / "booted"


def _mark_booted(node: NodeLayout) -> None:
    _boot_marker(node).write_text(repr(sysmount.ns_inode(node.mnt_file)))


def boot_completed(node: NodeLayout) -> bool:
    """Whether the pinned mount namespace is one whose boot finished (root
    built and pivoted into). A boot cut short, e.g. by a server killed while
    ``unshare`` ran, can leave a pinned namespace that is still a copy of the
    host's mounts: running a daemon in it would write to the host's /var.
    Such a node counts as not booted and is torn down and booted again."""
    try:
        marker = _boot_marker(node).read_text()
    except OSError:
        return False
    current = sysmount.ns_inode(node.mnt_file)
    return current is not None and marker == repr(current) and init_pid(node) is not None


def _ns_ids(node: NodeLayout) -> set[procs.NsId]:
    ids = {sysmount.ns_inode(p) for p in (node.netns_path, node.mnt_file, node.pid_file)}
    return {i for i in ids if i is not None}


def _unpin(node: NodeLayout) -> None:
    # The cgroup namespace's pin too when the layout does not know the node
    # had a user namespace (remains of an unrecorded node).
    for f in dict.fromkeys((*node.ns_files, node.cgroup_file)):
        sysmount.unmount(f)
        f.unlink(missing_ok=True)
    node.init_file.unlink(missing_ok=True)


def _power_off(node: NodeLayout) -> int:
    # The init first: the kernel kills every process of its PID namespace
    # (and of the namespaces below it, containers' included) with it.
    killed = procs.kill_init(init_pid(node))
    # Containers have namespaces of their own: they are found by cgroup.
    killed += procs.kill_cgroup(node.cgroup_name)
    killed += procs.kill_all(_ns_ids(node))
    killed += procs.kill_cgroup(node.cgroup_name)  # started while we killed
    procs.remove_cgroup(node.cgroup_name)
    _unpin(node)
    return killed


async def power_off(node: NodeLayout) -> int:
    """Kill every process of the node and drop its mount and UTS namespaces.
    Returns how many processes were killed."""
    return await asyncio.to_thread(_power_off, node)


def _wipe(node: NodeLayout) -> None:
    _refuse_if_mounted(node.dir)
    # The marker first: new disks must be shifted again at the next boot.
    node.ids_file.unlink(missing_ok=True)
    for path in node.disks:
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            raise MachineError(f"cannot remove {path}")


async def wipe(node: NodeLayout) -> None:
    """Empty the node's disks; only while it is powered off."""
    await asyncio.to_thread(_wipe, node)


def _refuse_if_mounted(path: Path) -> None:
    mounted = sysmount.mounts_under(path)
    if mounted:
        raise MachineError(f"refusing to remove {path}: still mounted there: {mounted[:5]}")


def _remove_dir(node: NodeLayout) -> None:
    _refuse_if_mounted(node.dir)
    shutil.rmtree(node.dir, ignore_errors=True)
    if node.dir.exists():
        raise MachineError(f"cannot remove {node.dir}")


async def destroy(node: NodeLayout) -> None:
    """Remove every trace of the node; a node that is gone already is fine."""
    # Processes are found through the namespaces, so they die first.
    await power_off(node)
    await network.delete_node_link(node)
    # Found by its file, not by the layout's mode: a node made in another.
    await asyncio.to_thread(userns.forget, node.user_file)
    await asyncio.to_thread(_remove_dir, node)
