"""Cluster use cases: create, list, get, update (scale / extend), delete.

Create and scale place their nodes synchronously, inside the same
transaction as the cluster change, so the caller learns at once when there
is no capacity and a crash can never leave a cluster without its node rows
(or nodes without their cluster). Controllers then do the slow work.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.capacity.scale_down import NodeSnapshot, choose_nodes_to_remove
from gpuclusters.core.catalog import GPU_TYPES
from gpuclusters.core.enums import (
    GPUS_PER_NODE,
    BillingType,
    ClusterStatus,
    ClusterType,
    ComputeClass,
    EventReason,
    NodePhase,
    ProjectRole,
    VolumeStatus,
)
from gpuclusters.core.errors import (
    AlreadyExistsError,
    CapacityUnavailableError,
    InvalidStateError,
    NotFoundError,
    ValidationError,
)
from gpuclusters.core.paging import Page
from gpuclusters.core.quotas import Amounts
from gpuclusters.layers.slurm.config import validate_extra_slurm_conf
from gpuclusters.server.controllers import hints
from gpuclusters.server.controllers.refs import cluster_ref, node_ref, work_probe
from gpuclusters.server.db.allocation import allocate_nodes, placement_guard
from gpuclusters.server.db.budgets import refuse_new_nodes
from gpuclusters.server.db.gateway import assign_ports
from gpuclusters.server.db.models import Cluster, Host, Node, Project, Volume, utcnow
from gpuclusters.server.db.paging import page_of
from gpuclusters.server.db.records import forget_failures, record_event, set_cluster_status
from gpuclusters.server.db.scaling import live_nodes, set_preemptible_target
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services import quotas
from gpuclusters.server.services.catalog import check_region
from gpuclusters.server.services.health import check_policy_kinds
from gpuclusters.server.services.tenancy import require_org_admin, resolve_project
from gpuclusters.server.services.views import cluster_view, cluster_views

# Concurrent creates may race for the same host; the unique index makes the
# loser fail, and it simply places again with a fresh view of the fleet.
PLACEMENT_ATTEMPTS = 3


async def _get_live(session: AsyncSession, project: Project, name: str) -> Cluster:
    cluster = await session.scalar(
        select(Cluster).where(
            Cluster.project_id == project.id, Cluster.name == name, Cluster.deleted_at.is_(None)
        )
    )
    if cluster is None:
        raise NotFoundError(f"cluster {name!r} not found in project {project.name!r}", field="name")
    return cluster


async def _check_region(session: AsyncSession, *, region: str, gpu_type: str) -> None:
    if gpu_type not in GPU_TYPES:
        raise ValidationError(
            f"gpu_type: unknown GPU type {gpu_type!r}; known: {', '.join(sorted(GPU_TYPES))}",
            field="gpu_type",
        )
    await check_region(session, region)


async def _volume_for_create(
    session: AsyncSession, *, project: Project, body: api.ClusterCreate, region: str
) -> Volume:
    if body.volume is not None:
        volume = await session.scalar(
            select(Volume).where(
                Volume.project_id == project.id,
                Volume.name == body.volume,
                Volume.deleted_at.is_(None),
            )
        )
        if volume is None:
            raise NotFoundError(f"volume {body.volume!r} not found", field="volume")
        if volume.cluster_id is not None or volume.status not in (
            VolumeStatus.AVAILABLE.value,
            VolumeStatus.PROVISIONING.value,
        ):
            raise InvalidStateError(
                f"volume {volume.name!r} is {volume.status} and cannot be attached; "
                "a volume serves one cluster at a time",
                field="volume",
            )
        if volume.region != region:
            raise ValidationError(
                f"volume: volume {volume.name!r} is in region {volume.region}, "
                f"the cluster in {region}",
                field="volume",
            )
        return volume
    name = f"{body.name}-shared"
    taken = await session.scalar(
        select(Volume.id).where(
            Volume.project_id == project.id, Volume.name == name, Volume.deleted_at.is_(None)
        )
    )
    if taken is not None:
        raise AlreadyExistsError(
            f"volume {name!r} already exists (kept from an earlier cluster?): attach it with "
            f"--volume {name}, or delete it first",
            field="volume",
        )
    volume = Volume(
        project_id=project.id,
        name=name,
        region=region,
        size_tib=body.volume_size_tib or 1,
        status=VolumeStatus.PROVISIONING.value,
        is_lifecycle_independent=True,
    )
    session.add(volume)
    return volume


async def create_cluster(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    body: api.ClusterCreate,
) -> api.Cluster:
    view, cluster_id = await _placing(
        rt,
        session,
        lambda guard: _create_once(
            session, rt=rt, principal=principal, project_name=project_name, body=body, guard=guard
        ),
    )
    # The new cluster by name (a full pass of the cluster reconciler also
    # sweeps the clusters that only wait for their nodes: see its candidates).
    rt.hints.notify_rows(hints.CLUSTERS, [cluster_id])
    rt.hints.notify(hints.NODES, hints.VOLUMES)
    return view


Guard = Callable[[], AbstractAsyncContextManager[None]]
_T = TypeVar("_T")


async def _placing(
    rt: Runtime, session: AsyncSession, attempt: Callable[[Guard], Awaitable[_T]]
) -> _T:
    """Run one create/scale transaction; ``attempt`` takes the placement
    guard it is given from its first write to its commit (its checks, which
    only read, go before: under a burst of creates the guard is the queue
    every create waits in, so what it covers sets their pace). The guard
    makes conflicts rare; if another server process still took a host first
    (the unique index says so at commit), or a concurrent create took the
    name, place again with a fresh view (which then says the name is
    taken)."""
    for n in range(PLACEMENT_ATTEMPTS):
        try:
            return await attempt(lambda: placement_guard(session, rt.placement_lock))
        except IntegrityError:
            await session.rollback()
            if n == PLACEMENT_ATTEMPTS - 1:
                raise CapacityUnavailableError(
                    "hosts were taken by concurrent requests; try again", field="num_gpus"
                ) from None
        except BaseException:
            await session.rollback()  # a failed request leaves nothing behind
            raise
    raise AssertionError("unreachable")


async def _create_once(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    body: api.ClusterCreate,
    guard: Guard,
) -> tuple[api.Cluster, str]:
    """The new cluster's view and its id."""
    region = body.region or rt.settings.region
    if body.slurm is not None:
        validate_extra_slurm_conf(body.slurm.extra_config)
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    await _check_region(session, region=region, gpu_type=body.gpu_type)
    if await session.scalar(
        select(Cluster.id).where(
            Cluster.project_id == project.id,
            Cluster.name == body.name,
            Cluster.deleted_at.is_(None),
        )
    ):
        raise AlreadyExistsError(f"cluster {body.name!r} already exists", field="name")
    volume = await _volume_for_create(session, project=project, body=body, region=region)
    add = Amounts(
        standard_gpus=body.num_gpus,
        preemptible_gpus=body.num_preemptible_gpus,
        clusters=1,
        volume_tib=volume.size_tib if body.volume is None else 0,  # a new one
    )
    # Only reads so far (the volume is not written yet): from the first
    # write on, under the guard (the order the controllers take them in:
    # the guard, then SQLite's writer gate).
    async with guard():
        await quotas.enforce(session, project, add)
        if add.standard_gpus or add.preemptible_gpus:
            await refuse_new_nodes(session, project.id, what="num_gpus")
        return await _create_placed(
            session,
            rt=rt,
            principal=principal,
            project=project,
            body=body,
            region=region,
            volume=volume,
        )


