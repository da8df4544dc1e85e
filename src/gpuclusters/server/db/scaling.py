"""Changing a cluster's node counts in the database, shared by the API
(scale) and the controllers (budgets): the rows only; the node reconciler
drains and releases what is marked ``to_delete``."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.capacity.preemption import preemptible_surplus
from gpuclusters.core.capacity.scale_down import NodeSnapshot, choose_nodes_to_remove
from gpuclusters.core.enums import ComputeClass, NodePhase
from gpuclusters.server.db.models import Cluster, Node


async def live_nodes(session: AsyncSession, cluster: Cluster, cls: ComputeClass) -> list[Node]:
    """The cluster's nodes of one class that are not on their way out."""
    return list(
        await session.scalars(
            select(Node).where(
                Node.cluster_id == cluster.id,
                Node.deleted_at.is_(None),
                Node.to_delete.is_(False),
                Node.compute_class == cls.value,
            )
        )
    )


async def set_preemptible_target(session: AsyncSession, cluster: Cluster, gpus: int) -> None:
    """A higher target is filled by the cluster reconciler as spare capacity
    allows; a lower one removes the surplus at once (nodes still booting
    first, then the newest), with an ordinary drain, not a preemption."""
    cluster.num_preemptible_gpus = gpus
    live = await live_nodes(session, cluster, ComputeClass.PREEMPTIBLE)
    surplus = preemptible_surplus(target_gpus=gpus, live_nodes=len(live))
    snapshots = [
        NodeSnapshot(
            name=n.name,
            cordoned=False,
            running=n.phase == NodePhase.RUNNING.value,
            failed=n.phase == NodePhase.FAILED.value,
            created_at=n.created_at,
        )
        for n in live
    ]
    victims = set(choose_nodes_to_remove(snapshots, count=surplus))
    for n in live:
        if n.name in victims:
            n.to_delete = True
            n.delete_reason = "scale_down"
