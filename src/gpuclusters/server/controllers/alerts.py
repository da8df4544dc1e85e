"""Alerts from the agents' findings, and the repair they call for.

Each heartbeat carries the node's current findings; a finding opens an
alert (one per node, kind, GPU and subject), a repeat refreshes it, and an
alert whose finding is gone is resolved. Housekeeping opens
``heartbeat_missed`` alerts for silent nodes.

After alerts change, the rules (``core.health.rules``) choose an action for
the node's open alerts. When it is a repair and no repair of that node is
open yet, a remediation is recorded, ``pending`` if the cluster's policy
lets it run alone, ``pending_approval`` otherwise. Its idempotency key is
``auto:<node>:<hash of the open alerts>:<action>``: the same alerts are
never recommended twice (e.g. after a person rejected the repair). A remediation still
waiting whose alerts all resolved becomes ``auto_resolved``.

The unhealthy limit is a property of the cluster, not of the node whose
report happened to land first: a ``pending`` automatic repair does not
start until it has settled (``rules.SETTLE_WINDOW``), and the repair
reconciler then decides it with the cluster's unhealthy nodes counted as a
set (``start_decision``). Whenever alerts change and the cluster is over
the limit, every automatic repair of it that has not started is held for a
person at once (``hold_if_paused``), so two faults that arrive together end
the same way (both ``pending_approval``) whichever heartbeat was first, and
whichever transaction committed first (on PostgreSQL two heartbeats can
each count only their own node; the start decision counts again).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.enums import NodePhase
from gpuclusters.core.health import rules
from gpuclusters.core.health.findings import AlertKind, Severity, alert_key
from gpuclusters.core.health.rules import (
    Decision,
    PastRepair,
    Policy,
    RepairAction,
    Verdict,
    WaitingRepair,
    blocked_reason,
    decide_automatic,
    needs_approval,
    recommend,
)
from gpuclusters.server.controllers import hints
from gpuclusters.server.db.models import Alert, Cluster, Node, Remediation, utcnow
from gpuclusters.server.runtime import Runtime

OPEN_STATES = ("pending_approval", "pending", "running")
WAITING_STATES = ("pending_approval", "pending")


async def apply_findings(
    session: AsyncSession, *, rt: Runtime, node: Node, findings: Sequence[dict[str, Any]]
) -> bool:
    """Open, refresh and resolve the node's alerts from its current findings
    (not committed). True when an alert opened or resolved."""
    now = utcnow()
    current = {alert_key(f): f for f in findings}
    open_alerts = list(
        await session.scalars(
            select(Alert).where(Alert.node_id == node.id, Alert.resolved_at.is_(None))
        )
    )
    changed = False
    seen = set()
    for alert in open_alerts:
        key = (alert.kind, None if alert.gpu < 0 else alert.gpu, alert.subject)
        if alert.kind == AlertKind.HEARTBEAT_MISSED:
            alert.resolved_at = now  # it answered
            changed = True
        elif key in current:
            f = current[key]
            alert.last_seen_at = now
            alert.severity = str(f["severity"])
            alert.message = str(f["message"])
            seen.add(key)
        else:
            alert.resolved_at = now
            changed = True
    for key, f in current.items():
        if key in seen:
            continue
        session.add(
            Alert(
                project_id=node.project_id,
                cluster_id=node.cluster_id,
                node_id=node.id,
                node_name=node.name,
                kind=str(f["kind"]),
                severity=str(f["severity"]),
                gpu=-1 if key[1] is None else int(key[1]),
                subject=key[2],
                code=f.get("code"),
                message=str(f["message"]),
                details=json.dumps(f.get("details") or {}),
                started_at=now,
                last_seen_at=now,
            )
        )
        changed = True
    await session.flush()
    if changed:
        await recommend_repair(session, rt=rt, node=node)
    return changed


async def open_alerts_of(session: AsyncSession, node_id: str) -> list[Alert]:
    return list(
        await session.scalars(
            select(Alert).where(Alert.node_id == node_id, Alert.resolved_at.is_(None))
        )
    )


async def unhealthy_counts(session: AsyncSession, cluster_id: str) -> tuple[int, int]:
    """(nodes with an open critical alert, live nodes) of the cluster."""
    nodes = list(
        await session.scalars(
            select(Node.id).where(Node.cluster_id == cluster_id, Node.deleted_at.is_(None))
        )
    )
    sick = set(
        await session.scalars(
            select(Alert.node_id).where(
                Alert.cluster_id == cluster_id,
                Alert.resolved_at.is_(None),
                Alert.severity == Severity.CRITICAL.value,
            )
        )
    )
    return len(sick & set(nodes)), len(nodes)


def policy_of(cluster: Cluster) -> Policy:
    kinds = frozenset(k for k in cluster.repair_automatic.split(",") if k)
    return Policy(automatic=kinds)


async def recommend_repair(session: AsyncSession, *, rt: Runtime, node: Node) -> Remediation | None:
    """Record the repair the node's open alerts call for, then hold the
    cluster's automatic repairs that have not started if the cluster is now
    over the unhealthy limit (see module doc)."""
    rem = await _recommend(session, rt=rt, node=node)
    await hold_if_paused(session, cluster_id=node.cluster_id)
    return rem


async def repair_history(session: AsyncSession, node_id: str) -> list[PastRepair]:
    """The node's succeeded repairs (escalation and cooldown look at them)."""
    return [
        PastRepair(
            action=RepairAction(r.action),
            kinds=frozenset(k for k in r.kinds.split(",") if k),
            finished_at=r.finished_at or r.updated_at,
            succeeded=True,
        )
        for r in await session.scalars(
            select(Remediation).where(
                Remediation.node_id == node_id, Remediation.state == "succeeded"
            )
        )
    ]


