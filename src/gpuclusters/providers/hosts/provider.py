"""Nodes on many machines: the embedded fleet's provider and hosts that run
a host agent (docs/hosts.md), composed: ``HostsNodeProvider`` routes each
node to the ``NetnsNodeProvider`` of this machine or to ``AgentNodes`` (its
host's agent), and ``AgentNodes`` changes this machine's records only
through the netns provider's public record interface.

The server's machine keeps what it had: service nodes (a cluster's
controller, login and Kubernetes control-plane nodes), the gateway's
firewall, the fleet file's hosts (if any), and the bookkeeping of every
cluster network (its /24, each node's address and name). A GPU node placed
on a host with an agent is a ``remote`` record here (address and name,
written before anything is asked of the host: intent first) and a real
node there, made by the host's own ``NetnsNodeProvider`` through its
agent's API (``agent_client.py``).

One cluster, one L2 segment: every machine with a node of the cluster has
the cluster's bridge, and the bridges are joined by a VXLAN device per
cluster (VNI ``VNI_BASE + network index``) whose static all-zeros forwarding
entries name the other machines' underlay addresses; the control plane
rewrites them on every machine whenever a host joins or leaves the cluster
(``AgentNodes.sync_segments``). Every bridge carries the same gateway address and MAC
(an anycast gateway), so each node leaves through its own host. Two clusters
share no bridge and no VNI, and hosts route nothing between bridges.

Failure rules (fail closed): a host that cannot be reached makes calls for
its nodes raise ``ProviderError`` (retry later); nothing is reported
MISSING or deleted because a host is silent. A peer that misses a segment
update is retried by the next housekeeping pass (``list_instances``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from gpuclusters.core.idblocks import IdBlock
from gpuclusters.core.nodeshell import GatewayTarget, NodeAccess, NodeShell
from gpuclusters.providers.base import (
    HostSpec,
    Instance,
    InstanceState,
    NodeProvider,
    NodeSpec,
    PermanentProviderError,
    ProviderError,
)
from gpuclusters.providers.hosts import wire
from gpuclusters.providers.hosts.agent_client import AgentClient
from gpuclusters.providers.hosts.shell import RemoteShell
from gpuclusters.providers.netns.config import NetnsProviderConfig
from gpuclusters.providers.netns.provider import NetnsNodeProvider
from gpuclusters.providers.netns.state import NodeRecord, ProviderState

log = logging.getLogger(__name__)

VNI_BASE = 0x10000
DEFAULT_SEGMENT_MTU = 1450  # a 1500-byte underlay minus VXLAN's 50 bytes


@dataclass(frozen=True, slots=True)
class HostEndpoint:
    """Where a host's agent listens (its underlay address: also its VTEP)."""

    name: str
    address: str
    port: int


class HostDirectory(Protocol):
    """The hosts with agents, as the server's database knows them."""

    async def endpoint(self, name: str) -> HostEndpoint | None:
        """The host's agent; None for a host without one (or not known)."""

    async def endpoints(self) -> list[HostEndpoint]:
        """Every host whose agent may hold nodes (joined and not removed)."""


def _instance(out: wire.InstanceOut) -> Instance:
    return Instance(
        node_id=out.node_id, host=out.host, state=InstanceState(out.state), message=out.message
    )


