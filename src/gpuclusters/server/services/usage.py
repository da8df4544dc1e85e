"""Usage and cost of a project: the usage records (one per node, live to
release) priced by ``core.pricing`` with the operator's rates."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Literal

from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.enums import ComputeClass, ProjectRole
from gpuclusters.core.errors import ValidationError
from gpuclusters.core.pricing import Interval, summarize
from gpuclusters.server.db.budgets import usage_intervals
from gpuclusters.server.db.models import utcnow
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
    by: Literal["user", "cluster"] | None = None,
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
    end = min(until, now)
    intervals = await usage_intervals(session, project.id, since=since, until=until)
    rates, discounts = rt.settings.gpu_hour_rates, rt.settings.discounts
    sums = summarize(intervals, since=since, until=end, rates=rates, discounts=discounts)
    groups: list[api.UsageByLine] = []
    if by is not None:
        keyed: dict[str, list[Interval]] = defaultdict(list)
        for iv in intervals:
            keyed[(iv.user or "-") if by == "user" else iv.cluster].append(iv)
        for key in sorted(keyed):
            part = summarize(keyed[key], since=since, until=end, rates=rates, discounts=discounts)
            groups.append(
                api.UsageByLine(
                    key=key,
                    gpu_hours=round(sum(p.gpu_hours for p in part), 6),
                    cost=round(sum(p.cost for p in part), 4),
                )
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
        by=by,
        groups=groups,
    )