async def _create_placed(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project: Project,
    body: api.ClusterCreate,
    region: str,
    volume: Volume,
) -> tuple[api.Cluster, str]:
    """The writes of a create, under the placement guard, to its commit."""
    await session.flush()
    cluster = Cluster(
        project_id=project.id,
        name=body.name,
        cluster_type=body.cluster_type.value,
        gpu_type=body.gpu_type,
        region=region,
        num_gpus=body.num_gpus,
        num_preemptible_gpus=body.num_preemptible_gpus,
        billing_type=body.billing_type.value,
        reservation_start=body.reservation_start,
        reservation_end=body.reservation_end,
        cuda_version=body.cuda_version,
        driver_version=body.driver_version,
        slurm_extra_config=body.slurm.extra_config if body.slurm else "",
        slurm_prolog=body.slurm.prolog if body.slurm else None,
        slurm_epilog=body.slurm.epilog if body.slurm else None,
        repair_automatic=check_policy_kinds(body.repair.automatic) if body.repair else "",
        repair_max_wait_s=body.repair.max_wait_s if body.repair else 7200,
        egress=body.egress,
        autoscale_min_gpus=body.autoscaling.min_gpus if body.autoscaling else None,
        autoscale_max_gpus=body.autoscaling.max_gpus if body.autoscaling else None,
        autoscale_idle_s=body.autoscaling.idle_s if body.autoscaling else None,
        status="",  # set just below, so the phase history starts with queued
        volume_id=volume.id,
        created_by=principal.user_name,
    )
    session.add(cluster)
    await session.flush()
    if rt.node_access is not None:  # a provider with nodes users can reach
        await assign_ports(
            session,
            cluster,
            host=rt.settings.gateway_host,
            port_range=rt.settings.gateway_port_range,
        )
    now = utcnow()
    if body.reservation_end is not None and body.reservation_end <= now:
        raise ValidationError("reservation_end: must be in the future", field="reservation_end")
    start = body.reservation_start if body.reservation_end is not None else body.start_at
    if start is not None and start > now:
        # A request for later: nothing is placed now; the cluster reconciler
        # places the nodes from the start time on.
        cluster.start_at, cluster.nodes_placed = start, False
        await set_cluster_status(
            session, cluster, ClusterStatus.QUEUED.value, f"starts at {start.isoformat()}"
        )
    else:
        await set_cluster_status(session, cluster, ClusterStatus.QUEUED.value, "accepted")
        try:
            await allocate_nodes(
                session,
                cluster=cluster,
                count=body.num_gpus // GPUS_PER_NODE,
                compute_class=ComputeClass.STANDARD.value,
                work=work_probe(session, rt),
                deadlines=rt.settings.node_phase_deadlines_s,
            )
        except CapacityUnavailableError as exc:
            if not body.queue_if_unavailable:
                raise
            cluster.start_at, cluster.nodes_placed = now, False
            await set_cluster_status(
                session, cluster, ClusterStatus.QUEUED.value, f"waiting for capacity: {exc}"
            )
    await session.flush()
    # The answer is built inside the transaction, so it shows exactly what
    # was created, not a mix with the controllers' first steps.
    view = await cluster_view(session, cluster, project=project)
    await session.commit()
    return view, cluster.id


