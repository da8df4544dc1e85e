"""Turning a placement decision into node rows.

Reads the fleet and live nodes, asks the pure ``place_nodes`` for hosts and
adds node rows in the caller's transaction. The partial unique index on
``nodes.host_id`` is the last word: if a concurrent request took a host in
the meantime the commit fails and the caller retries with a fresh view.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import string
import zlib
from collections.abc import AsyncIterator

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.capacity.placement import HostSlot, place_nodes
from gpuclusters.core.enums import HostState, NodePhase
from gpuclusters.server.db.models import Cluster, Host, Node

_ALPHABET = string.ascii_lowercase + string.digits
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
    )
    slots = [
        HostSlot(
            name=h.name,
            gpu_type=h.gpu_type,
            region=h.region,
            ib_island=h.ib_island,
            free=h.state == HostState.AVAILABLE.value and h.id not in busy,
        )
        for h in hosts
    ]
    return slots, {h.name: h for h in hosts}


async def allocate_nodes(
    session: AsyncSession, *, cluster: Cluster, count: int, compute_class: str
) -> list[Node]:
    """Place ``count`` new nodes for the cluster and add their rows (pending).
    Raises ``CapacityUnavailableError`` (placing none) if they do not fit."""
    if count <= 0:
        return []
    slots, by_name = await host_slots(session)
    used_islands = list(
        await session.scalars(
            select(Host.ib_island)
            .join(Node, Node.host_id == Host.id)
            .where(Node.cluster_id == cluster.id, Node.deleted_at.is_(None))
        )
    )
    chosen = place_nodes(
        slots,
        count=count,
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
    session.add_all(nodes)
    return nodes
