"""Turning a placement decision into node rows.

Reads the fleet and live nodes, asks the pure ``place_nodes`` for hosts and
adds node rows in the caller's transaction. The partial unique index on
``nodes.host_id`` is the last word: if a concurrent request took a host in
the meantime the commit fails and the caller retries with a fresh view.

Standard nodes may take hosts that preemptible nodes hold (spare capacity
is lent, not given): when free hosts are not enough, the pure
``choose_victims`` picks preemptible nodes to preempt, each is marked for
preemption and the new standard node *awaits* its host (``awaited_host_id``)
until the node reconciler has released it. A host is free only when no live
node holds it and no node awaits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import string
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.capacity.placement import HostSlot, describe_free, free_hosts, place_nodes
from gpuclusters.core.capacity.preemption import PreemptibleNode, choose_victims
from gpuclusters.core.enums import ComputeClass, HostAgentStatus, HostState, NodePhase
from gpuclusters.core.errors import CapacityUnavailableError
from gpuclusters.server.db.capacity import held_back_for
from gpuclusters.server.db.models import Cluster, Host, Node, utcnow

_ALPHABET = string.ascii_lowercase + string.digits
PREEMPTED = "preempted"  # Node.delete_reason of a node giving its host back

# How much work runs on a node (jobs, pods), asked of its cluster's layer
# when choosing which preemptible node to preempt.
WorkProbe = Callable[[Node], Awaitable[int]]
PLACEMENT_LOCK_KEY = zlib.crc32(b"gpuclusters.placement")


@contextlib.asynccontextmanager
async def placement_guard(session: AsyncSession, lock: asyncio.Lock) -> AsyncIterator[None]:
    """Serialise placement decisions, so concurrent creates do not all pick
    the same free hosts: within this process with ``lock``; across server
    processes on PostgreSQL with a transaction-scoped advisory lock, released
    when the caller commits or rolls back. (SQLite serialises writers itself;
    the unique index on live hosts stays the last word everywhere.)"""
    async with lock:
        if session.get_bind().dialect.name == "postgresql":
            await session.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": PLACEMENT_LOCK_KEY}
            )
        yield


def node_name(cluster_name: str, compute_class: str) -> str:
    """``<cluster>-<class>-<5 random>``: the name shows the compute class."""
    return f"{cluster_name}-{compute_class}-{''.join(secrets.choice(_ALPHABET) for _ in range(5))}"


async def host_slots(session: AsyncSession) -> tuple[list[HostSlot], dict[str, Host]]:
    hosts = list(await session.scalars(select(Host).where(Host.in_fleet.is_(True))))
    busy = set(
        await session.scalars(
            select(Node.host_id).where(Node.deleted_at.is_(None), Node.host_id.is_not(None))
        )
    ) | set(
        await session.scalars(
            select(Node.awaited_host_id).where(
                Node.deleted_at.is_(None), Node.awaited_host_id.is_not(None)
            )
        )
    )
    slots = [
        HostSlot(
            name=h.name,
            gpu_type=h.gpu_type,
            region=h.region,
            ib_island=h.ib_island,
            # A host agent that is not heartbeating gets nothing new.
            free=h.state == HostState.AVAILABLE.value
            and h.id not in busy
            and h.agent_status in (None, HostAgentStatus.READY.value),
        )
        for h in hosts
    ]
    return slots, {h.name: h for h in hosts}


async def _used_islands(session: AsyncSession, cluster: Cluster) -> list[str]:
    return list(
        await session.scalars(
            select(Host.ib_island)
            .join(Node, (Node.host_id == Host.id) | (Node.awaited_host_id == Host.id))
            .where(Node.cluster_id == cluster.id, Node.deleted_at.is_(None))
        )
    )


async def spare_hosts(session: AsyncSession, *, cluster: Cluster) -> int:
    """Free hosts that fit this cluster's nodes (for the preemptible pool)."""
    slots, _ = await host_slots(session)
    return len(free_hosts(slots, gpu_type=cluster.gpu_type, region=cluster.region))


