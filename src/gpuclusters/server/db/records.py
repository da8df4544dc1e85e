"""Small write helpers shared by services and controllers: cluster status
changes with their phase history, and deduplicated node lifecycle events.
They only add to the caller's session; the caller owns the transaction."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.deadlines import (
    CLUSTER_PHASE_DEADLINES_S,
    NODE_PHASE_DEADLINES_S,
    deadline_at,
)
from gpuclusters.core.enums import GPUS_PER_NODE
from gpuclusters.server.db.capacity import billing_for
from gpuclusters.server.db.dialects import upsert_insert
from gpuclusters.server.db.models import (
    Cluster,
    ClusterPhase,
    Node,
    NodeEvent,
    UsageRecord,
    new_id,
    utcnow,
)


async def set_cluster_status(
    session: AsyncSession,
    cluster: Cluster,
    status: str,
    message: str = "",
    *,
    deadlines: Mapping[str, float] | None = None,
) -> bool:
    """Move the cluster to ``status`` and append it to the phase history;
    a new status gets its deadline (``deadlines``: settings'
    cluster_phase_deadlines_s, else the defaults) and a clean retry record.
    Returns False (and writes nothing) if it is already there."""
    if cluster.status == status and cluster.status_message == message:
        return False
    now = utcnow()
    if cluster.status != status:
        cluster.phase_deadline_at = deadline_at(
            CLUSTER_PHASE_DEADLINES_S if deadlines is None else deadlines, status, now
        )
        forget_failures(cluster)
        seq = (
            await session.scalar(
                select(func.coalesce(func.max(ClusterPhase.seq), 0)).where(
                    ClusterPhase.cluster_id == cluster.id
                )
            )
        ) or 0
        session.add(
            ClusterPhase(
                cluster_id=cluster.id, seq=seq + 1, phase=status, message=message, timestamp=now
            )
        )
    cluster.status = status
    cluster.status_message = message
    cluster.updated_at = now
    return True


async def record_event(session: AsyncSession, node: Node, reason: str, message: str) -> None:
    """Add a lifecycle event, or refresh the one this node already has for
    this reason (events are deduplicated by node and reason)."""
    await _upsert_event(
        session,
        project_id=node.project_id,
        cluster_id=node.cluster_id,
        node_id=node.id,
        node_name=node.name,
        reason=reason,
        message=message,
    )


async def record_cluster_event(
    session: AsyncSession, cluster: Cluster, subject: str, reason: str, message: str
) -> None:
    """An event about a cluster's part that has no node (an autoscaled
    cluster's slot): listed with node events under ``subject``,
    deduplicated by cluster, subject and reason."""
    await _upsert_event(
        session,
        project_id=cluster.project_id,
        cluster_id=cluster.id,
        node_id=hashlib.sha256(f"{cluster.id}/{subject}".encode()).hexdigest()[:32],
        node_name=subject,
        reason=reason,
        message=message,
    )


async def _upsert_event(
    session: AsyncSession,
    *,
    project_id: str,
    cluster_id: str,
    node_id: str,
    node_name: str,
    reason: str,
    message: str,
) -> None:
    now = utcnow()
    # One statement either way (the row is unique by node and reason).
    insert = upsert_insert(session, NodeEvent).values(
        id=new_id(),
        project_id=project_id,
        cluster_id=cluster_id,
        node_id=node_id,
        node_name=node_name,
        reason=reason,
        message=message,
        count=1,
        first_timestamp=now,
        timestamp=now,
    )
    await session.execute(
        insert.on_conflict_do_update(
            index_elements=[NodeEvent.node_id, NodeEvent.reason],
            set_={
                "count": NodeEvent.count + 1,
                "message": insert.excluded.message,
                "timestamp": insert.excluded.timestamp,
            },
        )
    )


def node_phase_values(
    phase: str,
    message: Any = "",
    *,
    deadlines: Mapping[str, float] | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The columns a move of a node to a new ``phase`` writes: the phase,
    its message, when it was entered, its deadline (``deadlines``: settings'
    node_phase_deadlines_s, else the defaults) and a clean retry record.
    For UPDATE statements that move nodes without loading them (``message``
    may be a SQL expression there), and for ``set_node_phase``."""
    now = now or utcnow()
    return {
        "phase": phase,
        "message": message,
        "phase_changed_at": now,
        "phase_deadline_at": deadline_at(
            NODE_PHASE_DEADLINES_S if deadlines is None else deadlines, phase, now
        ),
        "retries": 0,
        "last_error": None,
        "next_attempt_at": None,
    }


def set_node_phase(
    node: Node, phase: str, message: str = "", *, deadlines: Mapping[str, float] | None = None
) -> None:
    """Move the loaded ``node`` to ``phase`` (``node_phase_values``); the
    retry record is cleared only if the phase changes."""
    values = node_phase_values(phase, message, deadlines=deadlines)
    if node.phase == phase:
        for kept in ("retries", "last_error", "next_attempt_at"):
            del values[kept]
    for column, value in values.items():
        setattr(node, column, value)


def forget_failures(row: Node | Cluster) -> None:
    """Clear a row's retry record: it moved on, or was asked for something
    new (a delete), which is tried at once rather than after the backoff."""
    row.retries = 0
    row.last_error = None
    row.next_attempt_at = None


async def open_usage(
    session: AsyncSession, node: Node, cluster: Cluster, *, never_live: bool = False
) -> None:
    """Start metering a node that went live; a no-op if it is metered already
    (a step repeated after a crash opens no second record). ``never_live``:
    the caller saw the node had never been live (no ``ready_at``), so no
    record can be open (usage opens in the transaction that sets
    ``ready_at``) and the look-up is skipped."""
    if not never_live and await _open_usage(session, node.id) is not None:
        return
    now = utcnow()
    session.add(
        UsageRecord(
            project_id=node.project_id,
            cluster_id=cluster.id,
            cluster_name=cluster.name,
            node_id=node.id,
            node_name=node.name,
            gpu_type=cluster.gpu_type,
            compute_class=node.compute_class,
            billing=await billing_for(session, node, cluster, now),
            num_gpus=GPUS_PER_NODE,
            started_at=now,
            user_name=cluster.created_by or "",
        )
    )


async def close_usage(session: AsyncSession, node: Node) -> None:
    """Stop metering a node (released, failed or lost); a no-op if not metered."""
    if node.ready_at is None:
        return  # never went live, so never metered (usage opens with ready_at)
    record = await _open_usage(session, node.id)
    if record is not None:
        record.ended_at = utcnow()


async def _open_usage(session: AsyncSession, node_id: str) -> UsageRecord | None:
    return await session.scalar(
        select(UsageRecord).where(UsageRecord.node_id == node_id, UsageRecord.ended_at.is_(None))
    )
