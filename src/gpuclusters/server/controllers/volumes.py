"""Volume reconciler: provisioning -> available, and deleting -> deleted.

Binding to a cluster is the cluster reconciler's job; this one only makes
and removes storage. Data is removed only for volumes in ``deleting``, a
state set solely by an explicit volume delete or ``--delete-volume``.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.enums import VolumeStatus
from gpuclusters.server.controllers import hints, leases
from gpuclusters.server.controllers.base import ControllerContext, Reconciler
from gpuclusters.server.db.models import Cluster, Volume, utcnow
from gpuclusters.server.runtime import Runtime

V = VolumeStatus


class VolumeReconciler(Reconciler):
    name = hints.VOLUMES
    model = Volume

    def __init__(self, ctx: ControllerContext, rt: Runtime) -> None:
        super().__init__(ctx)
        self.rt = rt

    async def candidates(self, session: AsyncSession) -> Sequence[str]:
        rows = await session.scalars(
            select(Volume.id).where(
                Volume.deleted_at.is_(None),
                Volume.status.in_((V.PROVISIONING.value, V.DELETING.value)),
            )
        )
        return list(rows)

    async def reconcile(self, row_id: str, token: str) -> bool:
        async with self.ctx.sessionmaker() as session:
            volume = await session.get_one(Volume, row_id)
        if volume.status == V.PROVISIONING.value:
            await self.rt.volumes.ensure(volume.id, size_tib=volume.size_tib)
            new_status = V.AVAILABLE
        elif volume.status == V.DELETING.value:
            if volume.cluster_id is not None:
                return False  # still attached; never remove data under a cluster
            await self.rt.volumes.delete(volume.id)
            new_status = V.DELETED
        else:
            return False
        async with self.ctx.sessionmaker() as session:
            volume = await leases.fenced(
                session, Volume, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            volume.status = new_status.value
            if new_status is V.DELETED:
                volume.deleted_at = utcnow()
            await session.commit()
            # The clusters that use it, by name: a cluster waiting for its
            # volume goes on (a full hint would also sweep every cluster
            # that waits for its nodes, see ClusterReconciler.candidates).
            users = list(
                await session.scalars(
                    select(Cluster.id).where(
                        Cluster.volume_id == row_id, Cluster.deleted_at.is_(None)
                    )
                )
            )
        if users:
            self.ctx.hints.notify_rows(hints.CLUSTERS, users)
        return True
