"""Budget enforcement (core/budgets.py, docs/budgets.md): a housekeeping
chore, so one replica does it (the housekeeping lease).

Each pass, per project with a budget: what was spent in the period (the
usage records at the operator's prices), alerts for thresholds newly
crossed (a ``budget_alerts`` row, and the project's webhook), and the
policy once the budget is spent and the grace period has passed:

- ``pause``: every cluster's preemptible target goes to 0 (those nodes are
  drained and released as in a scale-down), and creates, scale-ups and the
  autoscaler are refused (``db/budgets.refuse_new_nodes``);
- ``stop``: every node of every live cluster is released and the cluster
  waits ``suspended`` (volume, control plane and login node kept).

Credit back under 100 % lifts it: suspended clusters are queued again and
placed as capacity allows. Every step re-applies what the state says (a
crash between two writes is finished by the next pass); nothing is ever
deleted but nodes, and no volume is touched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.budgets import (
    BudgetKind,
    BudgetPolicy,
    enforcement,
    new_alerts,
    percent_spent,
    period_key,
)
from gpuclusters.core.enums import ClusterStatus, ComputeClass
from gpuclusters.server.controllers import hints
from gpuclusters.server.db.budgets import budget_spent
from gpuclusters.server.db.models import (
    BudgetAlert,
    Cluster,
    Node,
    Project,
    ProjectBudget,
    utcnow,
)
from gpuclusters.server.db.records import set_cluster_status
from gpuclusters.server.db.scaling import set_preemptible_target
from gpuclusters.server.runtime import Runtime

log = logging.getLogger(__name__)

WEBHOOK_TIMEOUT_S = 5.0
CURRENCY = "USD"  # core/pricing.py's rates are USD
DELETE_REASON = "budget"
# Clusters a stop leaves alone: on their way out, or never placed.
_NOT_SUSPENDED = (
    ClusterStatus.DELETING.value,
    ClusterStatus.DELETED.value,
    ClusterStatus.FAILED.value,
    ClusterStatus.SUSPENDED.value,
)


@dataclass(frozen=True, slots=True)
class Notice:
    """An alert to post to the project's webhook once committed."""

    url: str
    body: dict[str, object]


async def enforce_budgets(rt: Runtime) -> list[str]:
    """One pass over every budget; the alerts' messages, for the log and tests."""
    async with rt.sessionmaker() as session:
        ids = list(await session.scalars(select(ProjectBudget.project_id)))
    messages: list[str] = []
    for project_id in ids:
        notices = await _one(rt, project_id)
        messages += [str(n.body["message"]) for n in notices]
        for n in notices:  # in order: a receiver sees 80 % before 100 %
            if n.url:
                await _post(n)
    return messages


