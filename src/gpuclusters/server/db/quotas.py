"""Quota checks shared by the API and the controllers (the autoscaler
grows clusters too): ``enforce`` locks the project's row first
(PostgreSQL; SQLite serializes writers), so two changes at once cannot both
pass a check that only one fits, and it runs inside the caller's
transaction: a refusal rolls the change back, and nothing of it is left.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.errors import QuotaExceededError
from gpuclusters.core.quotas import Amounts, Limits, excess
from gpuclusters.server.db.models import Cluster, Project, ProjectQuota, Volume


async def limits_of(session: AsyncSession, project_id: str) -> Limits:
    row = await session.get(ProjectQuota, project_id)
    if row is None:
        return Limits()
    return Limits(
        standard_gpus=row.standard_gpus,
        preemptible_gpus=row.preemptible_gpus,
        clusters=row.clusters,
        volume_tib=row.volume_tib,
    )


async def use_of(session: AsyncSession, project_id: str) -> Amounts:
    """What the project holds: its live clusters' GPU targets, their number,
    and its live volumes' size. Pending objects of the caller's own
    transaction are not counted (no autoflush): they are what it adds."""
    with session.no_autoflush:
        standard, preemptible, count = (
            await session.execute(
                select(
                    func.coalesce(func.sum(Cluster.num_gpus), 0),
                    func.coalesce(func.sum(Cluster.num_preemptible_gpus), 0),
                    func.count(Cluster.id),
                ).where(Cluster.project_id == project_id, Cluster.deleted_at.is_(None))
            )
        ).one()
        tib = await session.scalar(
            select(func.coalesce(func.sum(Volume.size_tib), 0)).where(
                Volume.project_id == project_id, Volume.deleted_at.is_(None)
            )
        )
    return Amounts(
        standard_gpus=int(standard),
        preemptible_gpus=int(preemptible),
        clusters=int(count),
        volume_tib=int(tib or 0),
    )


async def enforce(session: AsyncSession, project: Project, add: Amounts) -> None:
    """Refuse (409 ``quota_exceeded``) a change that would take the project
    above a quota."""
    with session.no_autoflush:
        await session.execute(select(Project.id).where(Project.id == project.id).with_for_update())
        limits = await limits_of(session, project.id)
    if limits == Limits():
        return  # no quota: nothing to count
    over = excess(limits, await use_of(session, project.id), add)
    if over is not None:
        raise QuotaExceededError(over.message, field=over.quota)
