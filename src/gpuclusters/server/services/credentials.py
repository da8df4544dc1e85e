"""``gpuclusters clusters credentials``: a kubeconfig for the caller.

Any project member may fetch their *own* credentials: the layer issues a
client certificate for the caller's user name, in the cluster-admin group
when the caller is a project admin (organization admins are admins of every
project), as a plain user otherwise; what that user may do inside the
cluster is the layer's RBAC. Nobody can fetch someone else's.

The layer answers with kubeconfig YAML whose context, cluster entry and user
entry are named after the cluster; a caller-chosen context name renames all
three (``core.kubeconfig.rename_context``), so the same cluster name in two
projects can live in one kubeconfig file.

The database work (authorise, find the cluster, build its ``ClusterRef``)
ends before the layer is asked: issuing may reach into the control plane and
must not hold a transaction open meanwhile. Every issue is logged (user,
project, cluster, role), never the key.
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import kubeconfig
from gpuclusters.core import models as api
from gpuclusters.core.enums import ClusterStatus, ProjectRole
from gpuclusters.core.errors import InvalidStateError, NotFoundError, ServerError
from gpuclusters.layers.base import LayerError
from gpuclusters.server.controllers.refs import load_cluster_ref, token_issuer_ref
from gpuclusters.server.db.models import Cluster
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.tenancy import resolve_project

log = logging.getLogger(__name__)

_USABLE = (ClusterStatus.READY.value, ClusterStatus.DEGRADED.value)


async def _usable_cluster(
    session: AsyncSession, project_id: str, cluster_name: str, what: str
) -> Cluster:
    cluster = await session.scalar(
        select(Cluster).where(
            Cluster.project_id == project_id,
            Cluster.name == cluster_name,
            Cluster.deleted_at.is_(None),
        )
    )
    if cluster is None:
        raise NotFoundError(f"cluster {cluster_name!r} not found", field="name")
    if cluster.status not in _USABLE:
        raise InvalidStateError(
            f"cluster {cluster_name} is {cluster.status}, not ready; {what} once it is ready"
        )
    return cluster


async def cluster_token(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    cluster_name: str,
) -> api.ClusterToken:
    """A token of minutes for the caller on the cluster (any member; what it
    may do is their RBAC binding). Refused once they are no longer a member
    (not_found) or the user is locked out (their key is revoked: 401)."""
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    cluster = await _usable_cluster(session, project.id, cluster_name, "tokens are issued")
    if rt.token_issuer is None or token_issuer_ref(rt, cluster.id) is None:
        raise InvalidStateError(
            "this server signs no Kubernetes tokens (it needs TLS and the image registry's "
            "token listener); use the kubeconfig's client certificate"
        )
    minted = rt.token_issuer.mint(user=principal.user_name, cluster_id=cluster.id)
    return api.ClusterToken(
        cluster=cluster.name,
        user=principal.user_name,
        token=minted.token,
        expires_at=minted.expires_at,
    )


async def cluster_credentials(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    cluster_name: str,
    context_name: str | None = None,
) -> api.ClusterCredentials:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    admin = principal.role_in(project.id) is ProjectRole.ADMIN
    cluster = await _usable_cluster(session, project.id, cluster_name, "credentials are issued")
    cref = await load_cluster_ref(session, cluster, rt)
    layer = rt.layer_for(cluster.cluster_type)
    await session.rollback()  # read-only so far; hold no transaction while the layer works

    try:
        text = await layer.credentials(
            cref, user=principal.user_name, admin=admin, project=project_name
        )
    except LayerError as exc:
        raise InvalidStateError(
            f"cluster {cluster_name}: credentials cannot be issued right now ({exc}); try again"
        ) from exc
    try:
        config = kubeconfig.load(text)
        if context_name:
            config = kubeconfig.rename_context(config, context_name)
    except ValueError as exc:
        log.error("layer returned a bad kubeconfig for cluster %s: %s", cref.cluster_id, exc)
        raise ServerError(f"cluster {cluster_name}: the issued kubeconfig is invalid") from exc
    context = config["current-context"]
    if not context:
        raise ServerError(f"cluster {cluster_name}: the issued kubeconfig has no context")
    log.info(
        "issued kubeconfig: user=%s project=%s cluster=%s (%s) role=%s context=%s",
        principal.user_name,
        project_name,
        cluster_name,
        cref.cluster_id,
        "admin" if admin else "editor",
        context,
    )
    return api.ClusterCredentials(
        cluster=cref.name,
        context=context,
        user=principal.user_name,
        kubeconfig=text if not context_name else kubeconfig.dump(config),
    )
