"""Shared volumes: whole TiB, grow-only, deleted only when detached."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.enums import ProjectRole, VolumeStatus
from gpuclusters.core.errors import (
    AlreadyExistsError,
    InvalidStateError,
    NotFoundError,
    QuotaExceededError,
    ValidationError,
)
from gpuclusters.core.quotas import Amounts
from gpuclusters.server.controllers import hints
from gpuclusters.server.db.models import Cluster, Project, Volume
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services import quotas
from gpuclusters.server.services.catalog import check_region
from gpuclusters.server.services.tenancy import resolve_project
from gpuclusters.server.services.views import volume_view


async def _view(session: AsyncSession, volume: Volume, project: Project) -> api.Volume:
    cluster_name = None
    if volume.cluster_id:
        cluster = await session.get(Cluster, volume.cluster_id)
        cluster_name = cluster.name if cluster else None
    return volume_view(volume, project=project, cluster_name=cluster_name)


async def _get_live(session: AsyncSession, project: Project, name: str) -> Volume:
    volume = await session.scalar(
        select(Volume).where(
            Volume.project_id == project.id, Volume.name == name, Volume.deleted_at.is_(None)
        )
    )
    if volume is None:
        raise NotFoundError(f"volume {name!r} not found in project {project.name!r}", field="name")
    return volume


async def list_volumes(
    session: AsyncSession, *, principal: Principal, project_name: str
) -> list[api.Volume]:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    volumes = await session.scalars(
        select(Volume)
        .where(Volume.project_id == project.id, Volume.deleted_at.is_(None))
        .order_by(Volume.created_at, Volume.name)
    )
    return [await _view(session, v, project) for v in volumes]


async def get_volume(
    session: AsyncSession, *, principal: Principal, project_name: str, name: str
) -> api.Volume:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    return await _view(session, await _get_live(session, project, name), project)


async def create_volume(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    body: api.VolumeCreate,
) -> api.Volume:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    region = body.region or rt.settings.region
    await check_region(session, region)
    try:
        await quotas.enforce(session, project, Amounts(volume_tib=body.size_tib))
    except QuotaExceededError:
        await session.rollback()
        raise
    volume = Volume(
        project_id=project.id,
        name=body.name,
        region=region,
        size_tib=body.size_tib,
        status=VolumeStatus.PROVISIONING.value,
        is_lifecycle_independent=body.is_lifecycle_independent,
    )
    session.add(volume)
    try:
        await session.commit()
    except IntegrityError:
        await session.rollback()
        raise AlreadyExistsError(f"volume {body.name!r} already exists", field="name") from None
    rt.hints.notify(hints.VOLUMES)
    return await _view(session, volume, project)


async def resize_volume(
    session: AsyncSession,
    *,
    principal: Principal,
    project_name: str,
    name: str,
    body: api.VolumeUpdate,
) -> api.Volume:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    volume = await _get_live(session, project, name)
    if body.size_tib < volume.size_tib:
        raise ValidationError(
            f"size_tib: volumes grow but never shrink: {body.size_tib} TiB < {volume.size_tib} TiB",
            field="size_tib",
        )
    if volume.status == VolumeStatus.DELETING.value:
        raise InvalidStateError(f"volume {name!r} is being deleted", field="name")
    try:
        await quotas.enforce(session, project, Amounts(volume_tib=body.size_tib - volume.size_tib))
    except QuotaExceededError:
        await session.rollback()
        raise
    volume.size_tib = body.size_tib
    await session.commit()
    return await _view(session, volume, project)


async def delete_volume(
    session: AsyncSession, *, rt: Runtime, principal: Principal, project_name: str, name: str
) -> api.Volume:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    volume = await _get_live(session, project, name)
    user = await session.scalar(
        select(Cluster.name).where(Cluster.volume_id == volume.id, Cluster.deleted_at.is_(None))
    )
    if volume.cluster_id is not None or user is not None:
        raise InvalidStateError(
            f"volume {name!r} is attached to cluster {user!r}; delete the cluster first "
            "(or delete it with --delete-volume)",
            field="name",
        )
    if volume.status != VolumeStatus.DELETING.value:
        volume.status = VolumeStatus.DELETING.value
        await session.commit()
    rt.hints.notify(hints.VOLUMES)
    return await _view(session, volume, project)
