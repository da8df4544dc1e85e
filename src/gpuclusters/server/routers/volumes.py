"""Shared volumes of a project."""

from __future__ import annotations

from fastapi import APIRouter

from gpuclusters.core import models as api
from gpuclusters.server.deps import PrincipalDep, RuntimeDep, SessionDep
from gpuclusters.server.services import volumes

router = APIRouter(prefix="/v1/projects/{project}/volumes")


@router.get("", response_model=list[api.Volume])
async def list_volumes(
    project: str, session: SessionDep, principal: PrincipalDep
) -> list[api.Volume]:
    return await volumes.list_volumes(session, principal=principal, project_name=project)


@router.post("", response_model=api.Volume, status_code=201)
async def create_volume(
    project: str,
    body: api.VolumeCreate,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
) -> api.Volume:
    return await volumes.create_volume(
        session, rt=rt, principal=principal, project_name=project, body=body
    )


@router.get("/{name}", response_model=api.Volume)
async def get_volume(
    project: str, name: str, session: SessionDep, principal: PrincipalDep
) -> api.Volume:
    return await volumes.get_volume(session, principal=principal, project_name=project, name=name)


@router.patch("/{name}", response_model=api.Volume)
async def resize_volume(
    project: str, name: str, body: api.VolumeUpdate, session: SessionDep, principal: PrincipalDep
) -> api.Volume:
    return await volumes.resize_volume(
        session, principal=principal, project_name=project, name=name, body=body
    )


@router.delete("/{name}", response_model=api.Volume, status_code=202)
async def delete_volume(
    project: str, name: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.Volume:
    return await volumes.delete_volume(
        session, rt=rt, principal=principal, project_name=project, name=name
    )
