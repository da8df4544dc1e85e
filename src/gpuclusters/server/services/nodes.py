"""Nodes and their lifecycle events (read side)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.enums import ProjectRole
from gpuclusters.core.errors import NotFoundError
from gpuclusters.core.paging import Page
from gpuclusters.server.db.models import Cluster, Node, NodeEvent, Project
from gpuclusters.server.db.paging import page_of
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.tenancy import resolve_project
from gpuclusters.server.services.views import node_views


async def _cluster_ids(
    session: AsyncSession, project: Project, name: str, *, include_deleted: bool
) -> list[str]:
    """Ids of the clusters called ``name``: the live one, or with
    ``include_deleted`` also earlier ones of that name (their nodes and events
    stay listed after deletion)."""
    q = select(Cluster.id).where(Cluster.project_id == project.id, Cluster.name == name)
    if not include_deleted:
        q = q.where(Cluster.deleted_at.is_(None))
    ids = list(await session.scalars(q))
    if not ids:
        raise NotFoundError(
            f"cluster {name!r} not found in project {project.name!r}", field="cluster"
        )
    return ids


async def _clusters(session: AsyncSession, ids: set[str]) -> dict[str, Cluster]:
    return {c.id: c for c in await session.scalars(select(Cluster).where(Cluster.id.in_(ids)))}


async def list_nodes(
    session: AsyncSession,
    *,
    principal: Principal,
    project_name: str,
    cluster: str | None,
    include_deleted: bool,
    limit: int | None = None,
    cursor: str | None = None,
) -> Page[api.Node]:
    """The project's nodes (or one cluster's), oldest first, a page at a
    time (``core/paging.py``); all of them when ``limit`` is None."""
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    q = select(Node).where(Node.project_id == project.id)
    if cluster is not None:
        ids = await _cluster_ids(session, project, cluster, include_deleted=include_deleted)
        q = q.where(Node.cluster_id.in_(ids))
    if not include_deleted:
        q = q.where(Node.deleted_at.is_(None))
    nodes, next_cursor = await page_of(session, q, Node, limit=limit, cursor=cursor)
    clusters = await _clusters(session, {n.cluster_id for n in nodes})
    return Page(await node_views(session, nodes, clusters=clusters), next_cursor)


async def _node_named(
    session: AsyncSession, *, principal: Principal, project_name: str, name: str
) -> Node:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    node = await session.scalar(
        select(Node)
        .where(Node.project_id == project.id, Node.name == name)
        .order_by(Node.created_at.desc())
        .limit(1)
    )
    if node is None:
        raise NotFoundError(f"node {name!r} not found in project {project.name!r}", field="name")
    return node


async def get_node(
    session: AsyncSession, *, principal: Principal, project_name: str, name: str
) -> api.Node:
    node = await _node_named(session, principal=principal, project_name=project_name, name=name)
    clusters = await _clusters(session, {node.cluster_id})
    return (await node_views(session, [node], clusters=clusters))[0]


async def telemetry(
    session: AsyncSession, *, rt: Runtime, principal: Principal, project_name: str, name: str
) -> dict[str, Any]:
    """The node's recent GPU samples (core.telemetry), as chart columns."""
    node = await _node_named(session, principal=principal, project_name=project_name, name=name)
    return rt.telemetry.series(node.id)


async def live_node(
    session: AsyncSession, project: Project, name: str, *, field: str = "name"
) -> Node:
    """The project's live node of that name, or ``not_found`` on ``field``."""
    node = await session.scalar(
        select(Node).where(
            Node.project_id == project.id, Node.name == name, Node.deleted_at.is_(None)
        )
    )
    if node is None:
        raise NotFoundError(f"node {name!r} not found in project {project.name!r}", field=field)
    return node


async def update_node(
    session: AsyncSession,
    *,
    principal: Principal,
    project_name: str,
    name: str,
    body: api.NodeUpdate,
) -> api.Node:
    """Turn automatic repair on or off for one node (project admins)."""
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    node = await live_node(session, project, name)
    node.auto_repair = body.auto_repair
    await session.commit()
    clusters = await _clusters(session, {node.cluster_id})
    return (await node_views(session, [node], clusters=clusters))[0]


async def list_events(
    session: AsyncSession,
    *,
    principal: Principal,
    project_name: str,
    cluster: str | None,
    node: str | None,
    limit: int | None = None,
    cursor: str | None = None,
) -> Page[api.NodeEvent]:
    """The project's node events, newest first, a page at a time; all of
    them when ``limit`` is None. A repeat of an event moves it to the front
    (its timestamp is bumped), so a reader paging while events repeat may
    see that event on an earlier page only."""
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    q = select(NodeEvent).where(NodeEvent.project_id == project.id)
    if cluster is not None:
        ids = await _cluster_ids(session, project, cluster, include_deleted=True)
        q = q.where(NodeEvent.cluster_id.in_(ids))
    if node is not None:
        q = q.where(NodeEvent.node_name == node)
    events, next_cursor = await page_of(
        session, q, NodeEvent, limit=limit, cursor=cursor, newest_first=True
    )
    clusters = await _clusters(session, {e.cluster_id for e in events})
    views = [
        api.NodeEvent(
            node=e.node_name,
            cluster=clusters[e.cluster_id].name,
            reason=e.reason,
            message=e.message,
            timestamp=e.timestamp,
            first_timestamp=e.first_timestamp,
            count=e.count,
        )
        for e in events
    ]
    return Page(views, next_cursor)
