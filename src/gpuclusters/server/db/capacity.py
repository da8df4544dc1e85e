"""Reading capacity windows and standard-node counts for the pure rules in
``core.capacity.reservations``, and deciding how a node that goes live is
paid for. Reads only; callers own the transaction."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.capacity.reservations import Window, active_gpus, held_back
from gpuclusters.core.enums import GPUS_PER_NODE, ComputeClass
from gpuclusters.server.db.models import CapacityWindow, Cluster, Node, UsageRecord

RESERVED = "reserved"
POOL = "pool"
ON_DEMAND = "on_demand"
PREEMPTIBLE = "preemptible"


def to_window(row: CapacityWindow) -> Window:
    return Window(
        project=row.project_id,
        kind=row.kind,
        gpu_type=row.gpu_type,
        region=row.region,
        num_gpus=row.num_gpus,
        start=row.start_at,
        end=row.end_at,
    )


async def windows(
    session: AsyncSession, *, gpu_type: str, region: str, at: datetime
) -> list[Window]:
    """Capacity windows of this type and region active at ``at``."""
    rows = await session.scalars(
        select(CapacityWindow).where(
            CapacityWindow.gpu_type == gpu_type,
            CapacityWindow.region == region,
            CapacityWindow.start_at <= at,
            CapacityWindow.end_at > at,
        )
    )
    return [to_window(w) for w in rows]


async def standard_nodes_by_project(
    session: AsyncSession, *, gpu_type: str, region: str, projects: Collection[str] | None = None
) -> dict[str, int]:
    """Live standard nodes of this GPU type and region per project (only
    ``projects``, if given: counting a whole fleet's nodes for each
    placement is what made placement slow at 10,000 nodes)."""
    query = (
        select(Node.project_id, func.count(Node.id))
        .join(Cluster, Cluster.id == Node.cluster_id)
        .where(
            Node.deleted_at.is_(None),
            Node.to_delete.is_(False),
            Node.compute_class == ComputeClass.STANDARD.value,
            Cluster.gpu_type == gpu_type,
            Cluster.region == region,
        )
        .group_by(Node.project_id)
    )
    if projects is not None:
        query = query.where(Node.project_id.in_(list(projects)))
    rows = await session.execute(query)
    return {p: int(n) for p, n in rows.all()}


async def held_back_for(session: AsyncSession, *, cluster: Cluster, at: datetime) -> int:
    """Hosts other projects' active windows hold that this cluster's
    standard nodes may not take. Nodes are counted only for the projects
    holding such windows (usually none: then nothing is counted)."""
    active = await windows(session, gpu_type=cluster.gpu_type, region=cluster.region, at=at)
    others = {w.project for w in active if w.project != cluster.project_id}
    if not others:
        return 0
    return held_back(
        active,
        requester=cluster.project_id,
        gpu_type=cluster.gpu_type,
        region=cluster.region,
        standard_nodes=await standard_nodes_by_project(
            session, gpu_type=cluster.gpu_type, region=cluster.region, projects=others
        ),
        at=at,
    )


async def project_windows(
    session: AsyncSession, *, project_id: str, gpu_type: str, region: str, at: datetime
) -> dict[str, int]:
    """GPUs of each kind (reserved, pool) the project holds now."""
    return active_gpus(
        await windows(session, gpu_type=gpu_type, region=region, at=at),
        project=project_id,
        gpu_type=gpu_type,
        region=region,
        at=at,
    )


async def billing_for(session: AsyncSession, node: Node, cluster: Cluster, at: datetime) -> str:
    """How a node going live is paid for: preemptible nodes are preemptible;
    standard ones fill the project's active reserved windows first, then its
    pool windows, and are on-demand beyond them."""
    if node.compute_class == ComputeClass.PREEMPTIBLE.value:
        return PREEMPTIBLE
    held = await project_windows(
        session,
        project_id=node.project_id,
        gpu_type=cluster.gpu_type,
        region=cluster.region,
        at=at,
    )
    if not any(held.get(kind, 0) >= GPUS_PER_NODE for kind in (RESERVED, POOL)):
        return ON_DEMAND  # no window to fill: no need to count the live nodes
    # Counted in the database: a project may have thousands of live nodes.
    counts = await session.execute(
        select(UsageRecord.billing, func.count())
        .where(
            UsageRecord.project_id == node.project_id,
            UsageRecord.gpu_type == cluster.gpu_type,
            UsageRecord.ended_at.is_(None),
            UsageRecord.compute_class == ComputeClass.STANDARD.value,
        )
        .group_by(UsageRecord.billing)
    )
    live = {billing: int(n) for billing, n in counts}
    for kind in (RESERVED, POOL):
        if live.get(kind, 0) < held.get(kind, 0) // GPUS_PER_NODE:
            return kind
    return ON_DEMAND