async def list_clusters(
    session: AsyncSession,
    *,
    principal: Principal,
    project_name: str,
    limit: int | None = None,
    cursor: str | None = None,
) -> Page[api.Cluster]:
    """The project's live clusters, oldest first, a page at a time
    (``core/paging.py``); all of them when ``limit`` is None."""
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    clusters, next_cursor = await page_of(
        session,
        select(Cluster).where(Cluster.project_id == project.id, Cluster.deleted_at.is_(None)),
        Cluster,
        limit=limit,
        cursor=cursor,
    )
    return Page(await cluster_views(session, clusters, project=project), next_cursor)


async def get_cluster(
    session: AsyncSession, *, principal: Principal, project_name: str, name: str
) -> api.Cluster:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    return await cluster_view(session, await _get_live(session, project, name), project=project)


async def update_cluster(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    name: str,
    body: api.ClusterUpdate,
) -> api.Cluster:
    async def attempt(guard: Guard) -> tuple[api.Cluster, str]:
        async with guard():
            return await update_once()

    async def update_once() -> tuple[api.Cluster, str]:
        project = await resolve_project(
            session, principal=principal, name=project_name, need=ProjectRole.ADMIN
        )
        cluster = await _get_live(session, project, name)
        if cluster.status in (ClusterStatus.DELETING.value, ClusterStatus.DELETED.value):
            raise InvalidStateError(f"cluster {name!r} is being deleted", field="name")
        if cluster.autoscale_max_gpus is not None:
            if body.num_gpus is not None:
                raise ValidationError(
                    "num_gpus: an autoscaled cluster's size follows its queue; change "
                    "autoscaling.min_gpus or max_gpus instead",
                    field="num_gpus",
                )
            if body.num_preemptible_gpus:
                raise ValidationError(
                    "num_preemptible_gpus: not on an autoscaled cluster (the preemptible "
                    "pool has its own target)",
                    field="num_preemptible_gpus",
                )
        target = body.num_gpus if body.num_gpus is not None else cluster.num_gpus
        if body.autoscaling is not None:
            target = max(cluster.num_gpus, body.autoscaling.min_gpus)
        if (
            target > cluster.num_gpus
            or (body.num_preemptible_gpus or 0) > cluster.num_preemptible_gpus
        ):
            await refuse_new_nodes(session, project.id, what="num_gpus")
        await quotas.enforce(
            session,
            project,
            Amounts(
                standard_gpus=target - cluster.num_gpus,
                preemptible_gpus=(
                    body.num_preemptible_gpus
                    if body.num_preemptible_gpus is not None
                    else cluster.num_preemptible_gpus
                )
                - cluster.num_preemptible_gpus,
            ),
        )
        if body.reservation_end is not None:
            _extend_reservation(cluster, body)
        if body.num_preemptible_gpus is not None:
            await set_preemptible_target(session, cluster, body.num_preemptible_gpus)
        if body.slurm is not None:
            _set_slurm(cluster, body.slurm)
        if body.repair is not None:
            cluster.repair_automatic = check_policy_kinds(body.repair.automatic)
            cluster.repair_max_wait_s = body.repair.max_wait_s
        if body.egress is not None and body.egress != cluster.egress:
            cluster.egress = body.egress
            # Applied live by the cluster reconciler (the host's firewall).
            cluster.config_generation += 1
        if body.autoscaling is not None:
            await _set_autoscaling(session, rt=rt, cluster=cluster, settings=body.autoscaling)
        if body.num_gpus is not None and body.num_gpus != cluster.num_gpus:
            if cluster.nodes_placed:
                await _scale(session, rt=rt, cluster=cluster, num_gpus=body.num_gpus)
            else:
                cluster.num_gpus = body.num_gpus  # queued: placed at the start
        cluster.updated_at = utcnow()
        await session.flush()
        view = await cluster_view(session, cluster, project=project)
        await session.commit()
        return view, cluster.id

    view, cluster_id = await _placing(rt, session, attempt)
    rt.hints.notify_rows(hints.CLUSTERS, [cluster_id])
    rt.hints.notify(hints.NODES)
    return view


