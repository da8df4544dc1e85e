"""Metrics: the node agents the metrics database scrapes, who may scrape,
and PromQL queries answered for the caller's projects only.

**Scrape targets.** ``GET /v1/metrics/targets`` answers Prometheus' HTTP
service discovery format: one target per node whose agent runs (it has an
address and is bootstrapping, running, repairing or draining), at
``<address>:<metrics_agent_port>``, with labels from the database. The
``project_id`` label is what user queries are confined by; it comes from
here, never from the node (``metrics_db``: target labels win).

**Who scrapes.** ``/metrics`` and the targets answer the scrape token
(``metrics_db.scrape_token``) or an organization admin's API key, and
nobody else: they describe the whole fleet. (Nodes reach the API through
the agent socket; a tenant there gets 401.)

**Queries.** ``/v1/metrics/query`` and ``/v1/metrics/query_range`` pass the
caller's PromQL to the metrics database with ``extra_filters[]`` set to
``{project_id=~"<the caller's projects>"}``. VictoriaMetrics applies it to
every series selector of the query, whatever labels the query writes, so
a user's query can only ever read series of their own projects: asking
for another project's cluster returns no series, and so do ``{__name__=~".+"}``
and the server's own metrics (they have no project). Organization admins
are operators: their queries go through unfiltered. ``project=NAME``
narrows a query to one project the caller is a member of.
"""

from __future__ import annotations

import hmac
from typing import Any, Literal
from urllib.parse import urlencode

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.enums import NodePhase, ProjectRole
from gpuclusters.core.errors import (
    AuthenticationError,
    InvalidStateError,
    UnavailableError,
    ValidationError,
)
from gpuclusters.server.db.models import Cluster, Host, Node, Project
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services import tenancy

# Phases in which a node's agent runs and answers scrapes.
SCRAPED_PHASES = (
    NodePhase.BOOTSTRAPPING,
    NodePhase.RUNNING,
    NodePhase.REPAIRING,
    NodePhase.DRAINING,
)
QUERY_TIMEOUT_S = 30.0
QueryKind = Literal["query", "query_range"]
RESULT_TYPE: dict[QueryKind, str] = {"query": "vector", "query_range": "matrix"}


async def authorize_scrape(session: AsyncSession, rt: Runtime, key: str | None) -> None:
    """The scrape token or an organization admin's key; else 401 / 403."""
    token = rt.metrics_scrape_token
    if key and token and hmac.compare_digest(key.encode(), token.encode()):
        return
    if not key:
        raise AuthenticationError(
            "metrics need the scrape token or an organization admin's API key"
        )
    principal = await tenancy.authenticate(session, key=key)
    tenancy.require_org_admin(principal, "the server's metrics")


async def scrape_targets(session: AsyncSession, rt: Runtime) -> list[dict[str, Any]]:
    """Every running node agent, in Prometheus' HTTP SD format."""
    port = rt.settings.metrics_agent_port
    rows = await session.execute(
        select(
            Node.id,
            Node.name,
            Node.address,
            Node.compute_class,
            Cluster.id,
            Cluster.name,
            Cluster.gpu_type,
            Project.id,
            Project.name,
            Host.name,
        )
        .join(Cluster, Node.cluster_id == Cluster.id)
        .join(Project, Node.project_id == Project.id)
        .outerjoin(Host, Node.host_id == Host.id)
        .where(
            Node.deleted_at.is_(None),
            Node.address.is_not(None),
            Node.phase.in_([p.value for p in SCRAPED_PHASES]),
        )
        .order_by(Node.name)
    )
    out = []
    for node_id, node, address, klass, cluster_id, cluster, gpu_type, pid, project, host in rows:
        host_part = f"[{address}]" if ":" in str(address) else str(address)
        target = f"{host_part}:{port}"
        out.append(
            {
                "targets": [target],
                "labels": {
                    "project_id": pid,
                    "project": project,
                    "cluster_id": cluster_id,
                    "cluster": cluster,
                    "node_id": node_id,
                    "node": node,
                    "host": host or "",
                    "compute_class": klass,
                    "gpu_type": gpu_type,
                },
            }
        )
    return out


def _empty(kind: QueryKind) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": RESULT_TYPE[kind], "result": []}}


async def _confinement(
    session: AsyncSession, principal: Principal, project: str | None
) -> list[str] | None:
    """The project ids the caller's query is confined to (None: unconfined)."""
    if project is not None:
        found = await tenancy.resolve_project(
            session, principal=principal, name=project, need=ProjectRole.EDITOR
        )
        return [found.id]
    if principal.is_admin:
        return None
    return sorted(principal.roles)


async def query(
    session: AsyncSession,
    rt: Runtime,
    *,
    principal: Principal,
    kind: QueryKind,
    params: dict[str, str],
    project: str | None = None,
) -> dict[str, Any]:
    """The metrics database's answer (Prometheus' query API format) to
    ``params`` (``query`` and ``time``, or ``start``, ``end`` and ``step``),
    confined to the caller's projects."""
    url = rt.settings.metrics_query_url
    if url is None:
        raise InvalidStateError(
            "this server has no metrics database (GPUCLUSTERS_METRICS_DB, GPUCLUSTERS_METRICS_URL)"
        )
    if not params.get("query", "").strip():
        raise ValidationError("query must be a PromQL expression, not empty", field="query")
    projects = await _confinement(session, principal, project)
    if projects is not None and not projects:
        return _empty(kind)
    sent: list[tuple[str, str]] = [(k, v) for k, v in params.items() if v != ""]
    if projects is not None:
        # Project ids are hex: nothing in them needs escaping in a regex.
        alternatives = "|".join(projects)
        sent.append(("extra_filters[]", f'{{project_id=~"{alternatives}"}}'))
    try:
        async with httpx.AsyncClient(timeout=QUERY_TIMEOUT_S) as http:
            response = await http.post(
                f"{url}/api/v1/{kind}",
                content=urlencode(sent),
                headers={"Content-Type": "application/x-www-form-urlencoded"},
            )
    except httpx.HTTPError as exc:
        raise UnavailableError(f"the metrics database does not answer: {exc}") from exc
    try:
        body: dict[str, Any] = response.json()
    except ValueError:
        body = {}
    if response.status_code in (400, 422) or body.get("status") == "error":
        raise ValidationError(
            f"the metrics database refused the query: {body.get('error') or response.text[:500]}",
            field="query",
        )
    if response.status_code != 200:
        raise UnavailableError(
            f"the metrics database answered {response.status_code}: {response.text[:500]}"
        )
    return body
