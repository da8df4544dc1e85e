"""Alerts, repairs, fault injection and active health checks of a project."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body

from gpuclusters.core import models as api
from gpuclusters.server.deps import PrincipalDep, RuntimeDep, SessionDep
from gpuclusters.server.services import health

router = APIRouter(prefix="/v1/projects/{project}")


@router.get("/alerts", response_model=list[api.HealthAlert])
async def list_alerts(
    project: str,
    session: SessionDep,
    principal: PrincipalDep,
    cluster: str | None = None,
    include_resolved: bool = False,
) -> list[api.HealthAlert]:
    return await health.list_alerts(
        session,
        principal=principal,
        project_name=project,
        cluster=cluster,
        include_resolved=include_resolved,
    )


@router.get("/repairs", response_model=list[api.Repair])
async def list_repairs(
    project: str,
    session: SessionDep,
    principal: PrincipalDep,
    cluster: str | None = None,
    state: str | None = None,
) -> list[api.Repair]:
    return await health.list_repairs(
        session, principal=principal, project_name=project, cluster=cluster, state=state
    )


@router.post("/repairs", response_model=api.Repair, status_code=201)
async def request_repair(
    project: str,
    body: api.RepairCreate,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
) -> api.Repair:
    return await health.request_repair(
        session, rt=rt, principal=principal, project_name=project, body=body
    )


@router.get("/repairs/{repair_id}", response_model=api.Repair)
async def get_repair(
    project: str, repair_id: str, session: SessionDep, principal: PrincipalDep
) -> api.Repair:
    return await health.get_repair(
        session, principal=principal, project_name=project, repair_id=repair_id
    )


async def _review(
    verdict: str,
    project: str,
    repair_id: str,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
) -> api.Repair:
    return await health.review_repair(
        session,
        rt=rt,
        principal=principal,
        project_name=project,
        repair_id=repair_id,
        verdict=verdict,
    )


@router.post("/repairs/{repair_id}/approve", response_model=api.Repair)
async def approve_repair(
    project: str, repair_id: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.Repair:
    return await _review("approve", project, repair_id, session, principal, rt)


@router.post("/repairs/{repair_id}/reject", response_model=api.Repair)
async def reject_repair(
    project: str, repair_id: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.Repair:
    return await _review("reject", project, repair_id, session, principal, rt)


@router.post("/repairs/{repair_id}/cancel", response_model=api.Repair)
async def cancel_repair(
    project: str, repair_id: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.Repair:
    return await _review("cancel", project, repair_id, session, principal, rt)


@router.post("/nodes/{name}/faults", response_model=api.Node)
async def inject_fault(
    project: str,
    name: str,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
    body: Annotated[api.FaultSpec | None, Body()] = None,
) -> api.Node:
    """Add a simulated fault; with no body, clear the node's faults."""
    return await health.inject_fault(
        session, rt=rt, principal=principal, project_name=project, node_name=name, spec=body
    )


@router.post("/clusters/{name}/health-checks", response_model=list[api.HealthRun], status_code=201)
async def run_checks(
    project: str,
    name: str,
    body: api.HealthRunCreate,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
) -> list[api.HealthRun]:
    return await health.run_checks(
        session, rt=rt, principal=principal, project_name=project, cluster_name=name, body=body
    )


@router.get("/health-checks", response_model=list[api.HealthRun])
async def list_health_runs(
    project: str, session: SessionDep, principal: PrincipalDep, cluster: str | None = None
) -> list[api.HealthRun]:
    return await health.list_health_runs(
        session, principal=principal, project_name=project, cluster=cluster
    )


@router.get("/health-checks/{run_id}", response_model=api.HealthRun)
async def get_health_run(
    project: str, run_id: str, session: SessionDep, principal: PrincipalDep
) -> api.HealthRun:
    return await health.get_health_run(
        session, principal=principal, project_name=project, run_id=run_id
    )