async def _one(rt: Runtime, project_id: str) -> list[Notice]:
    now = utcnow()
    settings = rt.settings
    notices: list[Notice] = []
    async with rt.sessionmaker() as session:
        budget = (
            await session.execute(
                select(ProjectBudget)
                .where(ProjectBudget.project_id == project_id)
                .with_for_update()
            )
        ).scalar_one_or_none()
        if budget is None:
            return []
        project = await session.get_one(Project, project_id)
        kind = BudgetKind(budget.kind)
        start, spent = await budget_spent(
            session,
            budget,
            now=now,
            rates=settings.gpu_hour_rates,
            discounts=settings.discounts,
        )
        key = period_key(kind, now=now, credit_since=budget.credit_since)
        if budget.alert_period != key:
            budget.alert_period, budget.alerted_percent = key, 0
        currency = CURRENCY

        def notice(alert: BudgetAlert) -> None:
            session.add(alert)
            notices.append(
                Notice(
                    url=budget.webhook_url or "",
                    body={
                        "project": project.name,
                        "kind": alert.kind,
                        "percent": alert.percent,
                        "spent": round(spent, 2),
                        "amount": budget.amount,
                        "currency": currency,
                        "budget": budget.kind,
                        "period_start": start.isoformat(),
                        "policy": budget.policy,
                        "message": alert.message,
                        "timestamp": now.isoformat(),
                    },
                )
            )

        for threshold in new_alerts(spent, budget.amount, already=budget.alerted_percent):
            notice(
                BudgetAlert(
                    project_id=project_id,
                    timestamp=now,
                    kind="threshold",
                    percent=threshold,
                    spent=spent,
                    amount=budget.amount,
                    message=f"project {project.name}: {threshold}% of its {kind.value} budget "
                    f"spent ({spent:.2f} of {budget.amount:.2f} {currency} since "
                    f"{start:%Y-%m-%d %H:%M} UTC)",
                )
            )
            budget.alerted_percent = threshold
        state = enforcement(
            spent=spent,
            amount=budget.amount,
            policy=BudgetPolicy(budget.policy),
            exhausted_since=budget.exhausted_since,
            now=now,
            grace=timedelta(seconds=settings.budget_grace_s),
        )
        budget.exhausted_since = state.exhausted_since
        was = budget.enforced
        want = state.enforce.value if state.enforce else None
        if want is not None:
            await _apply(session, rt, project_id, BudgetPolicy(want))
        elif was == BudgetPolicy.STOP.value:
            await _resume(session, project_id)
        if want != was:
            budget.enforced = want
            pct = round(percent_spent(spent, budget.amount))
            what = (
                f"budget spent and its grace period over: policy {want} applied"
                + (
                    " (preemptible targets 0, no new nodes)"
                    if want == BudgetPolicy.PAUSE.value
                    else " (nodes released, clusters suspended; volumes kept)"
                )
                if want
                else f"budget back under 100% ({pct}%): policy {was} lifted"
            )
            notice(
                BudgetAlert(
                    project_id=project_id,
                    timestamp=now,
                    kind="enforced" if want else "lifted",
                    percent=pct,
                    spent=spent,
                    amount=budget.amount,
                    message=f"project {project.name}: {what}",
                )
            )
        await session.commit()
    if want != was or notices:
        rt.hints.notify(hints.CLUSTERS, hints.NODES)
    for n in notices:
        log.info("%s", n.body["message"])
    return notices


async def _live_clusters(session: AsyncSession, project_id: str) -> list[Cluster]:
    return list(
        await session.scalars(
            select(Cluster).where(Cluster.project_id == project_id, Cluster.deleted_at.is_(None))
        )
    )


async def _apply(session: AsyncSession, rt: Runtime, project_id: str, policy: BudgetPolicy) -> None:
    for cluster in await _live_clusters(session, project_id):
        if cluster.num_preemptible_gpus:
            await set_preemptible_target(session, cluster, 0)
        if policy is not BudgetPolicy.STOP or cluster.status in _NOT_SUSPENDED:
            continue
        for node in await session.scalars(
            select(Node).where(
                Node.cluster_id == cluster.id,
                Node.deleted_at.is_(None),
                Node.to_delete.is_(False),
                Node.compute_class == ComputeClass.STANDARD.value,
            )
        ):
            node.to_delete, node.delete_reason = True, DELETE_REASON
        await set_cluster_status(
            session,
            cluster,
            ClusterStatus.SUSPENDED.value,
            "the project's budget is spent (policy stop): nodes released, volume kept; "
            "resumes when credit returns",
        )


async def _resume(session: AsyncSession, project_id: str) -> None:
    """Suspended clusters are queued again: the cluster reconciler places
    their nodes as capacity allows, then they come up as any queued one."""
    now = utcnow()
    for cluster in await _live_clusters(session, project_id):
        if cluster.status != ClusterStatus.SUSPENDED.value:
            continue
        cluster.start_at, cluster.nodes_placed = now, False
        await set_cluster_status(
            session, cluster, ClusterStatus.QUEUED.value, "budget credit returned: resuming"
        )


async def _post(notice: Notice) -> None:
    """The documented webhook (docs/budgets.md): one JSON POST per alert;
    a failure is logged (the alert stays listed in the API)."""
    try:
        async with httpx.AsyncClient(timeout=WEBHOOK_TIMEOUT_S) as client:
            r = await client.post(notice.url, json=notice.body)
            r.raise_for_status()
    except Exception as exc:
        log.warning("budget webhook %s failed: %s", notice.url, exc)
