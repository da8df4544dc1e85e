"""Clusters, nodes and events of a project."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Request, Response

from gpuclusters.core import models as api
from gpuclusters.core.errors import ValidationError
from gpuclusters.core.paging import Page
from gpuclusters.server.deps import PrincipalDep, RuntimeDep, SessionDep
from gpuclusters.server.routers.json import json_response
from gpuclusters.server.routers.paging import PAGED, PageDep, paged_response
from gpuclusters.server.routers.query_params import IsoTime
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.services import clusters, credentials, nodes, ssh, usage

router = APIRouter(prefix="/v1/projects/{project}")


def _registry(rt: Runtime, view: api.Cluster) -> api.Cluster:
    """The cluster as users see it, with where they push its images."""
    if rt.registry is None:
        return view
    return view.model_copy(update={"registry": f"{rt.settings.registry_address}/{view.project}"})


@router.get("/clusters", response_model=list[api.Cluster], responses=PAGED)
async def list_clusters(
    project: str,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
    page: PageDep,
    request: Request,
) -> Response:
    result = await clusters.list_clusters(
        session, principal=principal, project_name=project, limit=page.limit, cursor=page.cursor
    )
    views = Page([_registry(rt, v) for v in result.items], result.next_cursor)
    return paged_response(request, views, list[api.Cluster])


@router.post("/clusters", response_model=api.Cluster, status_code=201)
async def create_cluster(
    project: str,
    body: api.ClusterCreate,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
) -> api.Cluster:
    return _registry(
        rt,
        await clusters.create_cluster(
            session, rt=rt, principal=principal, project_name=project, body=body
        ),
    )


@router.get("/clusters/{name}", response_model=api.Cluster)
async def get_cluster(
    project: str, name: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> Response:
    view = await clusters.get_cluster(session, principal=principal, project_name=project, name=name)
    return json_response(_registry(rt, view), api.Cluster)


@router.patch("/clusters/{name}", response_model=api.Cluster)
async def update_cluster(
    project: str,
    name: str,
    body: api.ClusterUpdate,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
) -> api.Cluster:
    return _registry(
        rt,
        await clusters.update_cluster(
            session, rt=rt, principal=principal, project_name=project, name=name, body=body
        ),
    )


@router.delete("/clusters/{name}", response_model=api.Cluster, status_code=202)
async def delete_cluster(
    project: str,
    name: str,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
    delete_volume: bool = False,
    force: bool = False,
    reason: str | None = None,
) -> api.Cluster:
    """``force`` (organization admins, with a ``reason``): steps that fail
    are skipped at once instead of retried."""
    if reason is not None and not force:
        raise ValidationError("reason: only with force=true", field="reason")
    return _registry(
        rt,
        await clusters.delete_cluster(
            session,
            rt=rt,
            principal=principal,
            project_name=project,
            name=name,
            delete_volume=delete_volume,
            force_reason=(reason or "") if force else None,
        ),
    )


@router.post("/clusters/{name}/ssh", response_model=api.SshTarget)
async def ssh_target(
    project: str,
    name: str,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
    node: str | None = None,
    body: Annotated[api.SshRequest | None, Body()] = None,
) -> api.SshTarget:
    body = body or api.SshRequest()
    return await ssh.ssh_target(
        session,
        rt=rt,
        principal=principal,
        project_name=project,
        cluster_name=name,
        node_name=node,
        command=body.command,
        as_root=body.as_root,
    )


@router.post("/clusters/{name}/ssh-certificate", response_model=api.SshCertificate)
async def ssh_certificate(
    project: str,
    name: str,
    body: api.SshCertificateRequest,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
) -> api.SshCertificate:
    return await ssh.ssh_certificate(
        session, rt=rt, principal=principal, project_name=project, cluster_name=name, body=body
    )


@router.post("/clusters/{name}/credentials", response_model=api.ClusterCredentials)
async def cluster_credentials(
    project: str,
    name: str,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
    body: Annotated[api.CredentialsRequest | None, Body()] = None,
) -> api.ClusterCredentials:
    return await credentials.cluster_credentials(
        session,
        rt=rt,
        principal=principal,
        project_name=project,
        cluster_name=name,
        context_name=body.context_name if body is not None else None,
    )


@router.post("/clusters/{name}/token", response_model=api.ClusterToken)
async def cluster_token(
    project: str, name: str, session: SessionDep, principal: PrincipalDep, rt: RuntimeDep
) -> api.ClusterToken:
    """A token of five minutes for the caller on the cluster's Kubernetes
    API, checked against their membership now (the kubeconfig's exec
    credential plugin asks for one at each kubectl run)."""
    return await credentials.cluster_token(
        session, rt=rt, principal=principal, project_name=project, cluster_name=name
    )


@router.get("/nodes", response_model=list[api.Node], responses=PAGED)
async def list_nodes(
    project: str,
    session: SessionDep,
    principal: PrincipalDep,
    page: PageDep,
    request: Request,
    cluster: str | None = None,
    include_deleted: bool = False,
) -> Response:
    result = await nodes.list_nodes(
        session,
        principal=principal,
        project_name=project,
        cluster=cluster,
        include_deleted=include_deleted,
        limit=page.limit,
        cursor=page.cursor,
    )
    return paged_response(request, result, list[api.Node])


@router.get("/nodes/{name}", response_model=api.Node)
async def get_node(
    project: str, name: str, session: SessionDep, principal: PrincipalDep
) -> api.Node:
    return await nodes.get_node(session, principal=principal, project_name=project, name=name)


@router.patch("/nodes/{name}", response_model=api.Node)
async def update_node(
    project: str, name: str, body: api.NodeUpdate, session: SessionDep, principal: PrincipalDep
) -> api.Node:
    return await nodes.update_node(
        session, principal=principal, project_name=project, name=name, body=body
    )


@router.get("/events", response_model=list[api.NodeEvent], responses=PAGED)
async def list_events(
    project: str,
    session: SessionDep,
    principal: PrincipalDep,
    page: PageDep,
    request: Request,
    cluster: str | None = None,
    node: str | None = None,
) -> Response:
    result = await nodes.list_events(
        session,
        principal=principal,
        project_name=project,
        cluster=cluster,
        node=node,
        limit=page.limit,
        cursor=page.cursor,
    )
    return paged_response(request, result, list[api.NodeEvent])


@router.get("/usage", response_model=api.UsageReport)
async def usage_report(
    project: str,
    session: SessionDep,
    principal: PrincipalDep,
    rt: RuntimeDep,
    since: IsoTime | None = None,
    until: IsoTime | None = None,
    by: Literal["user", "cluster"] | None = None,
) -> api.UsageReport:
    """GPU-hours and cost; with ``by``, also totals per user (who created
    the cluster) or per cluster."""
    return await usage.usage_report(
        session,
        rt=rt,
        principal=principal,
        project_name=project,
        since=since,
        until=until,
        by=by,
    )
