"""Usage and cost of a project: the usage records (one per node, live to
release) priced by ``core.pricing`` with the operator's rates."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.enums import ComputeClass, ProjectRole
from gpuclusters.core.errors import ValidationError
from gpuclusters.core.pricing import Interval, summarize
from gpuclusters.server.db.models import UsageRecord, utcnow
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.tenancy import resolve_project

DEFAULT_WINDOW = timedelta(days=30)


async def usage_report(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    since: datetime | None,
    until: datetime | None,
) -> api.UsageReport:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    now = utcnow()
    until = until or now
    since = since or until - DEFAULT_WINDOW
    for field, value in (("since", since), ("until", until)):
        if value.tzinfo is None:
            raise ValidationError(
                f"{field}: give a time zone (e.g. 2026-12-01T00:00:00Z)", field=field
            )
    if since >= until:
        raise ValidationError("since: must be before until", field="since")
    records = await session.scalars(
        select(UsageRecord).where(
            UsageRecord.project_id == project.id,
            UsageRecord.started_at < until,
            or_(UsageRecord.ended_at.is_(None), UsageRecord.ended_at > since),
        )
    )
    sums = summarize(
        (
            Interval(
                cluster=r.cluster_name,
                compute_class=r.compute_class,
                billing=r.billing,
                gpu_type=r.gpu_type,
                num_gpus=r.num_gpus,
                started_at=r.started_at,
                ended_at=r.ended_at,
            )
            for r in records
        ),
        since=since,
        until=min(until, now),
        rates=rt.settings.gpu_hour_rates,
        discounts=rt.settings.discounts,
    )
    lines = [
        api.UsageLine(
            cluster=s.cluster,
            compute_class=ComputeClass(s.compute_class),
            billing=s.billing,
            gpu_type=s.gpu_type,
            nodes=s.nodes,
            node_hours=round(s.node_hours, 6),
            gpu_hours=round(s.gpu_hours, 6),
            rate_per_gpu_hour=round(s.rate_per_gpu_hour, 4),
            cost=round(s.cost, 4),
        )
        for s in sums
    ]
    return api.UsageReport(
        project=project.name,
        since=since,
        until=until,
        lines=lines,
        total_gpu_hours=round(sum(s.gpu_hours for s in sums), 6),
        total_cost=round(sum(s.cost for s in sums), 4),
    )
