"""The fleet's state as Prometheus gauges on every replica's ``/metrics``:
nodes by phase and class, clusters by status, open alerts by kind, repairs
by state, GPUs by type and state (free, held by a standard or preemptible
node, cordoned, ...), hosts' agents by status, and leases that expired
while held (a replica died: its rows await take-over).

They are counted from the database every ``INTERVAL_S`` (a few GROUP BY
queries, milliseconds at 10,000 nodes), not at each scrape: a scrape must
answer fast whoever asks, and every replica shows the same fleet. A label
set that is gone (no node left in a phase) is cleared, not left at its last
value.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import Gauge, Histogram
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.server.db.models import (
    Alert,
    Cluster,
    HealthRun,
    Host,
    Node,
    Remediation,
    Volume,
    utcnow,
)
from gpuclusters.server.runtime import Runtime

log = logging.getLogger(__name__)

INTERVAL_S = 15.0

NODES = Gauge("gpuclusters_nodes", "Live nodes", ["phase", "compute_class"])
CLUSTERS = Gauge("gpuclusters_clusters", "Clusters not deleted", ["status"])
ALERTS = Gauge("gpuclusters_alerts_open", "Open health alerts", ["kind", "severity"])
REPAIRS = Gauge("gpuclusters_repairs", "Repairs not finished", ["state", "action"])
GPUS = Gauge(
    "gpuclusters_gpus",
    "GPUs of the fleet's hosts: free, held by a node (its class), or the host's state",
    ["gpu_type", "state"],
)
HOST_AGENTS = Gauge("gpuclusters_host_agents", "Hosts with a host agent", ["status"])
LEASES_EXPIRED = Gauge(
    "gpuclusters_leases_expired",
    "Rows whose lease ran out while held (its replica died or stalled): awaiting take-over",
    ["table"],
)
REFRESH_SECONDS = Histogram(
    "gpuclusters_fleet_metrics_refresh_seconds", "Time to count the fleet for these gauges"
)


def _set(gauge: Gauge, rows: Iterable[Sequence[Any]]) -> None:
    gauge.clear()
    for *labels, value in rows:
        gauge.labels(*(str(label) for label in labels)).set(float(value or 0))


async def refresh(session: AsyncSession) -> None:
    live = Node.deleted_at.is_(None)
    _set(
        NODES,
        await session.execute(
            select(Node.phase, Node.compute_class, func.count()).where(live)
            .group_by(Node.phase, Node.compute_class)
        ),
    )  # fmt: skip
    _set(
        CLUSTERS,
        await session.execute(
            select(Cluster.status, func.count()).where(Cluster.deleted_at.is_(None))
            .group_by(Cluster.status)
        ),
    )  # fmt: skip
    _set(
        ALERTS,
        await session.execute(
            select(Alert.kind, Alert.severity, func.count()).where(Alert.resolved_at.is_(None))
            .group_by(Alert.kind, Alert.severity)
        ),
    )  # fmt: skip
    _set(
        REPAIRS,
        await session.execute(
            select(Remediation.state, Remediation.action, func.count())
            .where(Remediation.finished_at.is_(None))
            .group_by(Remediation.state, Remediation.action)
        ),
    )  # fmt: skip
    # A host's GPUs are held by its live node (one per host), else free when
    # the host is available, else counted under the host's state.
    holder = (
        select(Node.host_id, Node.compute_class).where(live, Node.host_id.is_not(None)).subquery()
    )
    state = func.coalesce(
        holder.c.compute_class,
        func.nullif(Host.state, "available"),
        "free",
    )
    _set(
        GPUS,
        await session.execute(
            select(Host.gpu_type, state, func.sum(Host.num_gpus))
            .outerjoin(holder, holder.c.host_id == Host.id)
            .where(Host.in_fleet.is_(True))
            .group_by(Host.gpu_type, state)
        ),
    )
    _set(LEASES_EXPIRED, await _expired_leases(session))
    _set(
        HOST_AGENTS,
        await session.execute(
            select(Host.agent_status, func.count()).where(Host.agent_status.is_not(None))
            .group_by(Host.agent_status)
        ),
    )  # fmt: skip


async def _expired_leases(session: AsyncSession) -> list[tuple[str, int]]:
    """Per leased table, rows a lease still names though it expired: a
    release clears the owner, so these are leases of a replica that died or
    stalled, which the next claim takes over."""
    now = utcnow()
    out = []
    for model in (Cluster, Node, Volume, Remediation, HealthRun):
        count = await session.scalar(
            select(func.count()).where(model.lock_owner.is_not(None), model.lock_expires_at < now)
        )
        out.append((model.__tablename__, int(count or 0)))
    return out


async def keep_fleet_metrics(rt: Runtime, interval_s: float = INTERVAL_S) -> None:
    """Refresh the gauges until cancelled; a failed refresh is logged and
    tried again at the next interval."""
    while True:
        try:
            with REFRESH_SECONDS.time():
                async with rt.sessionmaker() as session:
                    await refresh(session)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("fleet metrics refresh failed")
        await asyncio.sleep(interval_s)