def waiting_message(settle: float) -> str:
    return (
        f"automatic: starts {settle:.0f}s after it was recommended unless more than "
        f"{rules.MAX_UNHEALTHY_FRACTION:.0%} of the cluster's nodes are unhealthy by then"
    )


async def _recommend(session: AsyncSession, *, rt: Runtime, node: Node) -> Remediation | None:
    now = utcnow()
    alerts = await open_alerts_of(session, node.id)
    # Waiting repairs whose alerts are all gone resolve themselves.
    waiting = list(
        await session.scalars(
            select(Remediation).where(
                Remediation.node_id == node.id, Remediation.state.in_(WAITING_STATES)
            )
        )
    )
    open_ids = {a.id for a in alerts}
    for rem in waiting:
        linked = set(json.loads(rem.alert_ids))
        if rem.trigger == "automated" and linked and not (linked & open_ids):
            rem.state = "auto_resolved"
            rem.finished_at = rem.updated_at = now
            rem.message = "the alerts resolved before the repair started"
    if not alerts or node.deleted_at is not None or node.to_delete:
        return None
    if await session.scalar(
        select(Remediation.id).where(
            Remediation.node_id == node.id, Remediation.state.in_(OPEN_STATES)
        )
    ):
        return None
    history = await repair_history(session, node.id)
    kinds = sorted({a.kind for a in alerts})
    action = recommend(kinds, history=history, now=now)
    if action is RepairAction.WARN:
        return None
    cluster = await session.get_one(Cluster, node.cluster_id)
    sick, total = await unhealthy_counts(session, cluster.id)
    last = max((p.finished_at for p in history), default=None)
    approval, why = needs_approval(
        policy_of(cluster),
        kinds,
        node_auto_repair=node.auto_repair,
        unhealthy_nodes=sick,
        cluster_nodes=total,
        last_repair_at=last,
        now=now,
        cooldown=timedelta(seconds=rt.settings.repair_cooldown_s),
    )
    alert_ids = sorted(a.id for a in alerts)
    digest = hashlib.sha256(",".join(alert_ids).encode()).hexdigest()[:16]
    key = f"auto:{node.id}:{digest}:{action.value}"
    if await session.scalar(select(Remediation.id).where(Remediation.idempotency_key == key)):
        return None  # recommended for exactly these alerts before (e.g. rejected)
    rem = Remediation(
        project_id=node.project_id,
        cluster_id=node.cluster_id,
        node_id=node.id,
        node_name=node.name,
        action=action.value,
        state="pending_approval" if approval else "pending",
        trigger="automated",
        reason="; ".join(a.message for a in sorted(alerts, key=lambda a: a.started_at)),
        kinds=",".join(kinds),
        requested_by="gpuclusters",
        idempotency_key=key,
        alert_ids=json.dumps(alert_ids),
        # Not over the limit now: automatic, once it has settled (the
        # repair reconciler decides it then, with the whole cluster counted).
        message=why or waiting_message(rules.SETTLE_WINDOW.total_seconds()),
        created_at=now,
        updated_at=now,
    )
    session.add(rem)
    await session.flush()
    rt.hints.notify(hints.REPAIRS)
    return rem


async def not_started_automatic(session: AsyncSession, cluster_id: str) -> list[Remediation]:
    """The cluster's automatic repairs that no person has looked at and that
    have not started (``pending``, not approved, not begun)."""
    return list(
        await session.scalars(
            select(Remediation)
            .where(
                Remediation.cluster_id == cluster_id,
                Remediation.state == "pending",
                Remediation.trigger == "automated",
                Remediation.reviewed_by.is_(None),
                Remediation.started_at.is_(None),
            )
            .order_by(Remediation.node_name)
        )
    )


