"""The autoscaler: autoscaled clusters follow what their scheduler asks for
(core/autoscale.py, docs/autoscaling.md).

Every ``autoscale_interval_s`` the holder of the ``autoscaler`` lease (one
replica) reads each autoscaled cluster's scheduler through its layer
(``scale_signals``: for Slurm, each slot's power state in ``sinfo``) and
acts on the difference, level-triggered:

- a slot Slurm powers up for waiting work gets a node: the same placement
  a scale-up uses, checked against the project's quotas, inside one
  transaction with the cluster row locked; a refusal (quota, capacity) is
  a ``ScaleUpBlocked`` event naming why, asked again at the next pass
  (while Slurm still wants the slot), never an error loop;
- a node whose slot Slurm powered down after the idle time is marked for
  release (``to_delete``, reason ``autoscale``; the node reconciler drains
  and releases it) if nothing runs there: neither Slurm nor the layer's
  ``running_work`` (jobs, non-daemon pods) may count any work, and the
  cluster never goes below ``min_gpus``. A node kept is a
  ``ScaleDownDeferred`` event.

``num_gpus`` follows: +8 for each node added, -8 for each released, so
``clusters get`` shows the cluster's size. The cluster stays ``ready``
while nodes come and go (a node still booting does not degrade an
autoscaled cluster): users keep working on it. No I/O happens inside a
transaction: the scheduler is read first, then the decision is re-checked
against the rows under the lock (a node another replica added for the slot
in between is not added twice).
"""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.autoscale import (
    DEFAULT_IDLE_S,
    Decision,
    ScaleSignals,
    decide,
    decide_demand,
    free_slots,
)
from gpuclusters.core.enums import (
    GPUS_PER_NODE,
    ClusterStatus,
    ComputeClass,
    EventReason,
    NodePhase,
)
from gpuclusters.core.errors import (
    BudgetExhaustedError,
    CapacityUnavailableError,
    QuotaExceededError,
)
from gpuclusters.core.quotas import Amounts
from gpuclusters.layers.base import ClusterLayer, ClusterRef, NodeRef
from gpuclusters.server.controllers import hints, leases
from gpuclusters.server.controllers.refs import cluster_ref, node_ref, work_probe
from gpuclusters.server.db.allocation import allocate_nodes, placement_guard
from gpuclusters.server.db.budgets import refuse_new_nodes
from gpuclusters.server.db.models import Cluster, Host, Node, Project
from gpuclusters.server.db.quotas import enforce
from gpuclusters.server.db.records import (
    record_cluster_event,
    record_event,
)
from gpuclusters.server.runtime import Runtime

log = logging.getLogger(__name__)

AUTOSCALER_LEASE = "autoscaler"
DELETE_REASON = "autoscale"
# Clusters whose size the autoscaler may change: up and running (a cluster
# still coming up, being deleted or failed is left alone).
ACTIVE = (
    ClusterStatus.READY.value,
    ClusterStatus.DEGRADED.value,
    ClusterStatus.WAITING_FOR_NODES.value,
)


async def autoscaled_clusters(rt: Runtime) -> list[str]:
    async with rt.sessionmaker() as session:
        return list(
            await session.scalars(
                select(Cluster.id)
                .where(
                    Cluster.deleted_at.is_(None),
                    Cluster.autoscale_max_gpus.is_not(None),
                    Cluster.status.in_(ACTIVE),
                    Cluster.nodes_placed.is_(True),
                )
                .order_by(Cluster.created_at)
            )
        )


