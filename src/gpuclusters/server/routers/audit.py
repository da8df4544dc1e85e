"""The audit log (``services/audit.py``): organization admins read all of
it, project admins their projects'."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from gpuclusters.core import models as api
from gpuclusters.server.deps import PrincipalDep, SessionDep
from gpuclusters.server.routers.paging import PAGED, PageDep, paged_response
from gpuclusters.server.routers.query_params import IsoTime
from gpuclusters.server.services import audit

router = APIRouter(prefix="/v1")


@router.get("/audit", response_model=list[api.AuditEvent], responses=PAGED)
async def list_audit(
    session: SessionDep,
    principal: PrincipalDep,
    page: PageDep,
    request: Request,
    user: Annotated[str | None, Query(max_length=64, description="only this user's")] = None,
    project: Annotated[
        str | None, Query(max_length=64, description="only this project's (its admins)")
    ] = None,
    object: Annotated[
        str | None,
        Query(max_length=300, description="only this object and what is below it: clusters/demo"),
    ] = None,
    since: Annotated[IsoTime | None, Query(description="at or after this time")] = None,
    until: Annotated[IsoTime | None, Query(description="before this time")] = None,
) -> Response:
    result = await audit.list_audit(
        session,
        principal=principal,
        user=user,
        project_name=project,
        object_=object,
        since=since,
        until=until,
        limit=page.limit,
        cursor=page.cursor,
    )
    return paged_response(request, result, list[api.AuditEvent])