class AgentNodes:
    """The nodes on hosts with agents: each is asked of its host's agent;
    its record (address, name) and its cluster's network are ``fleet``'s,
    changed through that provider's public record interface under the
    cluster's lock."""

    def __init__(
        self,
        fleet: NetnsNodeProvider,
        *,
        directory: HostDirectory,
        ctx: ssl.SSLContext | None,
        underlay_address: str,
    ) -> None:
        self._fleet = fleet
        self._directory = directory
        self._ctx = ctx
        self._underlay = underlay_address
        self._clients: dict[HostEndpoint, AgentClient] = {}
        # Hosts that missed a segment update, by cluster (retried).
        self._stale: set[tuple[str, str]] = set()
        # Where ``instances`` last saw instances no record names (orphans
        # housekeeping will ask to delete), by node id.
        self.seen: dict[str, str] = {}
        # What a node's shell needs (hostname, address, how to enter it, its
        # host's Python) never changes in its life: asked once, not at every
        # shell() (the access sync alone asks for every node every 15 s).
        self._shell_info: dict[str, wire.ShellInfo] = {}

    async def client(self, host: str) -> AgentClient:
        ep = await self._directory.endpoint(host)
        if ep is None:
            raise PermanentProviderError(f"host {host!r} has no host agent")
        if self._ctx is None:
            raise PermanentProviderError("this server has no credentials for host agents")
        client = self._clients.get(ep)
        if client is None:
            client = AgentClient(host=ep.name, address=ep.address, port=ep.port, ctx=self._ctx)
            self._clients[ep] = client
        return client

    # -- segments --------------------------------------------------------------

    async def sync_segments(
        self, state: ProviderState, cluster_id: str, *, must: str | None = None
    ) -> None:
        """Every machine of the cluster on its segment, with the current
        peers and names (cluster lock held). ``must``: the host whose update
        has to succeed (the one about to get a node); the others are
        retried later if they fail."""
        net = state.networks.get(cluster_id)
        if net is None:  # the cluster is gone here: nothing left to sync
            self._stale = {(c, h) for c, h in self._stale if c != cluster_id}
            return
        members = state.members(cluster_id)
        hosts = sorted({r.host for r in members if is_remote(r) and r.host})
        if must is not None and must not in hosts:
            hosts.append(must)
        clients = {h: await self.client(h) for h in hosts}
        underlay = sorted({self._underlay} | {c.address for c in clients.values()})
        mtu = net.mtu or DEFAULT_SEGMENT_MTU
        vni = VNI_BASE + net.index
        await self._fleet.join_segment(
            state,
            cluster_id=cluster_id,
            vni=vni,
            local=self._underlay,
            peers=set(underlay) - {self._underlay},
            mtu=mtu,
        )
        segment = wire.Segment(
            index=net.index,
            vni=vni,
            peers=underlay,
            mtu=mtu,
            names={r.hostname: r.address for r in members},
            egress=net.egress,
        )
        for host, client in clients.items():
            try:
                await client.put_segment(cluster_id, segment)
                self._stale.discard((cluster_id, host))
            except ProviderError as exc:
                if host == must:
                    raise
                log.warning(
                    "cluster %s: host %s missed a segment update: %s", cluster_id, host, exc
                )
                self._stale.add((cluster_id, host))

    async def retry_stale(self, state: ProviderState) -> None:
        for cluster_id in sorted({c for c, _ in self._stale}):
            async with self._fleet.cluster_lock(cluster_id):
                try:
                    await self.sync_segments(state, cluster_id)
                except ProviderError as exc:
                    log.warning("cluster %s: segments not in sync yet: %s", cluster_id, exc)

    # -- nodes -------------------------------------------------------------------

    async def create(self, spec: NodeSpec) -> Instance:
        client = await self.client(spec.host)
        state = await self._fleet.records()
        async with self._fleet.cluster_lock(spec.cluster_id):
            rec = state.nodes.get(spec.node_id)
            if rec is None:
                taken = state.node_on_host(spec.host)
                if taken is not None:
                    raise PermanentProviderError(f"host {spec.host} already runs node {taken.name}")
                # Its namespaces are the host's: no directories here.
                rec = NodeRecord.for_gpu_node(
                    spec,
                    kind="remote",
                    address="",
                    ns_dir="",
                    nodes_dir="",
                    userns=self._fleet.userns,
                )
                await self._fleet.add_remote_record(state, rec)
            elif not is_remote(rec) or rec.host != spec.host:
                raise PermanentProviderError(f"node {spec.node_id} exists on another host")
            await self.sync_segments(state, spec.cluster_id, must=spec.host)
        out = await client.put_node(
            spec.node_id,
            wire.NodeCreate(
                name=rec.name,
                cluster_id=rec.cluster_id,
                cluster_name=rec.cluster_name,
                gpu_type=spec.gpu_type,
                compute_class=spec.compute_class,
                address=rec.address,
                volume_id=spec.volume_id,
                labels=dict(spec.labels),
                # The host's agent makes the node in a user namespace of
                # this block; without one (user namespaces off), none.
                host_ids_first=rec.host_ids_first,
            ),
        )
        return _instance(out)

    async def status(self, rec: NodeRecord) -> Instance:
        assert rec.host is not None
        return _instance(await (await self.client(rec.host)).node(rec.node_id))

    async def delete_orphan(self, node_id: str) -> None:
        """An instance on a host that no record names: delete it there."""
        await (await self.client(self.seen[node_id])).delete_node(node_id)
        self.seen.pop(node_id, None)

    async def delete(self, state: ProviderState, rec: NodeRecord) -> None:
        assert rec.host is not None
        # The host first (an unreachable host raises: the node stays ours,
        # and the delete is tried again), then our record, then the peers.
        client = await self.client(rec.host)
        await client.delete_node(rec.node_id)
        self._shell_info.pop(rec.node_id, None)
        async with self._fleet.cluster_lock(rec.cluster_id):
            if rec.node_id not in state.nodes:
                return
            await self._fleet.forget_records(state, [rec.node_id], rec.cluster_id)
            if not any(is_remote(r) and r.host == rec.host for r in state.members(rec.cluster_id)):
                try:
                    await client.delete_segment(rec.cluster_id)
                except ProviderError as exc:
                    log.warning(
                        "host %s keeps cluster %s's segment: %s", rec.host, rec.cluster_id, exc
                    )
            await self.sync_segments(state, rec.cluster_id)

    async def restart(self, rec: NodeRecord, *, reprovision: bool) -> Instance:
        assert rec.host is not None
        client = await self.client(rec.host)
        return _instance(await client.restart(rec.node_id, reprovision=reprovision))

    async def instances(self, state: ProviderState) -> list[Instance]:
        """Every instance the reachable hosts hold; those no record names
        are remembered in ``seen``."""
        found: list[Instance] = []
        seen: dict[str, str] = {}
        for ep in await self._directory.endpoints():
            try:
                outs = await (await self.client(ep.name)).nodes()
            except ProviderError as exc:
                # A silent host lists nothing, so nothing of it is taken
                # for an orphan (or for lost).
                log.info("host %s: instances not listed: %s", ep.name, exc)
                continue
            for out in outs:
                found.append(_instance(out))
                if out.node_id not in state.nodes:
                    seen[out.node_id] = ep.name
        self.seen = seen
        return found

    async def shell(self, rec: NodeRecord) -> NodeShell:
        assert rec.host is not None
        client = await self.client(rec.host)
        info = self._shell_info.get(rec.node_id)
        if info is None:
            # The agent answers only for a booted node, so a cached answer
            # is never one for a half-made node.
            info = self._shell_info[rec.node_id] = await client.shell_info(rec.node_id)
        return RemoteShell(
            client,
            rec.node_id,
            hostname=info.hostname,
            address=info.address,
            enter=info.enter,
            python=info.python,
        )

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients.values()))
        self._clients.clear()