def _set_slurm(cluster: Cluster, settings: api.SlurmSettings) -> None:
    """Store new Slurm settings; the cluster reconciler applies them live."""
    if cluster.cluster_type != ClusterType.SLURM.value:
        raise ValidationError("slurm: only Slurm clusters have Slurm settings", field="slurm")
    validate_extra_slurm_conf(settings.extra_config)
    new = (settings.extra_config, settings.prolog, settings.epilog)
    if new == (cluster.slurm_extra_config, cluster.slurm_prolog, cluster.slurm_epilog):
        return
    cluster.slurm_extra_config, cluster.slurm_prolog, cluster.slurm_epilog = new
    cluster.config_generation += 1


async def _set_autoscaling(
    session: AsyncSession, *, rt: Runtime, cluster: Cluster, settings: api.AutoscalingSettings
) -> None:
    """A new range for an autoscaled cluster: slurm.conf follows (its slots
    and idle time; the cluster reconciler applies it live), and a min_gpus
    above the current size adds the nodes at once."""
    if cluster.autoscale_max_gpus is None:
        raise ValidationError(
            "autoscaling: set it when the cluster is created (a fixed-size cluster's nodes "
            "hold no slots)",
            field="autoscaling",
        )
    if settings.max_gpus < cluster.num_gpus:
        raise ValidationError(
            f"autoscaling.max_gpus: below the cluster's current {cluster.num_gpus} GPUs; "
            "lower it once the cluster has shrunk",
            field="autoscaling.max_gpus",
        )
    new = (settings.min_gpus, settings.max_gpus, settings.idle_s)
    old = (cluster.autoscale_min_gpus, cluster.autoscale_max_gpus, cluster.autoscale_idle_s)
    if new == old:
        return
    cluster.autoscale_min_gpus, cluster.autoscale_max_gpus, cluster.autoscale_idle_s = new
    cluster.config_generation += 1
    if settings.min_gpus > cluster.num_gpus and cluster.nodes_placed:
        await _scale(session, rt=rt, cluster=cluster, num_gpus=settings.min_gpus)


def _extend_reservation(cluster: Cluster, body: api.ClusterUpdate) -> None:
    assert body.reservation_end is not None
    if cluster.billing_type == BillingType.ON_DEMAND.value or cluster.reservation_end is None:
        raise ValidationError(
            "reservation_end: only reserved and scheduled_capacity clusters have a reservation",
            field="reservation_end",
        )
    if body.reservation_end <= cluster.reservation_end:
        raise ValidationError(
            f"reservation_end: can only be extended past {cluster.reservation_end.isoformat()}",
            field="reservation_end",
        )
    cluster.reservation_end = body.reservation_end