async def allocate_nodes(
    session: AsyncSession,
    *,
    cluster: Cluster,
    count: int,
    compute_class: str,
    work: WorkProbe | None = None,
) -> list[Node]:
    """Place ``count`` new nodes for the cluster and add their rows (pending).

    Standard nodes reclaim hosts from preemptible nodes when free hosts are
    not enough (``work`` tells how busy each candidate is). Raises
    ``CapacityUnavailableError`` (placing none) if they still do not fit."""
    if count <= 0:
        return []
    slots, by_name = await host_slots(session)
    used_islands = await _used_islands(session, cluster)
    free = free_hosts(slots, gpu_type=cluster.gpu_type, region=cluster.region)
    victims: list[PreemptibleNode] = []
    if compute_class == ComputeClass.STANDARD.value:
        # Other projects' reserved capacity they do not use yet is not ours
        # to take (it may still serve preemptible nodes: that is reclaimed).
        hold = await held_back_for(session, cluster=cluster, at=utcnow())
        candidates: list[PreemptibleNode] = []
        if count > len(free) - hold:
            candidates = choose_victims(
                await _preemptible_nodes(session, work),
                count=len(by_name),
                gpu_type=cluster.gpu_type,
                region=cluster.region,
                used_islands=used_islands,
            )
        if count > len(free) + len(candidates) - hold:
            held = f", {hold} held for other projects' reservations" if hold else ""
            raise CapacityUnavailableError(
                f"not enough {cluster.gpu_type} hosts in region {cluster.region}: need {count} "
                f"node(s) of 8 GPUs, {len(free)} free and {len(candidates)} held by preemptible "
                f"nodes that could be reclaimed{held} ({describe_free(slots)})",
                field="num_gpus",
            )
        victims = candidates[: max(0, count - len(free))]
    chosen = place_nodes(
        slots,
        count=count - len(victims),
        gpu_type=cluster.gpu_type,
        region=cluster.region,
        used_islands=used_islands,
    )
    nodes = [
        Node(
            cluster_id=cluster.id,
            project_id=cluster.project_id,
            name=node_name(cluster.name, compute_class),
            host_id=by_name[slot.name].id,
            compute_class=compute_class,
            phase=NodePhase.PENDING.value,
        )
        for slot in chosen
    ]
    for victim in victims:
        host = by_name[victim.host]
        nodes.append(
            Node(
                cluster_id=cluster.id,
                project_id=cluster.project_id,
                name=node_name(cluster.name, compute_class),
                awaited_host_id=host.id,
                compute_class=compute_class,
                phase=NodePhase.PENDING.value,
                message=f"waiting for host {host.name}: preemptible node {victim.name} "
                "is giving it back",
            )
        )
        await mark_preempted(session, host_id=host.id, why=f"host needed by cluster {cluster.name}")
    session.add_all(nodes)
    return nodes


async def _preemptible_nodes(
    session: AsyncSession, work: WorkProbe | None
) -> list[PreemptibleNode]:
    """Live preemptible nodes on hosts nobody awaits yet, with their work."""
    awaited = set(
        await session.scalars(
            select(Node.awaited_host_id).where(
                Node.deleted_at.is_(None), Node.awaited_host_id.is_not(None)
            )
        )
    )
    rows = (
        await session.execute(
            select(Node, Host, Cluster)
            .join(Host, Host.id == Node.host_id)
            .join(Cluster, Cluster.id == Node.cluster_id)
            .where(
                Node.deleted_at.is_(None),
                Node.compute_class == ComputeClass.PREEMPTIBLE.value,
                Host.in_fleet.is_(True),
            )
        )
    ).all()
    out = []
    for node, host, cluster in rows:
        if host.id in awaited:
            continue
        leaving = node.to_delete
        running = node.phase in (NodePhase.RUNNING.value, NodePhase.DRAINING.value)
        busy = await work(node) if (work is not None and running and not leaving) else 0
        out.append(
            PreemptibleNode(
                name=node.name,
                host=host.name,
                gpu_type=cluster.gpu_type,
                region=cluster.region,
                ib_island=host.ib_island,
                running_work=busy,
                created_at=node.created_at,
                leaving=leaving,
            )
        )
    return out


async def mark_preempted(session: AsyncSession, *, host_id: str, why: str) -> Node | None:
    """Start the preemption protocol for the preemptible node on ``host_id``
    (the node reconciler carries it out). Idempotent; a node already going
    away for another reason keeps that reason (it leaves either way)."""
    node = await session.scalar(
        select(Node).where(
            Node.host_id == host_id,
            Node.deleted_at.is_(None),
            Node.compute_class == ComputeClass.PREEMPTIBLE.value,
        )
    )
    if node is None:
        return None
    if not node.to_delete:
        node.to_delete = True
        node.delete_reason = PREEMPTED
        node.message = why
    return node
