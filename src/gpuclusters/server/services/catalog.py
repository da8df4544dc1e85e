"""GPU types, regions and hosts (the fleet inventory), plus the start-up sync
of hosts from the provider's fleet."""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.catalog import GPU_TYPES
from gpuclusters.core.enums import HostState
from gpuclusters.core.errors import ValidationError
from gpuclusters.providers.base import HostSpec
from gpuclusters.server.db.models import Cluster, Host, Node
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.allocation import host_slots
from gpuclusters.server.services.tenancy import require_org_admin


async def sync_hosts(session: AsyncSession, fleet: list[HostSpec]) -> None:
    """Make the hosts table match the fleet. Hosts that left the fleet are
    kept (nodes may still reference them) but marked out of the fleet, so
    nothing new is placed there."""
    existing = {h.name: h for h in await session.scalars(select(Host))}
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
    regions = set(await session.scalars(select(Host.region).where(Host.in_fleet.is_(True))))
    if region not in regions:
        raise ValidationError(
            f"region: unknown region {region!r}; known: {', '.join(sorted(regions)) or 'none'}",
            field="region",
        )


async def list_gpu_types(session: AsyncSession) -> list[api.GpuType]:
    slots, _ = await host_slots(session)
    total: dict[str, int] = defaultdict(int)
    free: dict[str, int] = defaultdict(int)
    for s in slots:
        total[s.gpu_type] += 1
        free[s.gpu_type] += int(s.free)
    return [
        api.GpuType(
            name=name, memory_gib=spec.memory_gib, total_hosts=total[name], free_hosts=free[name]
        )
        for name, spec in sorted(GPU_TYPES.items())
    ]


async def list_regions(session: AsyncSession) -> list[api.Region]:
    hosts = await session.scalars(select(Host).where(Host.in_fleet.is_(True)))
    types: dict[str, set[str]] = defaultdict(set)
    count: dict[str, int] = defaultdict(int)
    for h in hosts:
        types[h.region].add(h.gpu_type)
        count[h.region] += 1
    return [
        api.Region(name=r, gpu_types=sorted(types[r]), total_hosts=count[r]) for r in sorted(types)
    ]


async def list_hosts(session: AsyncSession, *, principal: Principal) -> list[api.Host]:
    require_org_admin(principal, "the host inventory")
    rows = (
        await session.execute(
            select(Host, Node.name, Cluster.name)
            .outerjoin(Node, (Node.host_id == Host.id) & Node.deleted_at.is_(None))
            .outerjoin(Cluster, Cluster.id == Node.cluster_id)
            .where(Host.in_fleet.is_(True))
            .order_by(Host.name)
        )
    ).all()
    return [
        api.Host(
            name=h.name,
            region=h.region,
            gpu_type=h.gpu_type,
            num_gpus=h.num_gpus,
            nvme_gib=h.nvme_gib,
            ib_island=h.ib_island,
            state=HostState(h.state),
            node=node_name,
            cluster=cluster_name,
        )
        for h, node_name, cluster_name in rows
    ]
