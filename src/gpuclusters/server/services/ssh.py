"""``gpuclusters clusters ssh``: where and as whom a member's shell runs.

On the embedded fleet the answer is a local command line (nsenter into the
node's namespaces, then the member's own account); the CLI executes it. A
fleet of real machines answers with an SSH destination instead; the API
shape (``SshTarget``) stays the same.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.enums import ClusterStatus, ClusterType, NodePhase, ProjectRole
from gpuclusters.core.errors import InvalidStateError, NotFoundError
from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.server.db.models import Cluster, Node, User
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.tenancy import resolve_project

LOGIN_ROLE = "login"
_USABLE = (ClusterStatus.READY.value, ClusterStatus.DEGRADED.value)


async def ssh_target(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    cluster_name: str,
    node_name: str | None,
    command: list[str],
) -> api.SshTarget:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    cluster = await session.scalar(
        select(Cluster).where(
            Cluster.project_id == project.id,
            Cluster.name == cluster_name,
            Cluster.deleted_at.is_(None),
        )
    )
    if cluster is None:
        raise NotFoundError(f"cluster {cluster_name!r} not found", field="name")
    access = rt.node_access
    if access is None:
        raise InvalidStateError(
            f"provider {rt.provider.name} has no shell access to nodes; use the netns provider"
        )
    if cluster.status not in _USABLE:
        raise InvalidStateError(f"cluster {cluster_name} is {cluster.status}, not ready")
    user = await session.get_one(User, principal.user_id)
    if user.uid is None:
        raise InvalidStateError(f"user {user.name} has no Unix account")
    shell: NodeShell
    if node_name is None and cluster.cluster_type == ClusterType.SLURM.value:
        shell = await access.ensure_service_node(
            cluster_id=cluster.id,
            cluster_name=cluster.name,
            role=LOGIN_ROLE,
            volume_id=cluster.volume_id,
        )
    else:
        q = select(Node).where(
            Node.cluster_id == cluster.id,
            Node.deleted_at.is_(None),
            Node.phase == NodePhase.RUNNING.value,
        )
        if node_name is not None:
            q = q.where(Node.name == node_name)
        node = (await session.scalars(q.order_by(Node.created_at))).first()
        if node is None:
            raise NotFoundError(
                f"no running node {node_name!r} in cluster {cluster_name}"
                if node_name
                else f"cluster {cluster_name} has no running node",
                field="node",
            )
        shell = await access.shell(node.id)
    # Start in the member's home, as ssh does: the caller's own working
    # directory means nothing inside the node (and Slurm writes job output
    # to the submit directory on the compute nodes).
    home = f"/home/{user.name}"
    argv = shell.exec_argv(["env", f"--chdir={home}", *(command or ["bash", "-l"])], user=user.name)
    return api.SshTarget(cluster=cluster.name, node=shell.hostname, user=user.name, argv=argv)
