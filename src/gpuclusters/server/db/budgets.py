"""A project's spending against its budget (core/budgets.py), read by the
API (``GET .../budget``, refusals) and the budget controller."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.budgets import BudgetKind, BudgetPolicy, period_start
from gpuclusters.core.errors import BudgetExhaustedError
from gpuclusters.core.pricing import Interval, summarize
from gpuclusters.server.db.models import ProjectBudget, UsageRecord


async def usage_intervals(
    session: AsyncSession, project_id: str, *, since: datetime, until: datetime
) -> list[Interval]:
    """The project's usage records that overlap the window, as pricing sees them."""
    records = await session.scalars(
        select(UsageRecord).where(
            UsageRecord.project_id == project_id,
            UsageRecord.started_at < until,
            or_(UsageRecord.ended_at.is_(None), UsageRecord.ended_at > since),
        )
    )
    return [
        Interval(
            cluster=r.cluster_name,
            compute_class=r.compute_class,
            billing=r.billing,
            gpu_type=r.gpu_type,
            num_gpus=r.num_gpus,
            started_at=r.started_at,
            ended_at=r.ended_at,
            user=r.user_name,
        )
        for r in records
    ]


async def spent_since(
    session: AsyncSession,
    project_id: str,
    *,
    since: datetime,
    now: datetime,
    rates: Mapping[str, Mapping[str, float]],
    discounts: Mapping[str, float],
) -> float:
    intervals = await usage_intervals(session, project_id, since=since, until=now)
    sums = summarize(intervals, since=since, until=now, rates=rates, discounts=discounts)
    return sum(s.cost for s in sums)


async def budget_spent(
    session: AsyncSession,
    budget: ProjectBudget,
    *,
    now: datetime,
    rates: Mapping[str, Mapping[str, float]],
    discounts: Mapping[str, float],
) -> tuple[datetime, float]:
    """The budget's period start and what was spent in it."""
    start = period_start(BudgetKind(budget.kind), now=now, credit_since=budget.credit_since)
    spent = await spent_since(
        session, budget.project_id, since=start, now=now, rates=rates, discounts=discounts
    )
    return start, spent


async def refuse_new_nodes(session: AsyncSession, project_id: str, *, what: str) -> None:
    """409 ``budget_exhausted`` while the project's policy holds new nodes
    back (``pause`` and ``stop`` both do)."""
    budget = await session.get(ProjectBudget, project_id)
    if budget is None or budget.enforced is None:
        return
    since = budget.exhausted_since.isoformat() if budget.exhausted_since else "now"
    lift = (
        "a new month starts"
        if budget.kind == BudgetKind.MONTHLY.value
        else "credit is added (projects budget set --credit)"
    )
    policy = BudgetPolicy(budget.enforced).value
    raise BudgetExhaustedError(
        f"{what}: the project's budget is spent (since {since}; policy {policy}): no new "
        f"nodes until {lift} or an organization admin raises it",
        field="budget",
    )
