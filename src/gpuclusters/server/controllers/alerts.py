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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.enums import NodePhase
from gpuclusters.core.health.findings import AlertKind, Severity, alert_key
from gpuclusters.core.health.rules import (
    PastRepair,
    Policy,
    RepairAction,
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
    """Record the repair the node's open alerts call for (see module doc)."""
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
    history = [
        PastRepair(
            action=RepairAction(r.action),
            kinds=frozenset(k for k in r.kinds.split(",") if k),
            finished_at=r.finished_at or r.updated_at,
            succeeded=True,
        )
        for r in await session.scalars(
            select(Remediation).where(
                Remediation.node_id == node.id, Remediation.state == "succeeded"
            )
        )
    ]
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
        message=why,
        created_at=now,
        updated_at=now,
    )
    session.add(rem)
    await session.flush()
    rt.hints.notify(hints.REPAIRS)
    return rem


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
