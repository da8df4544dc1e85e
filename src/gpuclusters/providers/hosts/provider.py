"""Nodes on many machines: the embedded fleet's provider, extended with
hosts that run a host agent (docs/hosts.md).

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
(``_sync_segments``). Every bridge carries the same gateway address and MAC
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
from typing import Protocol

from gpuclusters.core.nodeshell import GatewayTarget, NodeShell
from gpuclusters.providers.base import (
    Instance,
    InstanceState,
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


class HostsNodeProvider(NetnsNodeProvider):
    name = "hosts"

    def __init__(
        self,
        config: NetnsProviderConfig,
        *,
        directory: HostDirectory,
        ctx: ssl.SSLContext | None,
        underlay_address: str,
    ) -> None:
        super().__init__(config)
        self._directory = directory
        self._ctx = ctx
        self._underlay = underlay_address
        self._clients: dict[HostEndpoint, AgentClient] = {}
        # Hosts that missed a segment update, by cluster (retried).
        self._stale: set[tuple[str, str]] = set()
        # Where list_instances last saw instances no record of ours names
        # (orphans housekeeping will ask us to delete).
        self._seen: dict[str, str] = {}
        # What a node's shell needs (hostname, address, how to enter it, its
        # host's Python) never changes in its life: asked once, not at every
        # shell() (the access sync alone asks for every node every 15 s).
        self._shell_info: dict[str, wire.ShellInfo] = {}

    # -- plumbing --------------------------------------------------------------

    def _is_remote(self, rec: NodeRecord | None) -> bool:
        return rec is not None and rec.kind == "remote"

    async def _client(self, host: str) -> AgentClient:
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

    def _vni(self, index: int) -> int:
        return VNI_BASE + index

    # -- segments --------------------------------------------------------------

    async def _sync_segments(
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
        hosts = sorted({r.host for r in members if self._is_remote(r) and r.host})
        if must is not None and must not in hosts:
            hosts.append(must)
        clients = {h: await self._client(h) for h in hosts}
        underlay = sorted({self._underlay} | {c.address for c in clients.values()})
        mtu = net.mtu or DEFAULT_SEGMENT_MTU
        vni = self._vni(net.index)
        await self._segment(
            state,
            cluster_id=cluster_id,
            index=None,
            vni=vni,
            local=self._underlay,
            peers=set(underlay) - {self._underlay},
            mtu=mtu,
            names={},
            egress=None,
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

    async def _retry_stale(self, state: ProviderState) -> None:
        for cluster_id in sorted({c for c, _ in self._stale}):
            async with self._cluster_lock(cluster_id):
                try:
                    await self._sync_segments(state, cluster_id)
                except ProviderError as exc:
                    log.warning("cluster %s: segments not in sync yet: %s", cluster_id, exc)

    # -- NodeProvider ------------------------------------------------------------

    async def create(self, spec: NodeSpec) -> Instance:
        if spec.host in self._hosts:
            return await super().create(spec)
        client = await self._client(spec.host)
        state = await self._loaded()
        async with self._cluster_lock(spec.cluster_id):
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
                    userns=self._cfg.userns,
                )
                self._validated(state, rec)
                await self._place(state, rec)
            elif not self._is_remote(rec) or rec.host != spec.host:
                raise PermanentProviderError(f"node {spec.node_id} exists on another host")
            await self._sync_segments(state, spec.cluster_id, must=spec.host)
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

    async def status(self, node_id: str) -> Instance:
        state = await self._loaded()
        rec = state.nodes.get(node_id)
        if rec is None or not self._is_remote(rec):
            return await super().status(node_id)
        assert rec.host is not None
        return _instance(await (await self._client(rec.host)).node(node_id))

    async def delete(self, node_id: str) -> None:
        state = await self._loaded()
        rec = state.nodes.get(node_id)
        if rec is None and node_id in self._seen:
            # An orphan on a host (no record of ours): delete it there.
            await (await self._client(self._seen[node_id])).delete_node(node_id)
            self._seen.pop(node_id, None)
            return
        if rec is None or not self._is_remote(rec):
            await super().delete(node_id)
            return
        assert rec.host is not None
        # The host first (an unreachable host raises: the node stays ours,
        # and the delete is tried again), then our record, then the peers.
        client = await self._client(rec.host)
        await client.delete_node(node_id)
        self._shell_info.pop(node_id, None)
        async with self._cluster_lock(rec.cluster_id):
            if node_id not in state.nodes:
                return
            await self._forget(state, [node_id], rec.cluster_id)
            if not any(
                self._is_remote(r) and r.host == rec.host for r in state.members(rec.cluster_id)
            ):
                try:
                    await client.delete_segment(rec.cluster_id)
                except ProviderError as exc:
                    log.warning(
                        "host %s keeps cluster %s's segment: %s", rec.host, rec.cluster_id, exc
                    )
            await self._sync_segments(state, rec.cluster_id)

    async def _restart(self, node_id: str, *, reprovision: bool) -> Instance:
        state = await self._loaded()
        rec = state.nodes.get(node_id)
        if rec is None or not self._is_remote(rec):
            return await super()._restart(node_id, reprovision=reprovision)
        assert rec.host is not None
        return _instance(
            await (await self._client(rec.host)).restart(node_id, reprovision=reprovision)
        )

    async def list_instances(self) -> list[Instance]:
        state = await self._loaded()
        await self._retry_stale(state)
        local = await super().list_instances()
        found: list[Instance] = list(local)
        seen: dict[str, str] = {}
        for ep in await self._directory.endpoints():
            try:
                outs = await (await self._client(ep.name)).nodes()
            except ProviderError as exc:
                # A silent host lists nothing, so nothing of it is taken
                # for an orphan (or for lost).
                log.info("host %s: instances not listed: %s", ep.name, exc)
                continue
            for out in outs:
                found.append(_instance(out))
                if out.node_id not in state.nodes:
                    seen[out.node_id] = ep.name
        self._seen = seen
        return sorted(found, key=lambda i: i.node_id)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients.values()))
        self._clients.clear()
        await super().close()

    # -- NodeAccess --------------------------------------------------------------

    async def shell(self, node_id: str) -> NodeShell:
        state = await self._loaded()
        rec = state.nodes.get(node_id)
        if rec is None or not self._is_remote(rec):
            return await super().shell(node_id)
        assert rec.host is not None
        client = await self._client(rec.host)
        info = self._shell_info.get(node_id)
        if info is None:
            # The agent answers only for a booted node, so a cached answer
            # is never one for a half-made node.
            info = self._shell_info[node_id] = await client.shell_info(node_id)
        return RemoteShell(
            client,
            node_id,
            hostname=info.hostname,
            address=info.address,
            enter=info.enter,
            python=info.python,
        )

    async def ensure_gateway(
        self, *, cluster_id: str, egress: bool, forwards: Mapping[str, GatewayTarget]
    ) -> None:
        await super().ensure_gateway(cluster_id=cluster_id, egress=egress, forwards=forwards)
        state = await self._loaded()
        if any(self._is_remote(r) for r in state.members(cluster_id)):
            async with self._cluster_lock(cluster_id):
                await self._sync_segments(state, cluster_id)  # egress on the hosts too


class EmbeddedFleetProvider(HostsNodeProvider):
    """``--provider netns``: the fleet file's hosts on this machine, and
    hosts with agents alongside them."""

    name = "netns"