async def autoscale_pass(rt: Runtime) -> dict[str, Decision]:
    """One look at every autoscaled cluster; one failing does not stop the rest."""
    out: dict[str, Decision] = {}
    for cluster_id in await autoscaled_clusters(rt):
        try:
            decision = await autoscale_cluster(rt, cluster_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("autoscaler: cluster %s", cluster_id)
            continue
        if decision is not None:
            out[cluster_id] = decision
    return out


async def autoscale_cluster(rt: Runtime, cluster_id: str) -> Decision | None:
    async with rt.sessionmaker() as session:
        cluster = await session.get(Cluster, cluster_id)
        if cluster is None or cluster.autoscale_max_gpus is None:
            return None
        nodes = await _standard_nodes(session, cluster_id)
        hosts = {
            h.id: h
            for h in await session.scalars(
                select(Host).where(Host.id.in_([n.host_id for n in nodes if n.host_id]))
            )
        }
        cref = cluster_ref(cluster)
        refs = {n.name: node_ref(n, hosts.get(n.host_id or "")) for n in nodes}
        min_gpus, max_gpus = cluster.autoscale_min_gpus or 0, cluster.autoscale_max_gpus
    layer = rt.layer_for(cref.cluster_type)
    signals = await layer.scale_signals(cref)
    if signals is None:
        return None
    if signals.by_pods:
        decision = await _decide_by_pods(
            layer, cref, refs, nodes, signals, min_gpus=min_gpus, max_gpus=max_gpus
        )
    else:
        decision = await _decide_by_slots(
            layer, cref, refs, nodes, signals, min_gpus=min_gpus, max_gpus=max_gpus
        )
    if decision.empty and not decision.kept:
        return decision
    await _apply(rt, cluster_id, decision, signals)
    return decision


async def _decide_by_slots(
    layer: ClusterLayer,
    cref: ClusterRef,
    refs: dict[str, NodeRef],
    nodes: list[Node],
    signals: ScaleSignals,
    *,
    min_gpus: int,
    max_gpus: int,
) -> Decision:
    """Slurm: follow each slot's power state."""
    staying = {n.slot: n.name for n in nodes if n.slot and not n.to_delete}
    released = {s.name for s in signals.slots if s.released and not s.wants_up}
    # Slurm's view first; the layer's count (pods too) for the nodes it
    # would release.
    busy = [
        n.name
        for n in nodes
        if n.slot in released
        and not n.to_delete
        and n.phase == NodePhase.RUNNING.value
        and await layer.running_work(cref, refs[n.name]) > 0
    ]
    return decide(
        signals,
        staying,
        held={n.slot for n in nodes if n.slot},
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        busy_nodes=busy,
    )


# When each running node of a pod-driven cluster was first seen without
# work, by node id. In memory: a restarted server starts the idle clocks
# again, which only ever keeps a node longer.
_IDLE_SINCE: dict[str, float] = {}


async def _decide_by_pods(
    layer: ClusterLayer,
    cref: ClusterRef,
    refs: dict[str, NodeRef],
    nodes: list[Node],
    signals: ScaleSignals,
    *,
    min_gpus: int,
    max_gpus: int,
) -> Decision:
    """Kubernetes: nodes for the pods that cannot be scheduled, and the
    release of nodes idle past the cluster's idle time."""
    now = time.monotonic()
    staying = [n for n in nodes if not n.to_delete]
    running = [n for n in staying if n.phase == NodePhase.RUNNING.value]
    joining = [n for n in staying if n.phase not in (NodePhase.RUNNING.value, "failed")]
    idle_for: dict[str, float] = {}
    for n in running:
        if await layer.running_work(cref, refs[n.name]) > 0:
            _IDLE_SINCE.pop(n.id, None)
        else:
            idle_for[n.name] = now - _IDLE_SINCE.setdefault(n.id, now)
    for gone in set(_IDLE_SINCE) - {n.id for n in nodes}:
        del _IDLE_SINCE[gone]
    all_slots = cref.autoscale.slots if cref.autoscale else ()
    return decide_demand(
        pending_gpus=signals.pending_gpus,
        joining=len(joining),
        live=len(staying),
        free=free_slots(all_slots, (n.slot for n in nodes), len(all_slots)),
        idle_for=idle_for,
        idle_s=cref.autoscale.idle_s if cref.autoscale else DEFAULT_IDLE_S,
        min_gpus=min_gpus,
        max_gpus=max_gpus,
    )


async def _standard_nodes(session: AsyncSession, cluster_id: str) -> list[Node]:
    return list(
        await session.scalars(
            select(Node).where(
                Node.cluster_id == cluster_id,
                Node.deleted_at.is_(None),
                Node.compute_class == ComputeClass.STANDARD.value,
            )
        )
    )


def _waiting(signals: ScaleSignals) -> str:
    if not signals.pending_jobs:
        return "waiting work"
    shown = ", ".join(signals.pending_jobs[:5])
    more = f" and {len(signals.pending_jobs) - 5} more" if len(signals.pending_jobs) > 5 else ""
    what = "pod(s)" if signals.by_pods else "job(s)"
    return f"pending {what} {shown}{more}"


async def _apply(rt: Runtime, cluster_id: str, decision: Decision, signals: ScaleSignals) -> None:
    async with rt.sessionmaker() as session, placement_guard(session, rt.placement_lock):
        cluster = (
            await session.execute(select(Cluster).where(Cluster.id == cluster_id).with_for_update())
        ).scalar_one()
        if cluster.deleted_at is not None or cluster.status not in ACTIVE:
            return
        nodes = await _standard_nodes(session, cluster_id)
        held = {n.slot for n in nodes if n.slot}
        by_name = {n.name: n for n in nodes}
        project = await session.get_one(Project, cluster.project_id)
        for slot in decision.add:
            if slot in held:
                continue  # added meanwhile (another replica, an earlier pass)
            why = _waiting(signals)
            try:
                await enforce(session, project, Amounts(standard_gpus=GPUS_PER_NODE))
                await refuse_new_nodes(session, project.id, what=slot)
                added = await allocate_nodes(
                    session,
                    cluster=cluster,
                    count=1,
                    compute_class=ComputeClass.STANDARD.value,
                    work=work_probe(session, rt),
                    deadlines=rt.settings.node_phase_deadlines_s,
                    slots=[slot],
                )
            except (QuotaExceededError, BudgetExhaustedError, CapacityUnavailableError) as exc:
                await record_cluster_event(
                    session,
                    cluster,
                    slot,
                    EventReason.SCALE_UP_BLOCKED,
                    f"{'a node' if signals.by_pods else 'Slurm asked'} for {slot} ({why}); "
                    f"not added: {exc.message}",
                )
                continue
            cluster.num_gpus += GPUS_PER_NODE
            await session.flush()
            for node in added:
                await record_event(
                    session,
                    node,
                    EventReason.SCALED_UP,
                    f"node {node.name} added as {slot} for {why}: scaled to "
                    f"{cluster.num_gpus} GPUs (max {cluster.autoscale_max_gpus})",
                )
        for name in decision.remove:
            leaving = by_name.get(name)
            if leaving is None or leaving.to_delete:
                continue
            node = leaving
            node.to_delete, node.delete_reason = True, DELETE_REASON
            cluster.num_gpus = max(0, cluster.num_gpus - GPUS_PER_NODE)
            why = decision.why_removed.get(
                name, f"idle for {cluster.autoscale_idle_s} s: Slurm powered it down"
            )
            await record_event(
                session,
                node,
                EventReason.SCALED_DOWN,
                f"node {name} ({node.slot}) {why}; released, scaled to {cluster.num_gpus} "
                f"GPUs (min {cluster.autoscale_min_gpus or 0})",
            )
        for name, why in decision.kept.items():
            kept = by_name.get(name)
            if kept is not None:
                await record_event(
                    session,
                    kept,
                    EventReason.SCALE_DOWN_DEFERRED,
                    f"node {name} ({kept.slot}) is idle past its time but stays: {why}",
                )
        await session.commit()
    rt.hints.notify_rows(hints.CLUSTERS, [cluster_id])
    rt.hints.notify(hints.NODES)


async def run_autoscaler(rt: Runtime) -> None:
    """Loop until cancelled while holding the autoscaler lease."""
    await leases.run_singleton(
        rt.sessionmaker,
        AUTOSCALER_LEASE,
        interval_s=rt.settings.autoscale_interval_s,
        ttl_s=2 * rt.settings.autoscale_interval_s + rt.settings.lease_ttl_s,
        work=lambda: autoscale_pass(rt),
    )
