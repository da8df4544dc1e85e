"""Capacity windows: reservations and capacity pools set aside for a
project (org admins create and delete them; members see their projects').

A create that would set aside more hosts of a type and region than the
fleet has at some moment is refused with ``capacity_unavailable`` saying how
many GPUs could still be set aside then; nothing is written.
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.capacity.reservations import Window, overbooked
from gpuclusters.core.catalog import GPU_TYPES
from gpuclusters.core.enums import GPUS_PER_NODE, CapacityKind
from gpuclusters.core.errors import (
    AlreadyExistsError,
    CapacityUnavailableError,
    NotFoundError,
    ValidationError,
)
from gpuclusters.server.controllers import hints
from gpuclusters.server.db.capacity import to_window
from gpuclusters.server.db.models import CapacityWindow, Host, Project, utcnow
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.catalog import check_region
from gpuclusters.server.services.tenancy import require_org_admin


def _views(rows: list[CapacityWindow], projects: dict[str, str]) -> list[api.Capacity]:
    now = utcnow()
    grouped: dict[str, list[CapacityWindow]] = defaultdict(list)
    for r in rows:
        grouped[r.name].append(r)
    out = []
    for name in sorted(grouped):
        ws = sorted(grouped[name], key=lambda w: w.start_at)
        first = ws[0]
        out.append(
            api.Capacity(
                name=name,
                project=projects.get(first.project_id, first.project_id),
                kind=CapacityKind(first.kind),
                gpu_type=first.gpu_type,
                region=first.region,
                num_gpus=first.num_gpus,
                windows=[
                    api.CapacityWindowView(
                        start=w.start_at, end=w.end_at, active=w.start_at <= now < w.end_at
                    )
                    for w in ws
                ],
                created_at=first.created_at,
            )
        )
    return out


async def _project_names(session: AsyncSession, principal: Principal) -> dict[str, str]:
    rows = await session.execute(
        select(Project.id, Project.name).where(Project.organization_id == principal.organization_id)
    )
    return {pid: name for pid, name in rows}


async def create_capacity(
    session: AsyncSession, *, rt: Runtime, principal: Principal, body: api.CapacityCreate
) -> api.Capacity:
    require_org_admin(principal, "setting capacity aside")
    if body.gpu_type not in GPU_TYPES:
        raise ValidationError(
            f"gpu_type: unknown GPU type {body.gpu_type!r}; known: {', '.join(sorted(GPU_TYPES))}",
            field="gpu_type",
        )
    region = body.region or rt.settings.region
    await check_region(session, region)
    projects = await _project_names(session, principal)
    project_id = next((i for i, n in projects.items() if n == body.project), None)
    if project_id is None:
        raise NotFoundError(f"project {body.project!r} not found", field="project")
    if await session.scalar(select(CapacityWindow.id).where(CapacityWindow.name == body.name)):
        raise AlreadyExistsError(f"capacity {body.name!r} already exists", field="name")
    hosts = int(
        await session.scalar(
            select(func.count(Host.id)).where(
                Host.in_fleet.is_(True), Host.gpu_type == body.gpu_type, Host.region == region
            )
        )
        or 0
    )
    existing = [
        to_window(w)
        for w in await session.scalars(
            select(CapacityWindow).where(
                CapacityWindow.gpu_type == body.gpu_type, CapacityWindow.region == region
            )
        )
    ]
    for tw in body.windows:
        new = Window(
            project=project_id,
            kind=body.kind.value,
            gpu_type=body.gpu_type,
            region=region,
            num_gpus=body.num_gpus,
            start=tw.start,
            end=tw.end,
        )
        room = overbooked(existing, new, hosts=hosts)
        if room is not None:
            raise CapacityUnavailableError(
                f"num_gpus: the fleet has {hosts} {body.gpu_type} host(s) in {region}; at most "
                f"{room * GPUS_PER_NODE} GPUs can still be set aside from "
                f"{tw.start.isoformat()}",
                field="num_gpus",
            )
        existing.append(new)
    rows = [
        CapacityWindow(
            name=body.name,
            project_id=project_id,
            kind=body.kind.value,
            gpu_type=body.gpu_type,
            region=region,
            num_gpus=body.num_gpus,
            start_at=tw.start,
            end_at=tw.end,
            created_by=principal.user_name,
        )
        for tw in body.windows
    ]
    session.add_all(rows)
    await session.commit()
    rt.hints.notify(hints.CLUSTERS)  # queued clusters may fit now
    return _views(rows, projects)[0]


async def list_capacity(
    session: AsyncSession, *, principal: Principal, project: str | None = None
) -> list[api.Capacity]:
    """Org admins see every project's; members see their projects'."""
    projects = await _project_names(session, principal)
    visible = {pid for pid in projects if principal.is_admin or principal.role_in(pid) is not None}
    if project is not None:
        visible = {pid for pid in visible if projects[pid] == project}
    rows = list(
        await session.scalars(select(CapacityWindow).where(CapacityWindow.project_id.in_(visible)))
    )
    return _views(rows, projects)


async def delete_capacity(
    session: AsyncSession, *, rt: Runtime, principal: Principal, name: str
) -> None:
    """Give the capacity back. Clusters keep running; what they use beyond
    the project's remaining windows is billed on-demand from then on."""
    require_org_admin(principal, "setting capacity aside")
    result = await session.execute(delete(CapacityWindow).where(CapacityWindow.name == name))
    if not result.rowcount:  # type: ignore[attr-defined]
        raise NotFoundError(f"capacity {name!r} not found", field="name")
    await session.commit()
    rt.hints.notify(hints.CLUSTERS)
