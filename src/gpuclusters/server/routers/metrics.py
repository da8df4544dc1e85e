"""Metrics: the server's own ``/metrics``, the scrape targets, and PromQL
queries confined to the caller's projects (``services.metrics``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query, Response
from fastapi.security import HTTPAuthorizationCredentials
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpuclusters.server.deps import PrincipalDep, RuntimeDep, SessionDep, bearer
from gpuclusters.server.services import metrics

router = APIRouter()

Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def _key(credentials: HTTPAuthorizationCredentials | None) -> str | None:
    return credentials.credentials.strip() or None if credentials is not None else None


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}, "description": "metrics"}},
)
async def server_metrics(session: SessionDep, rt: RuntimeDep, credentials: Credentials) -> Response:
    """This replica's metrics (Prometheus text format): the scrape token or
    an organization admin's key."""
    await metrics.authorize_scrape(session, rt, _key(credentials))
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/metrics/targets")
async def scrape_targets(
    session: SessionDep, rt: RuntimeDep, credentials: Credentials
) -> list[dict[str, Any]]:
    """Every node agent to scrape, in Prometheus' HTTP service discovery
    format: the scrape token or an organization admin's key."""
    await metrics.authorize_scrape(session, rt, _key(credentials))
    return await metrics.scrape_targets(session, rt)


@router.post("/v1/metrics/alerts/api/v2/alerts")
async def receive_alerts(
    session: SessionDep,
    rt: RuntimeDep,
    credentials: Credentials,
    alerts: Annotated[list[dict[str, Any]], Body()],
) -> dict[str, int]:
    """Alertmanager's v2 API, for the metrics rule engine (the scrape token
    or an organization admin's key): firing alerts on nodes become events."""
    await metrics.authorize_scrape(session, rt, _key(credentials))
    return {"recorded": await metrics.receive_alerts(session, alerts)}


# What a query can answer beyond the document's usual errors (server/openapi.py).
QUERY_ERRORS: dict[int | str, dict[str, Any]] = {
    409: {"description": "this server has no metrics database"},
    503: {"description": "the metrics database does not answer"},
}


@router.get("/v1/metrics/query", responses=QUERY_ERRORS)
async def instant_query(
    session: SessionDep,
    rt: RuntimeDep,
    principal: PrincipalDep,
    query: Annotated[str, Query(description="a PromQL expression")],
    time: Annotated[str, Query(description="evaluation time (RFC 3339 or Unix seconds)")] = "",
    project: Annotated[str | None, Query(description="only this project's series")] = None,
) -> dict[str, Any]:
    """A PromQL instant query over the caller's projects' series
    (Prometheus' query API answer)."""
    return await metrics.query(
        session, rt, principal=principal, kind="query",
        params={"query": query, "time": time}, project=project,
    )  # fmt: skip


@router.get("/v1/metrics/query_range", responses=QUERY_ERRORS)
async def range_query(
    session: SessionDep,
    rt: RuntimeDep,
    principal: PrincipalDep,
    query: Annotated[str, Query(description="a PromQL expression")],
    start: Annotated[str, Query(description="RFC 3339 or Unix seconds")],
    end: Annotated[str, Query(description="RFC 3339 or Unix seconds")] = "",
    step: Annotated[str, Query(description="resolution: seconds or a duration (30s, 5m)")] = "",
    project: Annotated[str | None, Query(description="only this project's series")] = None,
) -> dict[str, Any]:
    """A PromQL range query over the caller's projects' series."""
    return await metrics.query(
        session, rt, principal=principal, kind="query_range",
        params={"query": query, "start": start, "end": end, "step": step}, project=project,
    )  # fmt: skip
