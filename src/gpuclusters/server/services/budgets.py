"""Project budgets (core/budgets.py, controllers/budgets.py): organization
admins set them, any member reads where they stand."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.budgets import percent_spent
from gpuclusters.core.enums import ProjectRole
from gpuclusters.core.errors import InvalidStateError
from gpuclusters.server.db.budgets import budget_spent
from gpuclusters.server.db.models import BudgetAlert, ProjectBudget, utcnow
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.tenancy import require_org_admin, resolve_project

ALERTS_SHOWN = 50


async def get_budget(
    session: AsyncSession, *, rt: Runtime, principal: Principal, project_name: str
) -> api.ProjectBudget:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    budget = await session.get(ProjectBudget, project.id)
    alerts = [
        api.BudgetAlertView(
            timestamp=a.timestamp,
            kind=a.kind,
            percent=a.percent,
            spent=round(a.spent, 2),
            amount=a.amount,
            message=a.message,
        )
        for a in await session.scalars(
            select(BudgetAlert)
            .where(BudgetAlert.project_id == project.id)
            .order_by(BudgetAlert.timestamp.desc())
            .limit(ALERTS_SHOWN)
        )
    ]
    if budget is None:
        return api.ProjectBudget(project=project.name, budget=None, alerts=alerts)
    start, spent = await budget_spent(
        session,
        budget,
        now=utcnow(),
        rates=rt.settings.gpu_hour_rates,
        discounts=rt.settings.discounts,
    )
    grace = timedelta(seconds=rt.settings.budget_grace_s)
    return api.ProjectBudget(
        project=project.name,
        budget=api.BudgetSettings(
            kind=budget.kind,
            amount=budget.amount,
            policy=budget.policy,
            webhook_url=budget.webhook_url,
        ),
        period_start=start,
        spent=round(spent, 4),
        remaining=round(max(0.0, budget.amount - spent), 4),
        percent=round(percent_spent(spent, budget.amount), 2),
        exhausted_since=budget.exhausted_since,
        grace_ends_at=budget.exhausted_since + grace if budget.exhausted_since else None,
        enforced=budget.enforced,
        alerts=alerts,
    )


async def set_budget(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    body: api.BudgetSettings,
) -> api.ProjectBudget:
    """A new or changed budget (org admins). Setting a credit starts its
    count afresh (a top-up); the budget controller applies or lifts the
    policy at its next pass."""
    require_org_admin(principal, "setting budgets")
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    budget = await session.get(ProjectBudget, project.id)
    now = utcnow()
    if budget is None:
        budget = ProjectBudget(project_id=project.id, credit_since=now)
        session.add(budget)
    elif body.kind == "credit" or budget.kind != body.kind:
        budget.credit_since = now
    if budget.kind != body.kind or budget.amount != body.amount:
        budget.alert_period, budget.alerted_percent = "", 0  # alerts count anew
    budget.kind, budget.amount, budget.policy = body.kind, body.amount, body.policy
    budget.webhook_url = body.webhook_url
    budget.updated_at, budget.updated_by = now, principal.user_name
    await session.commit()
    return await get_budget(session, rt=rt, principal=principal, project_name=project_name)


async def delete_budget(
    session: AsyncSession, *, rt: Runtime, principal: Principal, project_name: str
) -> api.ProjectBudget:
    """No budget: nothing is held back any more. A stopped project's
    clusters resume first: while its policy is in force the budget is raised
    (the next pass lifts it and resumes them, in one place), not deleted."""
    require_org_admin(principal, "deleting budgets")
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    budget = await session.get(ProjectBudget, project.id)
    if budget is not None and budget.enforced is not None:
        raise InvalidStateError(
            "budget: its policy is in force; raise the amount or add credit first (the "
            "clusters resume), then delete it",
            field="budget",
        )
    await session.execute(delete(ProjectBudget).where(ProjectBudget.project_id == project.id))
    await session.commit()
    return await get_budget(session, rt=rt, principal=principal, project_name=project_name)


async def banners(
    session: AsyncSession, *, rt: Runtime, principal: Principal, projects: list[str]
) -> list[str]:
    """The console's banner lines: projects at 50 % of their budget or more,
    and any whose policy holds (their own members see them)."""
    out: list[str] = []
    for name in projects:
        state = await get_budget(session, rt=rt, principal=principal, project_name=name)
        if state.budget is None or (state.percent < 50 and state.enforced is None):
            continue
        line = (
            f"Project {name}: {state.percent:.0f}% of its {state.budget.kind} budget spent "
            f"({state.spent:.2f} of {state.budget.amount:.2f} {state.currency})."
        )
        if state.enforced:
            line += f" Policy {state.enforced} in force: no new nodes"
            line += (
                "; clusters suspended until credit returns." if state.enforced == "stop" else "."
            )
        elif state.grace_ends_at is not None:
            line += (
                f" Policy {state.budget.policy} applies at "
                f"{state.grace_ends_at:%Y-%m-%d %H:%M} UTC."
            )
        out.append(line)
    return out