async def _scale(session: AsyncSession, *, rt: Runtime, cluster: Cluster, num_gpus: int) -> None:
    live = await live_nodes(session, cluster, ComputeClass.STANDARD)
    want = num_gpus // GPUS_PER_NODE
    cluster.num_gpus = num_gpus
    if want > len(live):
        added = await allocate_nodes(
            session,
            cluster=cluster,
            count=want - len(live),
            compute_class=ComputeClass.STANDARD.value,
            work=work_probe(session, rt),
            deadlines=rt.settings.node_phase_deadlines_s,
        )
        await session.flush()
        for node in added:
            await record_event(
                session,
                node,
                EventReason.SCALED_UP,
                f"node {node.name} added: scaled to {num_gpus} GPUs",
            )
        if cluster.status in (ClusterStatus.READY.value, ClusterStatus.DEGRADED.value):
            await set_cluster_status(
                session,
                cluster,
                ClusterStatus.WAITING_FOR_NODES.value,
                f"scaling up to {want} nodes",
                deadlines=rt.settings.cluster_phase_deadlines_s,
            )
    elif want < len(live):
        layer = rt.layer_for(cluster.cluster_type)
        hosts = {
            h.id: h
            for h in await session.scalars(
                select(Host).where(Host.id.in_([n.host_id for n in live if n.host_id]))
            )
        }
        cref = cluster_ref(cluster)
        snapshots = []
        for n in live:
            cordoned = n.cordoned or (
                n.phase == NodePhase.RUNNING.value
                and await layer.is_cordoned(cref, node_ref(n, hosts.get(n.host_id or "")))
            )
            snapshots.append(
                NodeSnapshot(
                    name=n.name,
                    cordoned=cordoned,
                    running=n.phase == NodePhase.RUNNING.value,
                    failed=n.phase == NodePhase.FAILED.value,
                    created_at=n.created_at,
                )
            )
        victims = set(choose_nodes_to_remove(snapshots, count=len(live) - want))
        for n in live:
            if n.name in victims:
                n.to_delete = True
                n.delete_reason = "scale_down"


async def delete_cluster(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    name: str,
    delete_volume: bool,
    force_reason: str | None = None,
) -> api.Cluster:
    """Start deleting; idempotent (a second call returns the same deleting
    cluster). ``force_reason`` (organization admins only, on a new or a
    running delete): layer and provider steps that fail are skipped at once
    with an event instead of retried, and who forced it and why is kept on
    the cluster."""
    if force_reason is not None:
        force_reason = force_reason.strip()
        if not force_reason:
            raise ValidationError(
                "reason: a forced delete needs a reason (it is recorded)", field="reason"
            )
        require_org_admin(principal, "forcing a delete")
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    cluster = await _get_live(session, project, name)
    if cluster.status != ClusterStatus.DELETING.value:
        cluster.delete_volume = delete_volume
        await set_cluster_status(
            session,
            cluster,
            ClusterStatus.DELETING.value,
            "delete requested",
            deadlines=rt.settings.cluster_phase_deadlines_s,
        )
        nodes = await session.scalars(
            select(Node).where(Node.cluster_id == cluster.id, Node.deleted_at.is_(None))
        )
        for n in nodes:
            if not n.to_delete:
                n.to_delete = True
                n.delete_reason = "cluster_delete"
                forget_failures(n)  # a node in its backoff is released at once
    elif delete_volume and not cluster.delete_volume:
        cluster.delete_volume = True
    if force_reason is not None and cluster.force_delete_reason is None:
        cluster.force_delete_reason = f"by {principal.user_name}: {force_reason}"[:2000]
        forget_failures(cluster)
        # Whatever waits in its backoff is tried at once, forced.
        for n in await session.scalars(
            select(Node).where(Node.cluster_id == cluster.id, Node.deleted_at.is_(None))
        ):
            forget_failures(n)
    await session.flush()
    view = await cluster_view(session, cluster, project=project)
    await session.commit()
    rt.hints.notify_rows(hints.CLUSTERS, [cluster.id])
    rt.hints.notify(hints.NODES)
    return view
