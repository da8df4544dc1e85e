"""Hosts with host agents: join tokens, joining, heartbeats, removal
(docs/hosts.md).

An org admin (``gpuclusters hosts add``) asks for a join token naming the
host; the agent on that host sends the token with a certificate request
(``POST /v1/hosts/join``) and gets its certificate (hosts CA), the control
CA it accepts callers from, and a secret for its heartbeats. The host's row
is ``joining`` until the first heartbeat, then ``ready``; a host whose
heartbeats stop for ``host_agent_timeout_s`` becomes ``unreachable``
(housekeeping's ``sweep_unreachable_hosts``), gets nothing new placed on it,
and its nodes are left to the health rules (their own agents go silent too:
``heartbeat_missed`` alerts, then repair by policy). Nothing on such a host
is ever deleted because it is silent: the server cannot know what runs
there, so it fails closed.

Tokens are 256-bit random, single use, and stored as SHA-256 like API keys.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from datetime import timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.catalog import GPU_TYPES
from gpuclusters.core.enums import (
    GPUS_PER_NODE,
    ComputeClass,
    EventReason,
    HostAgentStatus,
    HostState,
    NodePhase,
)
from gpuclusters.core.errors import (
    AuthenticationError,
    ConflictError,
    InvalidStateError,
    NotFoundError,
    ValidationError,
)
from gpuclusters.core.health.rules import RepairAction
from gpuclusters.server.controllers import hints
from gpuclusters.server.controllers.alerts import OPEN_STATES
from gpuclusters.server.db.allocation import mark_preempted
from gpuclusters.server.db.models import Cluster, Host, HostJoinToken, Node, Remediation, utcnow
from gpuclusters.server.db.records import close_usage, record_event, set_node_phase
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.hosts_pki import CsrError, ensure_hosts_pki, sign_agent_csr
from gpuclusters.server.security.keys import hash_key, new_key
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.security.tls import fingerprint, served_ca_file
from gpuclusters.server.services.catalog import get_host, host_view
from gpuclusters.server.services.tenancy import require_org_admin

log = logging.getLogger(__name__)

DEFAULT_SIMULATED_GPU_TYPE = "H100_SXM"


async def create_join_token(
    session: AsyncSession, *, rt: Runtime, principal: Principal, body: api.HostJoinTokenCreate
) -> api.HostJoinToken:
    require_org_admin(principal, "the host inventory")
    existing = await session.scalar(select(Host).where(Host.name == body.name))
    if existing is not None and existing.agent_status is None and existing.in_fleet:
        raise InvalidStateError(
            f"name: {body.name!r} is a host of the fleet file; choose another name", field="name"
        )
    if existing is not None and existing.agent_status not in (None, HostAgentStatus.REMOVED):
        live = await session.scalar(
            select(Node.name).where(Node.host_id == existing.id, Node.deleted_at.is_(None))
        )
        if live is not None:
            raise InvalidStateError(
                f"host {body.name} runs node {live}; drain and remove it before joining it again",
                field="name",
            )
    token = new_key()
    expires_at = utcnow() + timedelta(seconds=body.ttl_s)
    session.add(
        HostJoinToken(
            token_hash=hash_key(token),
            host_name=body.name,
            region=body.region or rt.settings.region,
            ib_island=body.ib_island or body.name,
            expires_at=expires_at,
        )
    )
    await session.commit()
    ca_file = served_ca_file(rt.settings) if rt.settings.tls_enabled else None
    ca_fp: str | None = None
    if ca_file is not None:
        try:
            ca_fp = fingerprint(await asyncio.to_thread(ca_file.read_bytes))
        except (OSError, ValueError):
            ca_fp = None
    return api.HostJoinToken(
        name=body.name,
        token=token,
        expires_at=expires_at,
        server_url=rt.settings.tls_url if rt.settings.tls_enabled else None,
        ca_fingerprint=ca_fp,
    )


def _gpu_fields(inventory: dict[str, Any]) -> tuple[str, int]:
    """The host's GPU type (a catalog name) and count from its inventory; a
    host without GPUs offers the simulated type its agent names."""
    model = inventory.get("gpu_model")
    count = inventory.get("gpu_count")
    if isinstance(model, str) and model in GPU_TYPES and isinstance(count, int) and count > 0:
        return model, count
    simulated = inventory.get("simulated_gpu_type")
    if isinstance(simulated, str) and simulated in GPU_TYPES:
        return simulated, GPUS_PER_NODE
    return DEFAULT_SIMULATED_GPU_TYPE, GPUS_PER_NODE


def _check_gpus(inventory: dict[str, Any]) -> None:
    """A host with GPUs must have 8 of one type of the catalog: a node is
    8 GPUs, and placement knows no other shape."""
    count = inventory.get("gpu_count")
    if not isinstance(count, int) or count == 0:
        return  # no GPUs: the simulated backend
    model = inventory.get("gpu_model")
    if model not in GPU_TYPES or count != GPUS_PER_NODE:
        raise ValidationError(
            f"inventory: the host has {count} GPUs of model {model!r}; hosts need "
            f"{GPUS_PER_NODE} GPUs of one type of {', '.join(sorted(GPU_TYPES))}",
            field="inventory",
        )


def _apply_inventory(host: Host, inventory: dict[str, Any]) -> None:
    host.inventory = json.dumps(inventory, sort_keys=True)
    host.gpu_type, host.num_gpus = _gpu_fields(inventory)
    nvme = inventory.get("nvme_gib")
    host.nvme_gib = int(nvme) if isinstance(nvme, int | float) and nvme >= 0 else 0


async def join(session: AsyncSession, *, rt: Runtime, body: api.HostJoin) -> api.HostJoined:
    """A host agent joins with its token: its row is made (or renewed: a
    re-installed host), its certificate signed, its heartbeat secret issued."""
    now = utcnow()
    token = await session.scalar(
        select(HostJoinToken).where(HostJoinToken.token_hash == hash_key(body.token))
    )
    if token is None or token.used_at is not None or token.expires_at <= now:
        raise AuthenticationError("the join token is unknown, used or expired")
    if not hmac.compare_digest(token.host_name, body.name):
        raise ValidationError(
            f"name: the token is for host {token.host_name!r}, not {body.name!r}", field="name"
        )
    _check_gpus(body.inventory)
    pki = await asyncio.to_thread(ensure_hosts_pki, rt.settings.home)
    try:
        cert = sign_agent_csr(pki, body.csr_pem, name=body.name, address=body.address)
    except (CsrError, ValueError) as exc:
        raise ValidationError(f"csr_pem: {exc}", field="csr_pem") from exc
    # Claim the token first, in one conditional UPDATE: of two joins sent at
    # once with one token, exactly one gets it.
    claimed = await session.execute(
        update(HostJoinToken)
        .where(HostJoinToken.id == token.id, HostJoinToken.used_at.is_(None))
        .values(used_at=now)
    )
    if claimed.rowcount != 1:  # type: ignore[attr-defined]
        await session.rollback()
        raise AuthenticationError("the join token is unknown, used or expired")
    secret = new_key()
    host = await session.scalar(select(Host).where(Host.name == body.name))
    if host is None:
        host = Host(name=body.name, state=HostState.AVAILABLE.value)
        session.add(host)
    elif host.agent_status == HostAgentStatus.REMOVED:
        host.state = HostState.AVAILABLE.value  # removed, then added again
    host.region = token.region
    host.ib_island = token.ib_island
    host.in_fleet = True
    host.agent_status = HostAgentStatus.JOINING.value
    host.address = body.address
    host.agent_port = body.port
    host.secret_hash = hash_key(secret)
    host.cert_fingerprint = fingerprint(cert)
    _apply_inventory(host, body.inventory)
    try:
        await session.commit()
    except IntegrityError as exc:
        await session.rollback()
        raise ConflictError(f"host {body.name} joined at the same moment from elsewhere") from exc
    log.info("host %s joined from %s", body.name, body.address)
    return api.HostJoined(
        name=body.name,
        certificate_pem=cert.decode(),
        control_ca_pem=pki.control_ca.cert.decode(),
        secret=secret,
    )


async def heartbeat(
    session: AsyncSession, *, rt: Runtime, name: str, secret: str | None, body: api.HostHeartbeat
) -> None:
    host = await session.scalar(select(Host).where(Host.name == name))
    if (
        host is None
        or secret is None
        or host.secret_hash is None
        or host.agent_status == HostAgentStatus.REMOVED
        or not hmac.compare_digest(host.secret_hash, hash_key(secret))
    ):
        raise AuthenticationError("unknown host or wrong host secret")
    was = host.agent_status
    host.last_heartbeat_at = utcnow()
    host.agent_status = HostAgentStatus.READY.value
    _apply_inventory(host, body.inventory)
    await session.commit()
    if was != HostAgentStatus.READY:
        log.info("host %s is ready (was %s)", name, was)
        rt.hints.notify(hints.CLUSTERS)  # capacity for queued clusters and the pool


async def remove_host(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    name: str,
    force_reason: str | None = None,
) -> api.Host:
    """Take a host out of the fleet: only when no node is on it (drain it
    first); its credentials stop working. Idempotent.

    ``force_reason``: the host is gone for good (dead hardware, a wiped
    machine), so it cannot be drained. It is removed anyway; the nodes on it
    fail with the reason (their clusters degrade and repair policies may
    replace them elsewhere), and releasing them later skips the agent that
    is no longer there."""
    require_org_admin(principal, "the host inventory")
    if force_reason is not None:
        force_reason = force_reason.strip()
        if not force_reason:
            raise ValidationError(
                "reason: a forced removal needs a reason (it is recorded)", field="reason"
            )
    host = await session.scalar(select(Host).where(Host.name == name))
    if host is not None and host.agent_status == HostAgentStatus.REMOVED:
        return host_view(host)
    if host is None or not host.in_fleet:
        raise NotFoundError(f"host {name!r} not found in the fleet", field="name")
    if host.agent_status is None:
        raise InvalidStateError(
            f"host {name} comes from the fleet file; edit that file to remove it", field="name"
        )
    live = list(
        await session.scalars(
            select(Node).where(
                (Node.host_id == host.id) | (Node.awaited_host_id == host.id),
                Node.deleted_at.is_(None),
            )
        )
    )
    if live and force_reason is None:
        raise InvalidStateError(
            f"host {name} still holds node {live[0].name}; `gpuclusters hosts drain {name}` "
            "first (or, for a host that is gone for good, `hosts remove --force --reason`)",
            field="name",
        )
    why = f"host {name} removed by {principal.user_name}: {force_reason}"
    for node in live:
        if node.awaited_host_id == host.id:
            node.awaited_host_id = None  # placed again at its next step
            continue
        await record_event(session, node, EventReason.STEP_SKIPPED, why)
        if not node.to_delete and node.phase != NodePhase.FAILED.value:
            set_node_phase(node, NodePhase.FAILED.value, why)
            await close_usage(session, node)
            await record_event(session, node, EventReason.NODE_FAILED, why)
    host.agent_status = HostAgentStatus.REMOVED.value
    host.state = HostState.CORDONED.value
    host.in_fleet = False
    host.secret_hash = None
    await session.commit()
    if live:
        rt.hints.notify(hints.NODES, hints.CLUSTERS, hints.REPAIRS)
    return host_view(host)


async def drain_host(
    session: AsyncSession, *, rt: Runtime, principal: Principal, name: str
) -> api.Host:
    """Empty a host for maintenance or removal, under the usual rules:
    cordon it (nothing new lands there), preempt a preemptible node with
    the full notice, and move a standard node to another host with an
    approved ``migrate`` repair (cordon, drain with job protection, a new
    node elsewhere; docs/health.md). Idempotent."""
    require_org_admin(principal, "the host inventory")
    host = await session.scalar(select(Host).where(Host.name == name, Host.in_fleet.is_(True)))
    if host is None:
        raise NotFoundError(f"host {name!r} not found in the fleet", field="name")
    host.state = HostState.CORDONED.value
    node = await session.scalar(
        select(Node).where(Node.host_id == host.id, Node.deleted_at.is_(None))
    )
    if node is not None and node.compute_class == ComputeClass.PREEMPTIBLE.value:
        await mark_preempted(session, host_id=host.id, why=f"host {name} drained by an admin")
    elif node is not None and not node.to_delete:
        key = f"drain:{host.id}:{node.id}"
        if await session.scalar(
            select(Remediation.id).where(Remediation.idempotency_key == key)
        ) is None and not await session.scalar(
            select(Remediation.id).where(
                Remediation.node_id == node.id, Remediation.state.in_(OPEN_STATES)
            )
        ):
            if node.phase != NodePhase.RUNNING.value:
                raise InvalidStateError(
                    f"node {node.name} on host {name} is {node.phase}; drain it once it runs",
                    field="name",
                )
            cluster = await session.get_one(Cluster, node.cluster_id)
            now = utcnow()
            session.add(
                Remediation(
                    project_id=cluster.project_id,
                    cluster_id=node.cluster_id,
                    node_id=node.id,
                    node_name=node.name,
                    action=RepairAction.MIGRATE.value,
                    state="pending",
                    trigger="manual",
                    reason=f"host {name} drained by an admin",
                    kinds="",
                    requested_by=principal.user_name,
                    reviewed_by=principal.user_name,
                    idempotency_key=key,
                    alert_ids="[]",
                    created_at=now,
                    updated_at=now,
                )
            )
    await session.commit()
    rt.hints.notify(hints.NODES)
    rt.hints.notify(hints.REPAIRS)
    return await get_host(session, principal=principal, name=name)
