"""GPU types, regions and hosts (the fleet inventory), plus the start-up sync
of hosts from the provider's fleet."""

from __future__ import annotations

import json
from collections import defaultdict

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.catalog import GPU_TYPES
from gpuclusters.core.enums import ComputeClass, HostAgentStatus, HostState
from gpuclusters.core.errors import InvalidStateError, NotFoundError, ValidationError
from gpuclusters.core.paging import Page
from gpuclusters.providers.base import HostSpec
from gpuclusters.server.controllers import hints
from gpuclusters.server.db.allocation import free_counts, mark_preempted
from gpuclusters.server.db.models import Cluster, Host, Node
from gpuclusters.server.db.paging import page_of
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.tenancy import require_org_admin


async def sync_hosts(session: AsyncSession, fleet: list[HostSpec]) -> None:
    """Make the hosts table match the fleet. Hosts that left the fleet are
    kept (nodes may still reference them) but marked out of the fleet, so
    nothing new is placed there."""
    # Hosts with a host agent join through the API, not the fleet file.
    existing = {
        h.name: h for h in await session.scalars(select(Host).where(Host.agent_status.is_(None)))
    }
    for spec in fleet:
        host = existing.pop(spec.name, None)
        if host is None:
            host = Host(name=spec.name, state=HostState.AVAILABLE.value)
            session.add(host)
        host.region = spec.region
        host.gpu_type = spec.gpu_type
        host.num_gpus = spec.num_gpus
        host.nvme_gib = spec.nvme_gib
        host.ib_island = spec.ib_island
        host.in_fleet = True
    for host in existing.values():
        host.in_fleet = False
    await session.commit()


async def check_region(session: AsyncSession, region: str) -> None:
    """Refuse a region where the fleet has no hosts."""
    if await session.scalar(
        select(Host.id).where(Host.in_fleet.is_(True), Host.region == region).limit(1)
    ):
        return
    regions = set(
        await session.scalars(select(Host.region).where(Host.in_fleet.is_(True)).distinct())
    )
    if region not in regions:
        raise ValidationError(
            f"region: unknown region {region!r}; known: {', '.join(sorted(regions)) or 'none'}",
            field="region",
        )


async def list_gpu_types(session: AsyncSession) -> list[api.GpuType]:
    total: dict[str, int] = defaultdict(int)
    free: dict[str, int] = defaultdict(int)
    for gpu_type, n in await session.execute(
        select(Host.gpu_type, func.count()).where(Host.in_fleet.is_(True)).group_by(Host.gpu_type)
    ):
        total[gpu_type] = int(n)
    for (gpu_type, _), n in (await free_counts(session)).items():
        free[gpu_type] += n
    return [
        api.GpuType(
            name=name, memory_gib=spec.memory_gib, total_hosts=total[name], free_hosts=free[name]
        )
        for name, spec in sorted(GPU_TYPES.items())
    ]


async def list_regions(session: AsyncSession) -> list[api.Region]:
    rows = await session.execute(
        select(Host.region, Host.gpu_type, func.count())
        .where(Host.in_fleet.is_(True))
        .group_by(Host.region, Host.gpu_type)
    )
    types: dict[str, set[str]] = defaultdict(set)
    count: dict[str, int] = defaultdict(int)
    for region, gpu_type, n in rows:
        types[region].add(gpu_type)
        count[region] += int(n)
    return [
        api.Region(name=r, gpu_types=sorted(types[r]), total_hosts=count[r]) for r in sorted(types)
    ]


async def list_hosts(
    session: AsyncSession,
    *,
    principal: Principal,
    limit: int | None = None,
    cursor: str | None = None,
) -> Page[api.Host]:
    """The fleet's hosts in the order they joined, a page at a time
    (``core/paging.py``); all of them when ``limit`` is None."""
    require_org_admin(principal, "the host inventory")
    hosts, next_cursor = await page_of(
        session, select(Host).where(Host.in_fleet.is_(True)), Host, limit=limit, cursor=cursor
    )
    return Page(await _host_views(session, hosts), next_cursor)


async def get_host(session: AsyncSession, *, principal: Principal, name: str) -> api.Host:
    require_org_admin(principal, "the host inventory")
    return (await _host_views(session, [await _host(session, name)]))[0]


async def _host_views(session: AsyncSession, hosts: list[Host]) -> list[api.Host]:
    """The hosts as the API shows them, with the live node on each (one
    query for the page's nodes, not one per host)."""
    if not hosts:
        return []
    rows = await session.execute(
        select(Node, Cluster.name)
        .join(Cluster, Cluster.id == Node.cluster_id)
        .where(Node.host_id.in_([h.id for h in hosts]), Node.deleted_at.is_(None))
    )
    on_host = {node.host_id: (node, cluster_name) for node, cluster_name in rows}
    return [host_view(h, *on_host.get(h.id, (None, None))) for h in hosts]


def host_view(h: Host, node: Node | None = None, cluster_name: str | None = None) -> api.Host:
    """A host as the API shows it, with the node on it (if any)."""
    return api.Host(
        name=h.name,
        region=h.region,
        gpu_type=h.gpu_type,
        num_gpus=h.num_gpus,
        nvme_gib=h.nvme_gib,
        ib_island=h.ib_island,
        state=HostState(h.state),
        node=node.name if node else None,
        cluster=cluster_name,
        compute_class=ComputeClass(node.compute_class) if node else None,
        node_phase=node.phase if node else None,
        agent_status=HostAgentStatus(h.agent_status) if h.agent_status else None,
        address=h.address,
        last_heartbeat_at=h.last_heartbeat_at,
        inventory=json.loads(h.inventory) if h.inventory else None,
    )


async def _host(session: AsyncSession, name: str) -> Host:
    host = await session.scalar(select(Host).where(Host.name == name, Host.in_fleet.is_(True)))
    if host is None:
        raise NotFoundError(f"host {name!r} not found in the fleet", field="name")
    return host


async def set_host_state(
    session: AsyncSession, *, rt: Runtime, principal: Principal, name: str, state: HostState
) -> api.Host:
    """Cordon (nothing new is placed there; what runs stays) or uncordon a
    host. Idempotent."""
    require_org_admin(principal, "the host inventory")
    host = await _host(session, name)
    host.state = state.value
    await session.commit()
    rt.hints.notify(hints.CLUSTERS)  # an uncordoned host is spare capacity again
    return await get_host(session, principal=principal, name=name)


async def reclaim_host(
    session: AsyncSession, *, rt: Runtime, principal: Principal, name: str
) -> api.Host:
    """Take a host back from the preemptible pool: cordon it (so the pool
    does not fill it again) and preempt the preemptible node on it with the
    full protocol. A host that runs a standard node is refused; one that is
    empty is just cordoned. Idempotent; ``hosts uncordon`` gives it back."""
    require_org_admin(principal, "the host inventory")
    host = await _host(session, name)
    node = await session.scalar(
        select(Node).where(Node.host_id == host.id, Node.deleted_at.is_(None))
    )
    if node is not None and node.compute_class != ComputeClass.PREEMPTIBLE.value:
        raise InvalidStateError(
            f"host {name} runs standard node {node.name}; only hosts of preemptible nodes "
            "can be reclaimed (scale that cluster down instead)",
            field="name",
        )
    host.state = HostState.CORDONED.value
    if node is not None:
        await mark_preempted(session, host_id=host.id, why=f"host {name} reclaimed by an admin")
    await session.commit()
    rt.hints.notify(hints.NODES)
    return await get_host(session, principal=principal, name=name)