async def hold_if_paused(session: AsyncSession, *, cluster_id: str) -> int:
    """If the cluster is over the unhealthy limit, hold every automatic
    repair of it that has not started: it waits for a person, with the
    reason. Returns how many were held (not committed).

    This is the set-level rule (``rules.decide_automatic``) applied as soon
    as alerts change; the repair reconciler applies it again before it
    starts one, so the outcome does not depend on this transaction seeing
    every other node's alerts."""
    waiting = await not_started_automatic(session, cluster_id)
    if not waiting:
        return 0
    now = utcnow()
    sick, total = await unhealthy_counts(session, cluster_id)
    decisions = decide_automatic(
        [WaitingRepair(r.node_name, r.created_at) for r in waiting],
        unhealthy_nodes=sick,
        cluster_nodes=total,
        now=now,
        settle=rules.SETTLE_WINDOW,
    )
    held = {d.node: d.reason for d in decisions if d.verdict is Verdict.HOLD}
    count = 0
    for r in waiting:
        if r.node_name not in held:
            continue
        # Only while it still has not started (the repair reconciler may be
        # starting it in another transaction: whichever commits first wins,
        # and the reconciler counts again before it starts).
        result = await session.execute(
            update(Remediation)
            .where(
                Remediation.id == r.id,
                Remediation.state == "pending",
                Remediation.started_at.is_(None),
            )
            .values(state="pending_approval", message=held[r.node_name], updated_at=now)
        )
        count += cast("CursorResult[Any]", result).rowcount
    return count


async def start_decision(
    session: AsyncSession, *, rt: Runtime, rem: Remediation, node: Node
) -> Decision:
    """Whether an automatic repair that has not started may start now, must
    wait (still settling) or must wait for a person: the node's own rules
    (policy, switch, cooldown, as they are now) and the cluster's unhealthy
    nodes counted now, as a set (``rules.decide_automatic``)."""
    now = utcnow()
    cluster = await session.get_one(Cluster, rem.cluster_id)
    sick, total = await unhealthy_counts(session, cluster.id)
    history = await repair_history(session, node.id)
    blocked = blocked_reason(
        policy_of(cluster),
        [k for k in rem.kinds.split(",") if k],
        node_auto_repair=node.auto_repair,
        last_repair_at=max((p.finished_at for p in history), default=None),
        now=now,
        cooldown=timedelta(seconds=rt.settings.repair_cooldown_s),
    )
    (decision,) = decide_automatic(
        [WaitingRepair(rem.node_name, rem.created_at, blocked)],
        unhealthy_nodes=sick,
        cluster_nodes=total,
        now=now,
        settle=rules.SETTLE_WINDOW,
    )
    return decision


async def note_missed_heartbeats(rt: Runtime, *, missed_after_s: float) -> int:
    """Open a critical ``heartbeat_missed`` alert on running nodes whose
    agent has been silent for ``missed_after_s`` (never deletes anything:
    an unknown state is repaired with approval, not removed)."""
    cutoff = utcnow() - timedelta(seconds=missed_after_s)
    opened = 0
    async with rt.sessionmaker() as session:
        nodes = list(
            await session.scalars(
                select(Node).where(
                    Node.deleted_at.is_(None),
                    Node.phase == NodePhase.RUNNING.value,
                    Node.last_heartbeat_at.is_not(None),
                    Node.last_heartbeat_at < cutoff,
                )
            )
        )
        for node in nodes:
            # A node that (re)joined recently has not had time to beat yet.
            if node.ready_at is not None and node.ready_at >= cutoff:
                continue
            if await session.scalar(
                select(Alert.id).where(
                    Alert.node_id == node.id,
                    Alert.kind == AlertKind.HEARTBEAT_MISSED.value,
                    Alert.resolved_at.is_(None),
                )
            ):
                continue
            assert node.last_heartbeat_at is not None
            silent = (utcnow() - node.last_heartbeat_at).total_seconds()
            session.add(
                Alert(
                    project_id=node.project_id,
                    cluster_id=node.cluster_id,
                    node_id=node.id,
                    node_name=node.name,
                    kind=AlertKind.HEARTBEAT_MISSED.value,
                    severity=Severity.CRITICAL.value,
                    message=f"no heartbeat from the node agent for {silent:.0f}s",
                )
            )
            await session.flush()
            await recommend_repair(session, rt=rt, node=node)
            opened += 1
        await session.commit()
    return opened