def is_remote(rec: NodeRecord | None) -> bool:
    return rec is not None and rec.kind == "remote"


class HostsNodeProvider(NodeProvider):
    """One provider that routes each node: to ``local`` (this machine's
    namespaces: the fleet file's hosts, and every service node) or to
    ``agents`` (a host with an agent), by where the node is placed and, once
    made, by its record's kind."""

    name: ClassVar[str] = "hosts"

    def __init__(
        self,
        config: NetnsProviderConfig,
        *,
        directory: HostDirectory,
        ctx: ssl.SSLContext | None,
        underlay_address: str,
    ) -> None:
        self.local = NetnsNodeProvider(config)
        self.agents = AgentNodes(
            self.local, directory=directory, ctx=ctx, underlay_address=underlay_address
        )

    async def _remote(self, node_id: str) -> NodeRecord | None:
        """The node's record if it is on a host with an agent."""
        rec = (await self.local.records()).nodes.get(node_id)
        return rec if is_remote(rec) else None

    # -- NodeProvider ------------------------------------------------------------

    async def hosts(self) -> list[HostSpec]:
        return await self.local.hosts()  # hosts with agents come from the database

    async def create(self, spec: NodeSpec) -> Instance:
        if self.local.is_local_host(spec.host):
            return await self.local.create(spec)
        return await self.agents.create(spec)

    async def status(self, node_id: str) -> Instance:
        rec = await self._remote(node_id)
        return await (self.local.status(node_id) if rec is None else self.agents.status(rec))

    async def delete(self, node_id: str) -> None:
        state = await self.local.records()
        rec = state.nodes.get(node_id)
        if rec is None and node_id in self.agents.seen:
            await self.agents.delete_orphan(node_id)
        elif is_remote(rec):
            assert rec is not None
            await self.agents.delete(state, rec)
        else:
            await self.local.delete(node_id)

    async def reboot(self, node_id: str) -> Instance:
        rec = await self._remote(node_id)
        if rec is None:
            return await self.local.reboot(node_id)
        return await self.agents.restart(rec, reprovision=False)

    async def reprovision(self, node_id: str) -> Instance:
        rec = await self._remote(node_id)
        if rec is None:
            return await self.local.reprovision(node_id)
        return await self.agents.restart(rec, reprovision=True)

    async def list_instances(self) -> list[Instance]:
        state = await self.local.records()
        await self.agents.retry_stale(state)
        found = [*await self.local.list_instances(), *await self.agents.instances(state)]
        return sorted(found, key=lambda i: i.node_id)

    async def close(self) -> None:
        await self.agents.close()
        await self.local.close()

    # -- NodeAccess --------------------------------------------------------------

    async def shell(self, node_id: str) -> NodeShell:
        rec = await self._remote(node_id)
        return await (self.local.shell(node_id) if rec is None else self.agents.shell(rec))

    async def ensure_service_node(
        self,
        *,
        cluster_id: str,
        cluster_name: str,
        role: str,
        volume_id: str | None,
        host_ids: IdBlock | None = None,
    ) -> NodeShell:
        # Service nodes always run on this machine.
        return await self.local.ensure_service_node(
            cluster_id=cluster_id,
            cluster_name=cluster_name,
            role=role,
            volume_id=volume_id,
            host_ids=host_ids,
        )

    async def delete_service_nodes(self, *, cluster_id: str) -> None:
        await self.local.delete_service_nodes(cluster_id=cluster_id)

    async def ensure_gateway(
        self, *, cluster_id: str, egress: bool, forwards: Mapping[str, GatewayTarget]
    ) -> None:
        await self.local.ensure_gateway(cluster_id=cluster_id, egress=egress, forwards=forwards)
        state = await self.local.records()
        if any(is_remote(r) for r in state.members(cluster_id)):
            async with self.local.cluster_lock(cluster_id):
                await self.agents.sync_segments(state, cluster_id)  # egress on the hosts too


def _static_checks(p: HostsNodeProvider) -> NodeAccess:
    # mypy verifies here that the provider satisfies the NodeAccess protocol.
    return p


class EmbeddedFleetProvider(HostsNodeProvider):
    """``--provider netns``: the fleet file's hosts on this machine, and
    hosts with agents alongside them."""

    name = "netns"
