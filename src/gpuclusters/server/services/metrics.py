"""Metrics: the node agents the metrics database scrapes, who may scrape,
and PromQL queries answered for the caller's projects only.

**Scrape targets.** ``GET /v1/metrics/targets`` answers Prometheus' HTTP
service discovery format: one target per node whose agent runs (it has an
address and is bootstrapping, running, repairing or draining), with labels
from the database. A node of this machine is scraped where it is, at
``<address>:<metrics_agent_port>``. A node on a host with a host agent
lives on that host's cluster bridge, which this machine does not route to:
it is scraped through its host agent (``https://<agent>/v1/nodes/<id>/metrics``,
with the control plane's client certificate: ``metrics_db``), set by the
``__scheme__``, ``__metrics_path__`` and ``__param_port`` labels, and its
``instance`` label is still the node's own address. The ``project_id``
label is what user queries are confined by; it comes from here, never from
the node (``metrics_db``: target labels win).

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
import logging
import re
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import urlencode

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.enums import HostAgentStatus, NodePhase, ProjectRole
from gpuclusters.core.errors import (
    AuthenticationError,
    InvalidStateError,
    UnavailableError,
    ValidationError,
)
from gpuclusters.server.db.models import Cluster, Host, Node, NodeEvent, Project
from gpuclusters.server.db.records import record_event
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services import tenancy

log = logging.getLogger(__name__)

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


def _instant(value: object) -> datetime | None:
    """Alertmanager's RFC 3339 times (vmalert writes nanoseconds; Python
    reads microseconds)."""
    if not isinstance(value, str) or not value:
        return None
    text = re.sub(r"(\.\d{6})\d+", r"\1", value.replace("Z", "+00:00"))
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


async def receive_alerts(session: AsyncSession, alerts: list[dict[str, Any]]) -> int:
    """Alerts the rule engine posts (Alertmanager's v2 API): each firing
    alert on a node becomes an event on it (reason: the alert's name), once
    per firing; the count of events recorded. Resolved alerts add nothing
    (the event stays as the record). Fleet alerts, on no node, go to the log."""
    now = datetime.now(UTC)
    recorded = 0
    for alert in alerts:
        labels = alert.get("labels")
        annotations = alert.get("annotations")
        if not isinstance(labels, dict):
            continue  # not an alert
        if not isinstance(annotations, dict):
            annotations = {}
        name = str(labels.get("alertname") or "")[:32]
        ends = _instant(alert.get("endsAt"))
        if not name or (ends is not None and ends <= now):
            continue
        starts = _instant(alert.get("startsAt")) or now
        summary = str(annotations.get("summary") or name)
        node_id = labels.get("node_id")
        if not node_id:
            log.warning("metrics alert %s (%s): %s", name, labels.get("severity", ""), summary)
            continue
        node = await session.get(Node, str(node_id))
        if (
            node is None
            or node.deleted_at is not None
            or node.project_id != labels.get("project_id")
        ):
            continue
        last = await session.scalar(
            select(NodeEvent.timestamp).where(
                NodeEvent.node_id == node.id, NodeEvent.reason == name
            )
        )
        if last is not None and last >= starts:
            continue  # this firing is recorded already (vmalert resends it)
        severity = labels.get("severity", "")
        await record_event(session, node, name, f"{summary} (metrics alert, {severity})")
        recorded += 1
    await session.commit()
    return recorded


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
            Host.agent_status,
            Host.address,
            Host.agent_port,
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
    for row in rows:
        node_id, node, address, klass, cluster_id, cluster, gpu_type, pid, project = row[:9]
        host, agent_status, agent_address, agent_port = row[9:]
        labels = {
            "project_id": pid,
            "project": project,
            "cluster_id": cluster_id,
            "cluster": cluster,
            "node_id": node_id,
            "node": node,
            "host": host or "",
            "compute_class": klass,
            "gpu_type": gpu_type,
        }
        instance = f"{_bracketed(str(address))}:{port}"
        if agent_status is None:
            target = instance
        elif agent_status == HostAgentStatus.REMOVED or not agent_address or not agent_port:
            continue  # no agent to ask (a removed host's nodes are being deleted)
        else:
            target = f"{_bracketed(agent_address)}:{agent_port}"
            labels |= {
                "instance": instance,
                "__scheme__": "https",
                "__metrics_path__": f"/v1/nodes/{node_id}/metrics",
                "__param_port": str(port),
            }
        out.append({"targets": [target], "labels": labels})
    return out


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


# A range query's resolution: seconds, or a PromQL duration.
STEP = re.compile(r"[0-9]+(\.[0-9]+)?(ms|s|m|h|d|w|y)?")


def _is_instant(value: str) -> bool:
    """Unix seconds or an RFC 3339 time, as Prometheus' API takes them."""
    try:
        float(value)
    except ValueError:
        return _instant(value) is not None
    return True


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
        raise ValidationError("query: must be a PromQL expression, not empty", field="query")
    for name in ("time", "start", "end"):
        if params.get(name) and not _is_instant(params[name]):
            raise ValidationError(
                f"{name}: must be Unix seconds or an RFC 3339 time, not {params[name]!r}",
                field=name,
            )
    if params.get("step") and not STEP.fullmatch(params["step"]):
        raise ValidationError(
            f"step: must be seconds or a duration (30s, 5m, 1h), not {params['step']!r}",
            field="step",
        )
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
            f"query: the metrics database refused it: {body.get('error') or response.text[:500]}",
            field="query",
        )
    if response.status_code != 200:
        raise UnavailableError(
            f"the metrics database answered {response.status_code}: {response.text[:500]}"
        )
    return body
