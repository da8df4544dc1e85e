"""GPU types, regions, hosts, whoami, projects, members, users and API keys."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gpuclusters.core import models as api
from gpuclusters.core.enums import HostState
from gpuclusters.server.deps import PrincipalDep, RuntimeDep, SessionDep
from gpuclusters.server.routers.paging import PAGED, PageDep, paged_response
from gpuclusters.server.services import budgets, capacity, catalog, quotas, tenancy
from gpuclusters.server.services.access_changes import access_changed

router = APIRouter(prefix="/v1")


@router.get("/whoami", response_model=api.WhoAmI)
async def whoami(session: SessionDep, principal: PrincipalDep) -> api.WhoAmI:
    return await tenancy.whoami(session, principal=principal)


@router.get("/gpu-types", response_model=list[api.GpuType])
async def gpu_types(session: SessionDep, principal: PrincipalDep) -> list[api.GpuType]:
    return await catalog.list_gpu_types(session)


@router.get("/regions", response_model=list[api.Region])
async def regions(session: SessionDep, principal: PrincipalDep) -> list[api.Region]:
    return await catalog.list_regions(session)


@router.get("/hosts", response_model=list[api.Host], responses=PAGED)
async def hosts(
    session: SessionDep, principal: PrincipalDep, page: PageDep, request: Request
) -> Response:
    result = await catalog.list_hosts(
        session, principal=principal, limit=page.limit, cursor=page.cursor
    )
    return paged_response(request, result, list[api.Host])


@router.get("/hosts/{name}", response_model=api.Host)
async def get_host(name: str, session: SessionDep, principal: PrincipalDep) -> api.Host:
    return await catalog.get_host(session, principal=principal, name=name)


@router.post("/hosts/{name}/reclaim", response_model=api.Host)
async def reclaim_host(
    name: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.Host:
    return await catalog.reclaim_host(session, rt=rt, principal=principal, name=name)


@router.post("/hosts/{name}/cordon", response_model=api.Host)
async def cordon_host(
    name: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.Host:
    return await catalog.set_host_state(
        session, rt=rt, principal=principal, name=name, state=HostState.CORDONED
    )


@router.post("/hosts/{name}/uncordon", response_model=api.Host)
async def uncordon_host(
    name: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.Host:
    return await catalog.set_host_state(
        session, rt=rt, principal=principal, name=name, state=HostState.AVAILABLE
    )


@router.get("/capacity", response_model=list[api.Capacity])
async def list_capacity(
    session: SessionDep, principal: PrincipalDep, project: str | None = None
) -> list[api.Capacity]:
    return await capacity.list_capacity(session, principal=principal, project=project)


@router.post("/capacity", response_model=api.Capacity, status_code=201)
async def create_capacity(
    body: api.CapacityCreate, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.Capacity:
    return await capacity.create_capacity(session, rt=rt, principal=principal, body=body)


@router.delete("/capacity/{name}", status_code=204)
async def delete_capacity(
    name: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> None:
    await capacity.delete_capacity(session, rt=rt, principal=principal, name=name)


@router.get("/projects", response_model=list[api.Project])
async def list_projects(
    session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> list[api.Project]:
    return await tenancy.list_projects(
        session, principal=principal, id_start=rt.settings.id_blocks_start
    )


@router.post("/projects", response_model=api.Project, status_code=201)
async def create_project(
    body: api.ProjectCreate, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.Project:
    return await tenancy.create_project(
        session, principal=principal, body=body, id_start=rt.settings.id_blocks_start
    )


@router.post("/api-keys", response_model=api.ApiKeyCreated, status_code=201)
async def create_api_key(
    body: api.ApiKeyCreate, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.ApiKeyCreated:
    created = await tenancy.create_api_key(session, principal=principal, body=body)
    await access_changed(rt)  # a new member, or a changed role
    return created


@router.get("/projects/{project}/quota", response_model=api.ProjectQuota)
async def get_quota(project: str, session: SessionDep, principal: PrincipalDep) -> api.ProjectQuota:
    """The project's quotas and what it holds now (any member)."""
    return await quotas.get_quota(session, principal=principal, project_name=project)


@router.put("/projects/{project}/quota", response_model=api.ProjectQuota)
async def set_quota(
    project: str, body: api.QuotaLimits, session: SessionDep, principal: PrincipalDep
) -> api.ProjectQuota:
    """Set the project's quotas (organization admins); null is no limit."""
    return await quotas.set_quota(session, principal=principal, project_name=project, body=body)


@router.get("/projects/{project}/budget", response_model=api.ProjectBudget)
async def get_budget(
    project: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.ProjectBudget:
    """The project's budget, what was spent in its period, and its alerts (any member)."""
    return await budgets.get_budget(session, rt=rt, principal=principal, project_name=project)


@router.put("/projects/{project}/budget", response_model=api.ProjectBudget)
async def set_budget(
    project: str,
    body: api.BudgetSettings,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
) -> api.ProjectBudget:
    """Set the project's budget (organization admins); a credit counts from now."""
    return await budgets.set_budget(
        session, rt=rt, principal=principal, project_name=project, body=body
    )


@router.delete(
    "/projects/{project}/budget",
    response_model=api.ProjectBudget,
    responses={409: {"description": "its policy is in force: raise it first"}},
)
async def delete_budget(
    project: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.ProjectBudget:
    """Remove the project's budget (organization admins)."""
    return await budgets.delete_budget(session, rt=rt, principal=principal, project_name=project)


@router.get("/projects/{project}/members", response_model=list[api.ProjectMember])
async def list_members(
    project: str, session: SessionDep, principal: PrincipalDep
) -> list[api.ProjectMember]:
    return await tenancy.list_members(session, principal=principal, project=project)


@router.delete("/projects/{project}/members/{user}", response_model=api.ProjectMember)
async def remove_member(
    project: str, user: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.ProjectMember:
    removed = await tenancy.remove_member(session, principal=principal, project=project, user=user)
    await access_changed(rt)
    return removed


@router.get("/users", response_model=list[api.User])
async def list_users(
    session: SessionDep, principal: PrincipalDep, include_deleted: bool = False
) -> list[api.User]:
    return await tenancy.list_users(session, principal=principal, include_deleted=include_deleted)


@router.delete("/users/{name}", response_model=api.User)
async def delete_user(
    name: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.User:
    deleted = await tenancy.delete_user(session, principal=principal, name=name)
    await access_changed(rt)
    return deleted
