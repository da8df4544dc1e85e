"""What the netns provider remembers: ``$GPUCLUSTERS_HOME/netns-provider.json``.

The namespaces themselves are the truth about whether a node is up; this
file is the truth about which nodes *should* exist and with what identity
(name, cluster, host, address) and where their pieces are (the ns and node
directories they were made with, so a changed setting never strands a
node). It also holds each cluster's network: the index ``i`` of its
``10.231.<i>.0/24`` and its bridge.

Records are written before any namespace is made (intent first), so after a
crash the provider finds what it had started and can finish or remove it;
writes are atomic (temp file, fsync, rename) like the fake provider's.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpuclusters.linux import layout
from gpuclusters.linux.layout import NodeLayout
from gpuclusters.providers.base import NodeSpec

VERSION = 1
# "remote": a GPU node another host runs (through its host agent); kept
# here on the server so that the cluster's addresses and names have one
# owner. The namespaces of such a node are the other host's business.
NodeKind = Literal["gpu", "service", "remote"]


@dataclass(slots=True)
class NodeRecord:
    node_id: str
    kind: NodeKind
    name: str
    hostname: str
    cluster_id: str
    cluster_name: str
    address: str
    ns_dir: str
    nodes_dir: str
    host: str | None = None
    gpu_type: str | None = None
    compute_class: str | None = None
    role: str | None = None
    volume_id: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # The first id of the project's host id block, for a node in a user
    # namespace (linux/userns.py); None: the node runs without one.
    host_ids_first: int | None = None

    @classmethod
    def for_gpu_node(
        cls,
        spec: NodeSpec,
        *,
        kind: NodeKind,
        address: str,
        ns_dir: str,
        nodes_dir: str,
        userns: bool = False,
    ) -> NodeRecord:
        """The record of a GPU node asked for by ``spec`` (made here, or on
        another host: ``kind="remote"``)."""
        return cls(
            node_id=spec.node_id,
            kind=kind,
            name=spec.name,
            hostname=spec.name,
            cluster_id=spec.cluster_id,
            cluster_name=spec.cluster_name,
            host=spec.host,
            gpu_type=spec.gpu_type,
            compute_class=spec.compute_class,
            volume_id=spec.volume_id,
            labels=dict(spec.labels),
            address=address,
            ns_dir=ns_dir,
            nodes_dir=nodes_dir,
            host_ids_first=spec.host_ids.first if userns and spec.host_ids else None,
        )

    @property
    def layout(self) -> NodeLayout:
        return NodeLayout(
            self.node_id,
            Path(self.ns_dir),
            Path(self.nodes_dir),
            userns=self.host_ids_first is not None,
        )

    def node_info(self) -> dict[str, Any]:
        """The node's /etc/gpuclusters/node.json."""
        info: dict[str, Any] = {
            "node_id": self.node_id,
            "name": self.name,
            "cluster_id": self.cluster_id,
            "cluster_name": self.cluster_name,
            "compute_class": self.compute_class,
            "gpu_type": self.gpu_type,
            "host": self.host,
            "address": self.address,
        }
        if self.role is not None:
            info["role"] = self.role
        return info


@dataclass(slots=True)
class GatewayForward:
    """A gateway port of the cluster (see ``linux.firewall``)."""

    public_port: int
    address: str
    port: int


@dataclass(slots=True)
class ClusterNetwork:
    cluster_id: str
    index: int
    bridge: str
    # Reaching out through NAT on the host, and the gateway's ports by name
    # ("ssh", "kubernetes"); the firewall is rebuilt from these after a
    # host reboot.
    egress: bool = False
    forwards: dict[str, GatewayForward] = field(default_factory=dict)
    # A cluster that spans hosts: its VXLAN segment (VNI, this host's
    # underlay address, the other hosts' underlay addresses), the segment's
    # MTU, and the names of the cluster's nodes on other hosts (for
    # /etc/hosts). None/empty for a cluster that lives on one host only.
    vni: int | None = None
    local: str | None = None
    peers: list[str] = field(default_factory=list)
    mtu: int | None = None
    names: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterNetwork:
        forwards = {k: GatewayForward(**v) for k, v in data.pop("forwards", {}).items()}
        return cls(**data, forwards=forwards)


