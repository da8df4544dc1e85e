"""Database rows -> public API models. Loads in bulk (one query per table,
not per row) so listing many clusters stays cheap."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Row, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.autoscale import DEFAULT_IDLE_S
from gpuclusters.core.capacity.reservations import split
from gpuclusters.core.enums import GPUS_PER_NODE, ClusterType, ComputeClass, NodePhase
from gpuclusters.server.db.capacity import project_windows
from gpuclusters.server.db.models import (
    Cluster,
    ClusterPhase,
    Host,
    Node,
    Project,
    Volume,
    utcnow,
)


def slurm_settings(cluster: Cluster) -> api.SlurmSettings | None:
    if cluster.cluster_type != ClusterType.SLURM.value:
        return None
    return api.SlurmSettings(
        extra_config=cluster.slurm_extra_config,
        prolog=cluster.slurm_prolog,
        epilog=cluster.slurm_epilog,
    )


# What a node's view reads: an ORM row, or a plain row of these columns
# (lists load plain rows: no identity map, a third of the cost).
NODE_VIEW_COLUMNS = (
    Node.id,
    Node.cluster_id,
    Node.host_id,
    Node.name,
    Node.compute_class,
    Node.phase,
    Node.cordoned,
    Node.address,
    Node.message,
    Node.created_at,
    Node.ready_at,
    Node.last_heartbeat_at,
    Node.deleted_at,
    Node.auto_repair,
    Node.gpu_backend,
    Node.retries,
    Node.last_error,
    Node.next_attempt_at,
    Node.phase_deadline_at,
)
NodeLike = Node | Row[Any]


def node_view(node: NodeLike, *, cluster: Cluster, host: str | None) -> api.Node:
    # Built without validation: every value comes from a typed column (and
    # the two enums are made here), and a cluster list holds hundreds of
    # nodes, where validating each was the largest cost of the request.
    return api.Node.model_construct(
        name=node.name,
        cluster=cluster.name,
        host=host,
        compute_class=ComputeClass(node.compute_class),
        phase=NodePhase(node.phase),
        gpu_type=cluster.gpu_type,
        cordoned=node.cordoned,
        address=node.address,
        message=node.message,
        created_at=node.created_at,
        ready_at=node.ready_at,
        last_heartbeat_at=node.last_heartbeat_at,
        deleted_at=node.deleted_at,
        auto_repair=node.auto_repair,
        gpu_backend=node.gpu_backend,
        retries=node.retries,
        last_error=node.last_error,
        next_attempt_at=node.next_attempt_at,
        phase_deadline_at=node.phase_deadline_at,
    )


async def host_names(session: AsyncSession, ids: set[str]) -> dict[str, str]:
    """Host names by id (just the two columns: host rows carry inventories)."""
    if not ids:
        return {}
    rows = await session.execute(select(Host.id, Host.name).where(Host.id.in_(ids)))
    return {host_id: name for host_id, name in rows}


async def node_views(
    session: AsyncSession, nodes: Sequence[NodeLike], *, clusters: dict[str, Cluster]
) -> list[api.Node]:
    hosts = await host_names(session, {n.host_id for n in nodes if n.host_id})
    return [
        node_view(n, cluster=clusters[n.cluster_id], host=hosts.get(n.host_id or "")) for n in nodes
    ]


async def capacity_splits(
    session: AsyncSession, clusters: Sequence[Cluster], *, project: Project
) -> dict[str, api.CapacitySplit]:
    """How each cluster's standard GPUs are paid for now: the project's
    active reserved and pool windows are shared out over its live clusters
    of that GPU type and region in creation order; the rest is on-demand."""
    now = utcnow()
    out: dict[str, api.CapacitySplit] = {}
    for gpu_type, region in {(c.gpu_type, c.region) for c in clusters}:
        held = await project_windows(
            session, project_id=project.id, gpu_type=gpu_type, region=region, at=now
        )
        if not any(held.values()):
            # No reservation or pool: all on demand, whatever the peers are.
            for c in clusters:
                if (c.gpu_type, c.region) == (gpu_type, region):
                    gpus = c.num_gpus if c.nodes_placed else 0
                    out[c.id] = api.CapacitySplit(reserved_gpus=0, pool_gpus=0, on_demand_gpus=gpus)
            continue
        peers = await session.execute(
            select(Cluster.id, Cluster.num_gpus, Cluster.nodes_placed)
            .where(
                Cluster.project_id == project.id,
                Cluster.gpu_type == gpu_type,
                Cluster.region == region,
                Cluster.deleted_at.is_(None),
            )
            .order_by(Cluster.created_at, Cluster.name)
        )
        parts = split(
            [(cid, gpus if placed else 0) for cid, gpus, placed in peers],
            reserved=held.get("reserved", 0),
            pool=held.get("pool", 0),
        )
        for cid, part in parts.items():
            out[cid] = api.CapacitySplit(
                reserved_gpus=part.reserved, pool_gpus=part.pool, on_demand_gpus=part.on_demand
            )
    return out


async def cluster_views(
    session: AsyncSession, clusters: Sequence[Cluster], *, project: Project
) -> list[api.Cluster]:
    if not clusters:
        return []
    ids = [c.id for c in clusters]
    by_id = {c.id: c for c in clusters}
    # With their hosts' names in the same query (hosts are never deleted).
    nodes: list[Row[Any]] = list(
        await session.execute(
            select(*NODE_VIEW_COLUMNS, Host.name.label("host_name"))
            .outerjoin(Host, Host.id == Node.host_id)
            .where(Node.cluster_id.in_(ids), Node.deleted_at.is_(None))
            .order_by(Node.created_at, Node.name)
        )
    )
    phases: dict[str, list[api.PhaseTransition]] = defaultdict(list)
    for cluster_id, phase, timestamp, message in await session.execute(
        select(
            ClusterPhase.cluster_id,
            ClusterPhase.phase,
            ClusterPhase.timestamp,
            ClusterPhase.message,
        )
        .where(ClusterPhase.cluster_id.in_(ids))
        .order_by(ClusterPhase.seq)
    ):
        phases[cluster_id].append(
            api.PhaseTransition(phase=phase, timestamp=timestamp, message=message)
        )
    volume_ids = {c.volume_id for c in clusters if c.volume_id}
    volumes = (
        {
            v.id: v.name
            for v in await session.scalars(select(Volume).where(Volume.id.in_(volume_ids)))
        }
        if volume_ids
        else {}
    )
    nviews = [node_view(n, cluster=by_id[n.cluster_id], host=n.host_name) for n in nodes]
    splits = await capacity_splits(session, clusters, project=project)
    nodes_by_cluster: dict[str, list[api.Node]] = defaultdict(list)
    for row, view in zip(nodes, nviews, strict=True):
        nodes_by_cluster[row.cluster_id].append(view)

    out = []
    for c in clusters:
        cnodes = nodes_by_cluster[c.id]
        allocated = sum(
            GPUS_PER_NODE
            for n in cnodes
            if n.compute_class is ComputeClass.PREEMPTIBLE and n.phase is NodePhase.RUNNING
        )
        out.append(
            api.Cluster(
                name=c.name,
                project=project.name,
                cluster_type=c.cluster_type,
                gpu_type=c.gpu_type,
                region=c.region,
                num_gpus=c.num_gpus,
                num_preemptible_gpus=c.num_preemptible_gpus,
                desired_preemptible_gpus=c.num_preemptible_gpus,
                allocated_preemptible_gpus=allocated,
                billing_type=c.billing_type,
                reservation_start=c.reservation_start,
                reservation_end=c.reservation_end,
                start_at=c.start_at,
                capacity=splits.get(c.id),
                status=c.status,
                status_message=c.status_message,
                retries=c.retries,
                last_error=c.last_error,
                next_attempt_at=c.next_attempt_at,
                phase_deadline_at=c.phase_deadline_at,
                force_delete_reason=c.force_delete_reason,
                volume=volumes.get(c.volume_id or ""),
                cuda_version=c.cuda_version,
                driver_version=c.driver_version,
                slurm=slurm_settings(c),
                repair=api.RepairSettings(
                    automatic=[k for k in c.repair_automatic.split(",") if k],
                    max_wait_s=c.repair_max_wait_s,
                ),
                egress=c.egress,
                autoscaling=(
                    api.AutoscalingSettings(
                        min_gpus=c.autoscale_min_gpus or 0,
                        max_gpus=c.autoscale_max_gpus,
                        idle_s=c.autoscale_idle_s or DEFAULT_IDLE_S,
                    )
                    if c.autoscale_max_gpus is not None
                    else None
                ),
                ssh_endpoint=(
                    api.Endpoint(host=c.gateway_host, port=c.ssh_port)
                    if c.gateway_host and c.ssh_port
                    else None
                ),
                kubernetes_endpoint=(
                    f"https://{_url_host(c.gateway_host)}:{c.kubernetes_port}"
                    if c.gateway_host and c.kubernetes_port
                    else None
                ),
                phase_history=phases[c.id],
                nodes=cnodes,
                created_at=c.created_at,
                updated_at=c.updated_at,
                deleted_at=c.deleted_at,
            )
        )
    return out


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def cluster_view(session: AsyncSession, cluster: Cluster, *, project: Project) -> api.Cluster:
    return (await cluster_views(session, [cluster], project=project))[0]


def volume_view(volume: Volume, *, project: Project, cluster_name: str | None) -> api.Volume:
    return api.Volume(
        name=volume.name,
        project=project.name,
        region=volume.region,
        size_tib=volume.size_tib,
        status=volume.status,
        is_lifecycle_independent=volume.is_lifecycle_independent,
        cluster=cluster_name,
        created_at=volume.created_at,
        deleted_at=volume.deleted_at,
    )
