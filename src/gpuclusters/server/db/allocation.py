"""Turning a placement decision into node rows.

Counts the free hosts per InfiniBand island in the database, asks the pure
``plan_islands`` how many nodes go where, fetches just those hosts (the
first free ones by name in each island) and adds node rows in the caller's
transaction. Nothing here loads the fleet: a request costs a few indexed
queries whether the fleet has ten hosts or ten thousand. The partial unique index on
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
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from sqlalchemy import ColumnElement, and_, exists, func, or_, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.autoscale import free_slots, slot_names
from gpuclusters.core.capacity.placement import HostSlot, describe_counts, plan_islands
from gpuclusters.core.capacity.preemption import PreemptibleNode, choose_victims
from gpuclusters.core.deadlines import NODE_PHASE_DEADLINES_S, deadline_at
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


def host_is_free() -> ColumnElement[bool]:
    """SQL: the host takes a new node: in the fleet, available, its agent
    (if any) heartbeating, and no live node holds it or awaits it."""
    held = exists().where(Node.host_id == Host.id, Node.deleted_at.is_(None))
    awaited = exists().where(Node.awaited_host_id == Host.id, Node.deleted_at.is_(None))
    return and_(
        Host.in_fleet.is_(True),
        Host.state == HostState.AVAILABLE.value,
        # A host agent that is not heartbeating gets nothing new.
        or_(Host.agent_status.is_(None), Host.agent_status == HostAgentStatus.READY.value),
        ~held,
        ~awaited,
    )


async def host_slots(session: AsyncSession) -> tuple[list[HostSlot], dict[str, Host]]:
    """Every host of the fleet with whether it is free (the fleet page and
    tests; the hot paths count in the database instead)."""
    hosts = list(await session.scalars(select(Host).where(Host.in_fleet.is_(True))))
    free = set(await session.scalars(select(Host.id).where(host_is_free())))
    slots = [
        HostSlot(
            name=h.name,
            gpu_type=h.gpu_type,
            region=h.region,
            ib_island=h.ib_island,
            free=h.id in free,
        )
        for h in hosts
    ]
    return slots, {h.name: h for h in hosts}


async def free_counts(session: AsyncSession) -> Counter[tuple[str, str]]:
    """Free hosts by (GPU type, region)."""
    rows = await session.execute(
        select(Host.gpu_type, Host.region, func.count())
        .where(host_is_free())
        .group_by(Host.gpu_type, Host.region)
    )
    return Counter({(g, r): int(n) for g, r, n in rows})


async def free_by_island(session: AsyncSession, *, gpu_type: str, region: str) -> dict[str, int]:
    rows = await session.execute(
        select(Host.ib_island, func.count())
        .where(Host.gpu_type == gpu_type, Host.region == region, host_is_free())
        .group_by(Host.ib_island)
    )
    return {island: int(n) for island, n in rows}


async def choose_free_hosts(
    session: AsyncSession,
    *,
    count: int,
    gpu_type: str,
    region: str,
    used_islands: list[str],
    free: dict[str, int] | None = None,
) -> list[tuple[str, str]]:
    """``count`` free hosts (id, name) placed by the island rule, or raise
    ``CapacityUnavailableError`` (saying what is free) if there are fewer."""
    if count <= 0:
        return []
    if free is None:
        free = await free_by_island(session, gpu_type=gpu_type, region=region)
    if sum(free.values()) < count:
        raise CapacityUnavailableError(
            f"not enough free {gpu_type} hosts in region {region}: need {count} "
            f"node(s) of 8 GPUs, {sum(free.values())} free "
            f"({describe_counts(await free_counts(session))})",
            field="num_gpus",
        )
    chosen: list[tuple[str, str]] = []
    for island, n in plan_islands(free, count, used_islands):
        rows = await session.execute(
            select(Host.id, Host.name)
            .where(
                Host.gpu_type == gpu_type,
                Host.region == region,
                Host.ib_island == island,
                host_is_free(),
            )
            .order_by(Host.name)
            .limit(n)
        )
        chosen += [(host_id, name) for host_id, name in rows]
    return chosen


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
    return (await free_counts(session))[(cluster.gpu_type, cluster.region)]


async def allocate_nodes(
    session: AsyncSession,
    *,
    cluster: Cluster,
    count: int,
    compute_class: str,
    work: WorkProbe | None = None,
    deadlines: Mapping[str, float] | None = None,
    slots: list[str] | None = None,
) -> list[Node]:
    """Place ``count`` new nodes for the cluster and add their rows (pending,
    with the pending phase's deadline from ``deadlines``: settings'
    node_phase_deadlines_s, else the defaults).

    Standard nodes reclaim hosts from preemptible nodes when free hosts are
    not enough (``work`` tells how busy each candidate is). Raises
    ``CapacityUnavailableError`` (placing none) if they still do not fit."""
    if count <= 0:
        return []
    free = await free_by_island(session, gpu_type=cluster.gpu_type, region=cluster.region)
    n_free = sum(free.values())
    used_islands = await _used_islands(session, cluster)
    victims: list[PreemptibleNode] = []
    if compute_class == ComputeClass.STANDARD.value:
        # Other projects' reserved capacity they do not use yet is not ours
        # to take (it may still serve preemptible nodes: that is reclaimed).
        hold = await held_back_for(session, cluster=cluster, at=utcnow())
        candidates: list[PreemptibleNode] = []
        if count > n_free - hold:
            preemptible = await _preemptible_nodes(session, work)
            candidates = choose_victims(
                preemptible,
                count=len(preemptible),
                gpu_type=cluster.gpu_type,
                region=cluster.region,
                used_islands=used_islands,
            )
        if count > n_free + len(candidates) - hold:
            held = f", {hold} held for other projects' reservations" if hold else ""
            raise CapacityUnavailableError(
                f"not enough {cluster.gpu_type} hosts in region {cluster.region}: need {count} "
                f"node(s) of 8 GPUs, {n_free} free and {len(candidates)} held by preemptible "
                f"nodes that could be reclaimed{held} "
                f"({describe_counts(await free_counts(session))})",
                field="num_gpus",
            )
        victims = candidates[: max(0, count - n_free)]
    chosen = await choose_free_hosts(
        session,
        count=count - len(victims),
        gpu_type=cluster.gpu_type,
        region=cluster.region,
        used_islands=used_islands,
        free=free,
    )
    now = utcnow()
    pending_deadline = deadline_at(
        NODE_PHASE_DEADLINES_S if deadlines is None else deadlines, NodePhase.PENDING.value, now
    )
    nodes = [
        Node(
            cluster_id=cluster.id,
            project_id=cluster.project_id,
            name=node_name(cluster.name, compute_class),
            host_id=host_id,
            compute_class=compute_class,
            phase=NodePhase.PENDING.value,
            phase_changed_at=now,
            phase_deadline_at=pending_deadline,
        )
        for host_id, _ in chosen
    ]
    victim_hosts = (
        {
            name: host_id
            for host_id, name in await session.execute(
                select(Host.id, Host.name).where(Host.name.in_([v.host for v in victims]))
            )
        }
        if victims
        else {}
    )
    for victim in victims:
        host_id = victim_hosts[victim.host]
        nodes.append(
            Node(
                cluster_id=cluster.id,
                project_id=cluster.project_id,
                name=node_name(cluster.name, compute_class),
                awaited_host_id=host_id,
                compute_class=compute_class,
                phase=NodePhase.PENDING.value,
                phase_changed_at=now,
                phase_deadline_at=pending_deadline,
                message=f"waiting for host {victim.host}: preemptible node {victim.name} "
                "is giving it back",
            )
        )
        await mark_preempted(session, host_id=host_id, why=f"host needed by cluster {cluster.name}")
    if cluster.autoscale_max_gpus is not None and compute_class == ComputeClass.STANDARD.value:
        await _give_slots(session, cluster, nodes, slots)
    session.add_all(nodes)
    return nodes


async def _give_slots(
    session: AsyncSession, cluster: Cluster, nodes: list[Node], wanted: list[str] | None
) -> None:
    """Every standard node of an autoscaled cluster holds a slot: the ones
    the scheduler asked for, else the first free ones (a slot stays held
    until its node is deleted)."""
    with session.no_autoflush:
        taken = await session.scalars(
            select(Node.slot).where(Node.cluster_id == cluster.id, Node.deleted_at.is_(None))
        )
        all_slots = slot_names(cluster.name, cluster.autoscale_max_gpus or 0)
        free = [s for s in free_slots(all_slots, taken, len(all_slots))]
    chosen = [s for s in (wanted or []) if s in free]
    chosen += [s for s in free if s not in chosen]
    if len(chosen) < len(nodes):
        raise CapacityUnavailableError(
            f"cluster {cluster.name}: autoscaling's max_gpus "
            f"({cluster.autoscale_max_gpus}) has no free slot left",
            field="autoscaling.max_gpus",
        )
    for node, slot in zip(nodes, chosen, strict=False):
        node.slot = slot


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
