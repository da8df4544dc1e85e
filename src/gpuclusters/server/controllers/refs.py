"""Translate database rows into the plain values providers and layers take,
so those packages never see SQLAlchemy objects."""

from __future__ import annotations

import logging
from dataclasses import replace

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import idblocks
from gpuclusters.core.autoscale import DEFAULT_IDLE_S, slot_names
from gpuclusters.core.idblocks import IdBlock
from gpuclusters.layers.base import (
    AutoscaleRef,
    ClusterRef,
    GatewayRef,
    NodeRef,
    RegistryRef,
    SshAccess,
    TokenIssuerRef,
    UnixUser,
)
from gpuclusters.providers.base import NodeSpec
from gpuclusters.server.db.allocation import WorkProbe
from gpuclusters.server.db.models import Cluster, Host, Node, Project, ProjectMember, User
from gpuclusters.server.db.ssh import live_keys, org_authority
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.cluster_tokens import DISCOVERY_PATH, audience_of

log = logging.getLogger(__name__)


def cluster_ref(
    cluster: Cluster, users: tuple[UnixUser, ...] = (), nodes: tuple[NodeRef, ...] = ()
) -> ClusterRef:
    return ClusterRef(
        cluster_id=cluster.id,
        name=cluster.name,
        cluster_type=cluster.cluster_type,
        gpu_type=cluster.gpu_type,
        volume_id=cluster.volume_id,
        slurm_extra_config=cluster.slurm_extra_config,
        slurm_prolog=cluster.slurm_prolog,
        slurm_epilog=cluster.slurm_epilog,
        users=users,
        nodes=nodes,
        autoscale=autoscale_ref(cluster),
    )


def autoscale_ref(cluster: Cluster) -> AutoscaleRef | None:
    if cluster.autoscale_max_gpus is None:
        return None
    return AutoscaleRef(
        min_gpus=cluster.autoscale_min_gpus or 0,
        max_gpus=cluster.autoscale_max_gpus,
        idle_s=cluster.autoscale_idle_s or DEFAULT_IDLE_S,
        slots=slot_names(cluster.name, cluster.autoscale_max_gpus),
    )


async def cluster_users(session: AsyncSession, cluster: Cluster) -> tuple[UnixUser, ...]:
    """Accounts the cluster's nodes must have: every member of its project,
    and the organization's admins (they may act in every project). Project
    admins and organization admins administer the orchestrator too. Deleted
    users are never included (their Unix accounts and files stay on nodes,
    but nobody may log in as them)."""
    project = await session.get_one(Project, cluster.project_id)
    roles = dict(
        (
            await session.execute(
                select(ProjectMember.user_id, ProjectMember.role).where(
                    ProjectMember.project_id == project.id
                )
            )
        ).all()
    )
    rows = await session.scalars(
        select(User)
        .where(
            User.organization_id == project.organization_id,
            User.uid.is_not(None),
            User.deleted_at.is_(None),
            or_(User.is_admin.is_(True), User.id.in_(list(roles))),
        )
        .order_by(User.uid)
    )
    return tuple(
        UnixUser(name=u.name, uid=u.uid, admin=u.is_admin or roles.get(u.id) == "admin")
        for u in rows
        if u.uid is not None
    )


async def load_cluster_ref(
    session: AsyncSession,
    cluster: Cluster,
    rt: Runtime | None = None,
    *,
    ssh: bool = False,
    users: bool = True,
) -> ClusterRef:
    """The cluster as layers see it. With the runtime, also where users
    reach it (the gateway), where the provider has nodes to log in to; with
    ``ssh``, who may log in over SSH (the CAs and members' keys: a few
    queries that only steps setting up sshd need). Without ``users`` the
    members' accounts are left out: taking a node out (cordon, drain,
    remove) needs none, and they cost three queries."""
    # Plain columns, not entities: every step that calls a layer loads the
    # cluster's nodes, and building ORM objects for them was most of the cost.
    rows = await session.execute(
        select(Node.id, Node.name, Host.name, Node.compute_class)
        .outerjoin(Host, Host.id == Node.host_id)
        .where(
            Node.cluster_id == cluster.id,
            Node.deleted_at.is_(None),
            Node.phase.in_(("bootstrapping", "running")),
        )
        .order_by(Node.name)
    )
    nodes = tuple(
        NodeRef(node_id=node_id, name=name, host=host or "", compute_class=compute_class)
        for node_id, name, host, compute_class in rows
    )
    accounts = await cluster_users(session, cluster) if users or ssh else ()
    ref = cluster_ref(cluster, accounts, nodes)
    project = await session.get_one(Project, cluster.project_id)
    start = rt.settings.id_blocks_start if rt is not None else idblocks.DEFAULT_START
    ref = replace(ref, host_ids=idblocks.block(project.id_block, start))
    if rt is None or rt.node_access is None:
        return ref
    gateway = GatewayRef(
        host=rt.settings.gateway_host,
        ssh_port=cluster.ssh_port,
        kubernetes_port=cluster.kubernetes_port,
    )
    access = await ssh_access(session, cluster, accounts) if ssh else None
    return replace(
        ref,
        gateway=gateway,
        ssh=access,
        registry=registry_ref(rt, cluster.id),
        token_issuer=token_issuer_ref(rt, cluster.id),
    )


