"""Project quotas (``core/quotas.py``): organization admins set them, any
member reads them with the project's use, and every create, scale and
resize checks them before it writes (``db/quotas.enforce``, shared with
the autoscaler).
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.enums import ProjectRole
from gpuclusters.core.quotas import Limits
from gpuclusters.server.db.models import ProjectQuota, utcnow
from gpuclusters.server.db.quotas import enforce, limits_of, use_of
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.tenancy import require_org_admin, resolve_project

__all__ = ["enforce", "get_quota", "limits_of", "set_quota", "use_of"]


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
