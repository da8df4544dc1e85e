"""``gpuclusters clusters ssh``: logging in to a cluster.

Users log in with SSH: ``ssh_certificate`` signs a public key the caller
sends (the CLI makes a fresh one per session) with the organization's user
CA, for the caller's own Unix account, and says where to connect: the
gateway host and the cluster's SSH port, which lead to the login node (and,
for ``node``, the name to jump on to from there). Nothing but the database
is involved, so the answer is quick and the certificate is the only
credential; it expires after ``settings.ssh_cert_validity_h``. Each issue is
logged (user, cluster, fingerprint, validity), never a key.

``ssh_target`` is the operator's path on the server machine: a local
command line (nsenter into the node's namespaces) that the CLI executes.
With ``as_root`` it is a root shell, for organization admins only; without,
it runs as the caller's own account.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import idblocks, sshca
from gpuclusters.core import models as api
from gpuclusters.core.enums import ClusterStatus, ClusterType, NodePhase, ProjectRole
from gpuclusters.core.errors import InvalidStateError, NotFoundError, ServerError
from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.server.db.models import Cluster, Node, Organization, Project, User
from gpuclusters.server.db.ssh import org_authority
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.ssh_keys import parse_key
from gpuclusters.server.services.sshca import gateway_known_hosts
from gpuclusters.server.services.tenancy import require_org_admin, resolve_project

log = logging.getLogger(__name__)

LOGIN_ROLE = "login"
ROOT = "root"
_USABLE = (ClusterStatus.READY.value, ClusterStatus.DEGRADED.value)


async def _usable_cluster(
    session: AsyncSession, *, principal: Principal, project_name: str, cluster_name: str
) -> tuple[Project, Cluster]:
    """The caller's (editor or better) live cluster, ready or degraded."""
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
    if cluster.status not in _USABLE:
        raise InvalidStateError(f"cluster {cluster_name} is {cluster.status}, not ready")
    return project, cluster


async def _running_node(session: AsyncSession, cluster: Cluster, node_name: str | None) -> Node:
    """The named running node of the cluster, or its oldest running one."""
    q = select(Node).where(
        Node.cluster_id == cluster.id,
        Node.deleted_at.is_(None),
        Node.phase == NodePhase.RUNNING.value,
    )
    if node_name is not None:
        if not node_name.isprintable():  # never a node's name; keep it out of queries
            raise NotFoundError(
                f"no running node {node_name!r} in cluster {cluster.name}", field="node"
            )
        q = q.where(Node.name == node_name)
    node = (await session.scalars(q.order_by(Node.created_at))).first()
    if node is None:
        raise NotFoundError(
            f"no running node {node_name!r} in cluster {cluster.name}"
            if node_name
            else f"cluster {cluster.name} has no running node",
            field="node",
        )
    return node


async def _unix_user(session: AsyncSession, principal: Principal) -> User:
    user = await session.get_one(User, principal.user_id)
    if user.uid is None:
        raise InvalidStateError(f"user {user.name} has no Unix account")
    return user


def node_hostname(node: Node) -> str:
    """The node's hostname inside the cluster (what the login node resolves).
    Providers name GPU nodes' hosts after the node (the netns provider sets
    the UTS hostname and every node's /etc/hosts so)."""
    return node.name


def user_key_id(*, organization: str, user: str, cluster: str, node: str | None = None) -> str:
    """The certificate's key id (sshd logs it with every login)."""
    key_id = f"gpuclusters:{organization}/{user}:{cluster}"
    return f"{key_id}/{node}" if node else key_id