class StateError(RuntimeError):
    pass


@dataclass(slots=True)
class ProviderState:
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    networks: dict[str, ClusterNetwork] = field(default_factory=dict)

    # -- persistence (blocking: call through asyncio.to_thread) -------------

    @classmethod
    def load(cls, path: Path) -> ProviderState:
        try:
            data: Any = json.loads(path.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            raise StateError(f"cannot read {path}: {exc}") from exc
        if data.get("version") != VERSION:
            raise StateError(f"{path}: unsupported version {data.get('version')!r}")
        return cls(
            nodes={k: NodeRecord(**v) for k, v in data.get("nodes", {}).items()},
            networks={
                k: ClusterNetwork.from_json(dict(v)) for k, v in data.get("networks", {}).items()
            },
        )

    def save(self, path: Path) -> None:
        data = {
            "version": VERSION,
            "nodes": {k: asdict(v) for k, v in sorted(self.nodes.items())},
            "networks": {k: asdict(v) for k, v in sorted(self.networks.items())},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".netns-provider.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    # -- queries ------------------------------------------------------------

    def members(self, cluster_id: str) -> list[NodeRecord]:
        return [r for r in self.nodes.values() if r.cluster_id == cluster_id]

    def adopt_network(self, cluster_id: str, index: int) -> ClusterNetwork:
        """The cluster's network at the index the control plane chose (a host
        agent's side of a cluster that spans hosts)."""
        net = self.networks.get(cluster_id)
        if net is not None:
            if net.index != index:
                raise StateError(
                    f"cluster {cluster_id} has network {net.index} here, asked for {index}"
                )
            return net
        if any(n.index == index for n in self.networks.values()):
            raise StateError(f"network index {index} is used by another cluster on this host")
        net = ClusterNetwork(cluster_id, index, layout.bridge_name(cluster_id))
        self.networks[cluster_id] = net
        return net

    def service_node(self, cluster_id: str, role: str) -> NodeRecord | None:
        for r in self.nodes.values():
            if r.kind == "service" and r.cluster_id == cluster_id and r.role == role:
                return r
        return None

    def node_on_host(self, host: str) -> NodeRecord | None:
        for r in self.nodes.values():
            if r.kind in ("gpu", "remote") and r.host == host:
                return r
        return None

    def prefix_clash(self, node_id: str) -> NodeRecord | None:
        """Another node whose interface or netns name would be the same."""
        probe = NodeLayout(node_id, Path("/"), Path("/"))
        for r in self.nodes.values():
            if r.node_id != node_id and (
                r.layout.veth == probe.veth or r.layout.netns == probe.netns
            ):
                return r
        return None

    # -- allocation ---------------------------------------------------------

    def allocate_network(self, cluster_id: str, *, taken: set[int]) -> ClusterNetwork | None:
        """The cluster's network, allocating the lowest free index not in
        ``taken`` (indexes the host already uses) if it has none. None when
        all 256 are in use."""
        net = self.networks.get(cluster_id)
        if net is not None:
            return net
        used = taken | {n.index for n in self.networks.values()}
        bridge = layout.bridge_name(cluster_id)
        if any(n.bridge == bridge for n in self.networks.values()):
            raise StateError(f"cluster {cluster_id}: bridge name {bridge} already in use")
        for index in range(256):
            if index not in used:
                net = ClusterNetwork(cluster_id, index, bridge)
                self.networks[cluster_id] = net
                return net
        return None

    def allocate_address(self, cluster_id: str) -> str | None:
        """The lowest free node address of the cluster (.10 upward)."""
        net = self.networks[cluster_id]
        used = {r.address for r in self.members(cluster_id)}
        for host_part in range(layout.FIRST_NODE_HOST, layout.LAST_NODE_HOST + 1):
            address = layout.node_address(net.index, host_part)
            if address not in used:
                return address
        return None


@contextlib.asynccontextmanager
async def host_lock(path: Path) -> AsyncIterator[None]:
    """An exclusive flock on ``path``, for what several servers on one host
    share: the 10.231.0.0/16 pool and the bridges made from it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = await asyncio.to_thread(os.open, path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