def token_issuer_ref(rt: Runtime, cluster_id: str) -> TokenIssuerRef | None:
    """The server as the signer of users' Kubernetes tokens, as the
    cluster's apiserver trusts it: its keys are read on the registry's
    token listener, the one listener of the server nodes may reach."""
    if rt.token_issuer is None or rt.registry is None:
        return None
    host = rt.settings.gateway_host
    if ":" in host:
        host = f"[{host}]"
    return TokenIssuerRef(
        issuer=rt.token_issuer.issuer,
        audience=audience_of(cluster_id),
        discovery_url=f"https://{host}:{rt.settings.registry_token_port}{DISCOVERY_PATH}",
        ca_pem=rt.registry.ca_pem,
    )


def registry_ref(rt: Runtime, cluster_id: str) -> RegistryRef | None:
    """The registry as the cluster's nodes use it; ``None`` without one."""
    if rt.registry is None:
        return None
    user, password = rt.registry.keys.cluster_credential(cluster_id)
    return RegistryRef(
        address=rt.settings.registry_address,
        ca_pem=rt.registry.ca_pem,
        user=user,
        password=password,
        mirrors=tuple(
            (host, tuple(endpoints))
            for host, endpoints in sorted(rt.settings.registry_mirrors.items())
        ),
    )


async def ssh_access(
    session: AsyncSession, cluster: Cluster, users: tuple[UnixUser, ...]
) -> SshAccess:
    """The organization's CAs and the allowed accounts' registered keys."""
    project = await session.get_one(Project, cluster.project_id)
    org = project.organization_id
    user_ca = await org_authority(session, org, "user")
    host_ca = await org_authority(session, org, "host")
    ids = dict(
        (
            await session.execute(
                select(User.name, User.id).where(
                    User.organization_id == org, User.name.in_([u.name for u in users])
                )
            )
        ).all()
    )
    keys = await live_keys(session, list(ids.values()))
    return SshAccess(
        user_ca_public_key=user_ca.public_key,
        host_ca_private_key=host_ca.private_key,
        authorized_keys=tuple((u.name, tuple(keys.get(ids.get(u.name, ""), []))) for u in users),
    )


def node_ref(node: Node, host: Host | None) -> NodeRef:
    return NodeRef(
        node_id=node.id,
        name=node.name,
        host=host.name if host else "",
        compute_class=node.compute_class,
        slot=node.slot,
    )


def node_spec(node: Node, cluster: Cluster, host: Host, ids: IdBlock) -> NodeSpec:
    return NodeSpec(
        node_id=node.id,
        name=node.name,
        cluster_id=cluster.id,
        cluster_name=cluster.name,
        host=host.name,
        gpu_type=cluster.gpu_type,
        compute_class=node.compute_class,
        volume_id=cluster.volume_id,
        host_ids=ids,
        labels={
            "gpuclusters.io/compute-class": node.compute_class,
            "gpuclusters.io/gpu-type": cluster.gpu_type,
            "gpuclusters.io/ib-island": host.ib_island,
        },
    )


def work_probe(session: AsyncSession, rt: Runtime) -> WorkProbe:
    """How much work runs on a preemptible node, asked of its cluster's
    orchestrator; a node whose orchestrator does not answer counts as busy
    (the safe guess when choosing whom to preempt)."""

    async def probe(node: Node) -> int:
        cluster = await session.get_one(Cluster, node.cluster_id)
        host = await session.get(Host, node.host_id) if node.host_id else None
        try:
            layer = rt.layer_for(cluster.cluster_type)
            return await layer.running_work(cluster_ref(cluster), node_ref(node, host))
        except Exception as exc:
            log.info("running work on %s unknown (%s); counted as busy", node.name, exc)
            return 1

    return probe
