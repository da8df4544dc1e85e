"""Cluster bridges and node links, with iproute2.

One bridge per cluster in the host's network namespace carries the host
address ``.1`` of the cluster's /24; each node is a named netns joined to
it by a veth pair (host end ``gpcv…`` enslaved to the bridge, node end
``eth0``). Isolation between clusters rests on the host not routing:
``net.ipv4.ip_forward`` stays 0, so a packet from cluster A to a node of
cluster B reaches the host on A's bridge and is dropped there. (The host's
own bridge addresses answer from every cluster, like any local address.)

Each operation is one or two ``ip -batch`` runs, built only from commands
that are needed (existence is checked first through /sys/class/net and the
netns file), so every function is idempotent and cheap on the fast path.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
from pathlib import Path

from gpuclusters.linux import layout, sysmount, userns
from gpuclusters.linux.layout import NodeLayout
from gpuclusters.linux.run import run

IP = "ip"


def link_exists(name: str) -> bool:
    # The server runs in the host's netns, whose links its /sys shows.
    return os.path.lexists(f"/sys/class/net/{name}")


def attached(port: str, bridge: str) -> bool:
    """Whether link ``port`` is a port of ``bridge`` (a deleted and remade
    bridge has lost its ports)."""
    try:
        return os.path.basename(os.readlink(f"/sys/class/net/{port}/master")) == bridge
    except OSError:
        return False


async def _batch(commands: list[str], *, netns: str | None = None) -> None:
    if not commands:
        return
    argv = [IP] + (["-n", netns] if netns else []) + ["-batch", "-"]
    await run(argv, stdin=("\n".join(commands) + "\n").encode(), timeout_s=20)


def _bridge_mac(cluster_id: str) -> str:
    # A fixed, locally administered MAC: a Linux bridge otherwise takes the
    # lowest MAC of its ports, so it would change as nodes come and go and
    # every node's ARP entry for the gateway would go stale.
    digest = hashlib.sha256(cluster_id.encode()).digest()
    return "02:" + ":".join(f"{b:02x}" for b in digest[:5])


def link_mtu(name: str) -> int | None:
    try:
        with open(f"/sys/class/net/{name}/mtu") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


async def ensure_bridge(cluster_id: str, index: int, *, mtu: int | None = None) -> str:
    """Create the cluster's bridge with its host address (and ``mtu``, for
    a cluster that spans hosts); returns its name."""
    name = layout.bridge_name(cluster_id)
    gw = f"{layout.gateway(index)}/24"
    cmds = []
    if not link_exists(name):
        cmds.append(f"link add name {name} address {_bridge_mac(cluster_id)} type bridge")
    if mtu is not None and link_mtu(name) != mtu:
        cmds.append(f"link set {name} mtu {mtu}")
    cmds += [f"addr replace {gw} dev {name}", f"link set {name} up"]
    await _batch(cmds)
    return name


async def delete_bridge(cluster_id: str) -> None:
    name = layout.bridge_name(cluster_id)
    if link_exists(name):
        await _batch([f"link del {name}"])


async def ensure_node_link(
    node: NodeLayout, *, bridge: str, index: int, address: str, owner: Path | None = None
) -> bool:
    """Named netns, veth pair on ``bridge``, address and default route.
    Returns whether the netns is new (so it cannot hold processes yet).
    ``owner``: the pinned user namespace a new netns is made in (the
    node's, linux/userns.py)."""
    cmds = []
    fresh = not sysmount.is_ns_file(node.netns_path)
    if fresh:
        if node.netns_path.exists():
            # A plain file left from before a host reboot: `ip netns add`
            # refuses to reuse it.
            node.netns_path.unlink()
        if owner is not None:
            await userns.make_netns(owner, node.netns_path)
        else:
            cmds.append(f"netns add {node.netns}")
        if link_exists(node.veth):
            # Its peer is in the node's old netns, which the node's init
            # (and so the veth) outlived: a new pair goes into the new one.
            cmds.insert(0, f"link del {node.veth}")
    if fresh or not link_exists(node.veth):
        cmds.append(f"link add {node.veth} type veth peer name eth0 netns {node.netns}")
    cmds.append(f"link set {node.veth} master {bridge} up")
    await _batch(cmds)
    await _batch(
        [
            f"addr replace {address}/24 dev eth0",
            "link set lo up",
            "link set eth0 up",
            f"route replace default via {layout.gateway(index)}",
        ],
        netns=node.netns,
    )
    await _quickack_routes(node.netns)
    return fresh


async def _quickack_routes(netns: str) -> None:
    """``quickack 1`` on every unicast route of the node, loopback included.

    Slurm (and MariaDB's clients) send a request as two writes and then wait
    for the answer; with delayed ACKs each such exchange stalls ~40 ms, which
    made slurmctld take ~1 s to start and doubled cluster create time
    (docs/benchmarks.md). A data-centre NIC driver would not delay these
    either."""
    shown = await run([IP, "-n", netns, "-4", "route", "show", "table", "all"], timeout_s=10)
    cmds = []
    for line in shown.stdout.decode().splitlines():
        words = line.split()
        if not words or words[0] in ("broadcast", "multicast") or "quickack" in words:
            continue
        cmds.append("route replace " + " ".join(words) + " quickack 1")
    await _batch(cmds, netns=netns)


async def delete_node_link(node: NodeLayout) -> None:
    cmds = []
    if link_exists(node.veth):
        # Deleting one end of a veth pair deletes both, at once (the netns
        # may linger a moment while its last process exits).
        cmds.append(f"link del {node.veth}")
    if node.netns_path.exists():
        cmds.append(f"netns del {node.netns}")
    await _batch(cmds)


async def host_subnets_in_pool() -> set[int]:
    """Indexes of 10.231.<i>.0/24 networks already used by any interface of
    the host, so a second server (another home) never reuses them."""
    done = await run([IP, "-j", "-4", "addr", "show"], timeout_s=10)
    used: set[int] = set()
    for link in json.loads(done.stdout or b"[]"):
        for info in link.get("addr_info", []):
            try:
                net = ipaddress.IPv4Interface(f"{info['local']}/{info['prefixlen']}").network
            except (KeyError, ValueError):
                continue
            if net.overlaps(layout.SUBNET_POOL):
                for i in range(256):
                    if net.overlaps(layout.subnet(i)):
                        used.add(i)
    return used


# -- clusters that span hosts -------------------------------------------------

VXLAN_PORT = 4789


def vxlan_name(cluster_id: str) -> str:
    """The cluster's VXLAN device, a port of its bridge on every host."""
    return "gpcx" + layout.check_id(cluster_id, "cluster id")[:8]


async def _fdb_peers(device: str) -> set[str]:
    """Remote VTEPs of the all-zeros (flooding) entries of ``device``."""
    done = await run(["bridge", "-j", "fdb", "show", "dev", device], timeout_s=10)
    peers: set[str] = set()
    for entry in json.loads(done.stdout or b"[]"):
        if entry.get("mac") == "00:00:00:00:00:00" and entry.get("dst"):
            peers.add(str(entry["dst"]))
    return peers


async def ensure_vxlan(cluster_id: str, *, vni: int, local: str, peers: set[str], mtu: int) -> str:
    """The cluster's VXLAN segment on this host: a device with the cluster's
    VNI on its bridge, one static all-zeros forwarding entry per other host
    of the cluster (head-end replication of broadcasts: no multicast needed
    in the underlay), and ``mtu`` on the bridge and the device. Entries for
    hosts that left are removed. Idempotent."""
    bridge = layout.bridge_name(cluster_id)
    name = vxlan_name(cluster_id)
    if not 1 <= vni <= 0xFFFFFF:
        raise ValueError(f"VNI {vni} outside 1-16777215")
    cmds = []
    if not link_exists(name):
        cmds.append(f"link add {name} type vxlan id {vni} local {local} dstport {VXLAN_PORT}")
    cmds += [
        f"link set {name} mtu {mtu}",
        f"link set {bridge} mtu {mtu}",
        f"link set {name} master {bridge} up",
    ]
    await _batch(cmds)
    # Broadcasts and unknown unicast go to every peer through the static
    # all-zeros entries the control plane keeps; the device learns which
    # host each remote node's MAC sits behind from the traffic itself.
    # Every host's bridge has the same gateway address and MAC (an anycast
    # gateway): a node's traffic to .1 never leaves its host.
    have = await _fdb_peers(name)
    fdb = [f"fdb append 00:00:00:00:00:00 dev {name} dst {p}" for p in sorted(peers - have)]
    fdb += [f"fdb del 00:00:00:00:00:00 dev {name} dst {p}" for p in sorted(have - peers)]
    if fdb:
        await run(["bridge", "-batch", "-"], stdin=("\n".join(fdb) + "\n").encode(), timeout_s=20)
    return name


async def delete_vxlan(cluster_id: str) -> None:
    name = vxlan_name(cluster_id)
    if link_exists(name):
        await _batch([f"link del {name}"])


async def ensure_node_mtu(node: NodeLayout, mtu: int) -> None:
    """Both ends of the node's veth at ``mtu`` (the cluster's segment MTU:
    a bridge never fragments, so every port must agree)."""
    await _batch([f"link set {node.veth} mtu {mtu}"])
    await _batch([f"link set eth0 mtu {mtu}"], netns=node.netns)