async def ssh_certificate(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    cluster_name: str,
    body: api.SshCertificateRequest,
) -> api.SshCertificate:
    key = parse_key(body.public_key)
    _, cluster = await _usable_cluster(
        session, principal=principal, project_name=project_name, cluster_name=cluster_name
    )
    if cluster.ssh_port is None:
        if cluster.cluster_type != ClusterType.SLURM.value:
            raise InvalidStateError(
                f"cluster {cluster_name} is a Kubernetes cluster: it has no login node to SSH "
                "to; use kubectl (gpuclusters clusters credentials)"
            )
        raise InvalidStateError(f"cluster {cluster_name} has no SSH endpoint yet")
    node_host = None
    if body.node is not None:
        node_host = node_hostname(await _running_node(session, cluster, body.node))
    user = await _unix_user(session, principal)
    org = await session.get_one(Organization, principal.organization_id)
    user_ca = await org_authority(session, org.id, "user")
    host_ca = await org_authority(session, org.id, "host")
    await session.commit()  # keeps CAs made just now; no transaction while signing

    valid_for = timedelta(hours=rt.settings.ssh_cert_validity_h)
    try:
        certificate = sshca.sign_user_key(
            ca_private=user_ca.private_key,
            public_key=key.openssh,
            principal=user.name,
            key_id=user_key_id(
                organization=org.name, user=user.name, cluster=cluster.name, node=body.node
            ),
            valid_for=valid_for,
        )
        info = sshca.inspect_certificate(certificate)
    except sshca.SshKeyError as exc:  # pragma: no cover - the key was validated above
        raise ServerError(f"cluster {cluster_name}: the certificate cannot be made") from exc
    gateway = rt.settings.gateway_host
    log.info(
        "issued ssh certificate: user=%s project=%s cluster=%s (%s) node=%s fingerprint=%s "
        "valid_before=%s",
        user.name,
        project_name,
        cluster.name,
        cluster.id,
        body.node or "-",
        key.fingerprint,
        info.valid_before.isoformat(),
    )
    return api.SshCertificate(
        cluster=cluster.name,
        user=user.name,
        principal=user.name,
        certificate=certificate,
        valid_before=info.valid_before,
        host=gateway,
        port=cluster.ssh_port,
        known_hosts=gateway_known_hosts(
            host_ca_public=host_ca.public_key, gateway_host=gateway, organization=org.name
        ),
        node_host=node_host,
    )


async def ssh_target(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    cluster_name: str,
    node_name: str | None,
    command: list[str],
    as_root: bool = False,
) -> api.SshTarget:
    if as_root:
        require_org_admin(principal, "a root shell on nodes")
    _, cluster = await _usable_cluster(
        session, principal=principal, project_name=project_name, cluster_name=cluster_name
    )
    access = rt.node_access
    if access is None:
        raise InvalidStateError(
            f"provider {rt.provider.name} has no shell access to nodes; use the netns provider"
        )
    user = None if as_root else await _unix_user(session, principal)
    shell: NodeShell
    if node_name is None and cluster.cluster_type == ClusterType.SLURM.value:
        shell = await access.ensure_service_node(
            cluster_id=cluster.id,
            cluster_name=cluster.name,
            role=LOGIN_ROLE,
            volume_id=cluster.volume_id,
            host_ids=idblocks.block(
                (await session.get_one(Project, cluster.project_id)).id_block,
                rt.settings.id_blocks_start,
            ),
        )
    else:
        node = await _running_node(session, cluster, node_name)
        shell = await access.shell(node.id)
    if user is None:
        log.info(
            "root shell: user=%s project=%s cluster=%s node=%s",
            principal.user_name,
            project_name,
            cluster.name,
            shell.hostname,
        )
        argv = shell.exec_argv(["env", "--chdir=/root", *(command or ["bash", "-l"])])
        return api.SshTarget(cluster=cluster.name, node=shell.hostname, user=ROOT, argv=argv)
    # Start in the member's home, as ssh does: the caller's own working
    # directory means nothing inside the node (and Slurm writes job output
    # to the submit directory on the compute nodes).
    home = f"/home/{user.name}"
    argv = shell.exec_argv(["env", f"--chdir={home}", *(command or ["bash", "-l"])], user=user.name)
    return api.SshTarget(cluster=cluster.name, node=shell.hostname, user=user.name, argv=argv)
