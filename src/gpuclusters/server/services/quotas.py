"""Project quotas (``core/quotas.py``): organization admins set them, any
member reads them with the project's use, and every create, scale and
resize checks them before it writes.

``enforce`` locks the project's row first (PostgreSQL; SQLite serializes
writers), so two creates at once cannot both pass a check that only one
fits, and it runs inside the caller's transaction: a refusal rolls the
request back, and nothing of it is left.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.enums import ProjectRole
from gpuclusters.core.errors import QuotaExceededError
from gpuclusters.core.quotas import Amounts, Limits, excess
from gpuclusters.server.db.models import Cluster, Project, ProjectQuota, Volume, utcnow
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.tenancy import require_org_admin, resolve_project


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


def _limits_view(limits: Limits) -> api.QuotaLimits:
    return api.QuotaLimits(
        standard_gpus=limits.standard_gpus,
        preemptible_gpus=limits.preemptible_gpus,
        clusters=limits.clusters,
        volume_tib=limits.volume_tib,
    )


async def get_quota(
    session: AsyncSession, *, principal: Principal, project_name: str
) -> api.ProjectQuota:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    use = await use_of(session, project.id)
    return api.ProjectQuota(
        project=project.name,
        limits=_limits_view(await limits_of(session, project.id)),
        use=api.QuotaAmounts(
            standard_gpus=use.standard_gpus,
            preemptible_gpus=use.preemptible_gpus,
            clusters=use.clusters,
            volume_tib=use.volume_tib,
        ),
    )


async def set_quota(
    session: AsyncSession, *, principal: Principal, project_name: str, body: api.QuotaLimits
) -> api.ProjectQuota:
    """Set every quota of the project (organization admins); ``null`` is no
    limit. A limit below the current use is allowed: the project keeps what
    it has and can only shrink until it is under."""
    require_org_admin(principal, "setting quotas")
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    row = await session.get(ProjectQuota, project.id)
    if row is None:
        row = ProjectQuota(project_id=project.id)
        session.add(row)
    row.standard_gpus = body.standard_gpus
    row.preemptible_gpus = body.preemptible_gpus
    row.clusters = body.clusters
    row.volume_tib = body.volume_tib
    row.updated_at = utcnow()
    row.updated_by = principal.user_name
    await session.commit()
    return await get_quota(session, principal=principal, project_name=project_name)
