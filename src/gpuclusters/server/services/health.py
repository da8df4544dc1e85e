"""Health use cases: alerts and repairs (lists, review, manual requests),
fault injection on the embedded fleet, active checks. How findings become
alerts and alerts become repair recommendations is in
``controllers/alerts.py`` (heartbeats and housekeeping drive it).

Alerts: each heartbeat carries the node's current findings; a finding opens
an alert (one per node, kind, GPU and subject), a repeat refreshes it, and
an alert whose finding is gone is resolved. Missed heartbeats are noticed
by housekeeping (``note_missed_heartbeats``).

Recommendations: after alerts change, the rules (``core.health.rules``)
choose an action for the node's open alerts. When it is a repair and no
repair of that node is open yet, a remediation is recorded (idempotency key
``auto:<node>:<first alert>:<action>``), ``pending`` if the cluster's policy
lets it run alone, ``pending_approval`` otherwise. A remediation still
waiting whose alerts all resolved becomes ``auto_resolved``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.enums import NodePhase, ProjectRole
from gpuclusters.core.errors import (
    InvalidStateError,
    NotFoundError,
    ValidationError,
)
from gpuclusters.core.health.findings import AlertKind
from gpuclusters.server.controllers import hints
from gpuclusters.server.controllers.alerts import OPEN_STATES, open_alerts_of
from gpuclusters.server.db.models import (
    Alert,
    Cluster,
    HealthRun,
    Node,
    Project,
    Remediation,
    utcnow,
)
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.nodes import live_node
from gpuclusters.server.services.tenancy import require_org_admin, resolve_project
from gpuclusters.server.services.views import node_views

FAULTS_FILE = "/run/gpuclusters/faults.json"


# --- views --------------------------------------------------------------------------------


def alert_view(a: Alert, cluster: str) -> api.HealthAlert:
    return api.HealthAlert(
        id=a.id,
        cluster=cluster,
        node=a.node_name,
        kind=a.kind,
        severity=a.severity,
        gpu=None if a.gpu < 0 else a.gpu,
        code=a.code,
        subject=a.subject or None,
        message=a.message,
        started_at=a.started_at,
        last_seen_at=a.last_seen_at,
        resolved_at=a.resolved_at,
    )


def remediation_view(r: Remediation, cluster: str) -> api.Repair:
    return api.Repair(
        id=r.id,
        cluster=cluster,
        node=r.node_name,
        action=r.action,
        state=r.state,
        step=r.step or None,
        trigger=r.trigger,
        reason=r.reason,
        message=r.message,
        requested_by=r.requested_by,
        reviewed_by=r.reviewed_by,
        idempotency_key=r.idempotency_key,
        alert_ids=json.loads(r.alert_ids),
        health_run_ids=json.loads(r.health_run_ids),
        created_at=r.created_at,
        updated_at=r.updated_at,
        started_at=r.started_at,
        finished_at=r.finished_at,
    )


def health_run_view(h: HealthRun, cluster: str) -> api.HealthRun:
    return api.HealthRun(
        id=h.id,
        cluster=cluster,
        node=h.node_name,
        check=h.check,
        state=h.state,
        reason=h.reason,
        metrics=json.loads(h.metrics or "{}"),
        output=h.output,
        duration_s=h.duration_s,
        requested_by=h.requested_by,
        created_at=h.created_at,
        started_at=h.started_at,
        finished_at=h.finished_at,
    )


async def _cluster_names(session: AsyncSession, project: Project) -> dict[str, str]:
    rows = await session.execute(
        select(Cluster.id, Cluster.name).where(Cluster.project_id == project.id)
    )
    return {cid: name for cid, name in rows}


async def _cluster_id(session: AsyncSession, project: Project, name: str) -> str:
    cid = await session.scalar(
        select(Cluster.id).where(
            Cluster.project_id == project.id, Cluster.name == name, Cluster.deleted_at.is_(None)
        )
    )
    if cid is None:
        raise NotFoundError(f"cluster {name!r} not found", field="cluster")
    return cid


async def list_alerts(
    session: AsyncSession,
    *,
    principal: Principal,
    project_name: str,
    cluster: str | None,
    include_resolved: bool,
) -> list[api.HealthAlert]:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    q = select(Alert).where(Alert.project_id == project.id)
    if cluster is not None:
        q = q.where(Alert.cluster_id == await _cluster_id(session, project, cluster))
    if not include_resolved:
        q = q.where(Alert.resolved_at.is_(None))
    names = await _cluster_names(session, project)
    rows = await session.scalars(q.order_by(Alert.started_at.desc()))
    return [alert_view(a, names.get(a.cluster_id, "")) for a in rows]


# --- repairs ------------------------------------------------------------------------------


async def _remediation(session: AsyncSession, project: Project, repair_id: str) -> Remediation:
    rem = await session.get(Remediation, repair_id)
    if rem is None or rem.project_id != project.id:
        raise NotFoundError(f"repair {repair_id!r} not found", field="id")
    return rem


async def list_repairs(
    session: AsyncSession,
    *,
    principal: Principal,
    project_name: str,
    cluster: str | None,
    state: str | None,
) -> list[api.Repair]:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    q = select(Remediation).where(Remediation.project_id == project.id)
    if cluster is not None:
        q = q.where(Remediation.cluster_id == await _cluster_id(session, project, cluster))
    if state is not None:
        q = q.where(Remediation.state == state)
    names = await _cluster_names(session, project)
    rows = await session.scalars(q.order_by(Remediation.created_at.desc()))
    return [remediation_view(r, names.get(r.cluster_id, "")) for r in rows]


async def get_repair(
    session: AsyncSession, *, principal: Principal, project_name: str, repair_id: str
) -> api.Repair:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    rem = await _remediation(session, project, repair_id)
    return remediation_view(rem, (await _cluster_names(session, project)).get(rem.cluster_id, ""))


async def review_repair(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    repair_id: str,
    verdict: str,
) -> api.Repair:
    """``approve`` (pending_approval -> pending), ``reject`` (-> cancelled)
    or ``cancel`` (any state before the node is touched -> cancelled).
    Repeating a verdict already applied answers the same record."""
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    rem = await _remediation(session, project, repair_id)
    now = utcnow()
    if verdict == "approve":
        if rem.state == "pending_approval":
            rem.state, rem.reviewed_by = "pending", principal.user_name
            rem.message = f"approved by {principal.user_name}"
        elif not (rem.state in ("pending", "running", "succeeded") and rem.reviewed_by):
            raise InvalidStateError(f"repair {rem.id} is {rem.state}; nothing to approve")
    elif verdict == "reject":
        if rem.state == "pending_approval":
            rem.state, rem.reviewed_by = "cancelled", principal.user_name
            rem.message = f"rejected by {principal.user_name}"
            rem.finished_at = now
        elif rem.state != "cancelled":
            raise InvalidStateError(
                f"repair {rem.id} is {rem.state}; only a waiting one is rejected"
            )
    else:
        if rem.state in ("pending_approval", "pending") or (
            rem.state == "running" and rem.step in ("cordoning", "draining")
        ):
            rem.state = "cancelled"
            rem.message = f"cancelled by {principal.user_name}" + (
                " (the node is uncordoned)" if rem.step else ""
            )
            rem.finished_at = now
        elif rem.state != "cancelled":
            raise InvalidStateError(
                f"repair {rem.id} is {rem.state}"
                + (f" ({rem.step})" if rem.step else "")
                + "; it can no longer be cancelled"
            )
    rem.updated_at = now
    await session.commit()
    rt.hints.notify(hints.REPAIRS)
    return remediation_view(rem, (await _cluster_names(session, project)).get(rem.cluster_id, ""))


async def request_repair(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    body: api.RepairCreate,
) -> api.Repair:
    """A manual repair (approved by asking). Idempotent on the key: the same
    key answers the record it made."""
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    names = await _cluster_names(session, project)
    key = f"manual:{project.id}:{body.idempotency_key}"
    existing = await session.scalar(select(Remediation).where(Remediation.idempotency_key == key))
    if existing is not None:
        return remediation_view(existing, names.get(existing.cluster_id, ""))
    node = await live_node(session, project, body.node, field="node")
    if node.phase != NodePhase.RUNNING.value or node.to_delete:
        raise InvalidStateError(
            f"node {node.name} is {node.phase}; only running nodes are repaired"
        )
    if await session.scalar(
        select(Remediation.id).where(
            Remediation.node_id == node.id, Remediation.state.in_(OPEN_STATES)
        )
    ):
        raise InvalidStateError(f"node {node.name} already has an open repair", field="node")
    alerts = await open_alerts_of(session, node.id)
    now = utcnow()
    rem = Remediation(
        project_id=project.id,
        cluster_id=node.cluster_id,
        node_id=node.id,
        node_name=node.name,
        action=body.action.value,
        state="pending",
        trigger="manual",
        reason=body.reason,
        kinds=",".join(sorted({a.kind for a in alerts})),
        requested_by=principal.user_name,
        reviewed_by=principal.user_name,
        idempotency_key=key,
        alert_ids=json.dumps(sorted(a.id for a in alerts)),
        created_at=now,
        updated_at=now,
    )
    session.add(rem)
    await session.commit()
    rt.hints.notify(hints.REPAIRS)
    return remediation_view(rem, names.get(rem.cluster_id, ""))


# --- fault injection ----------------------------------------------------------------------


def add_fault(faults: dict[str, Any], spec: api.FaultSpec) -> dict[str, Any]:
    """Merge one injected fault into the node's faults file contents."""
    out = json.loads(json.dumps(faults)) if faults else {}
    if spec.kind == "disk-ro":
        out["disk_ro"] = True
        return out
    gpu = out.setdefault("gpus", {}).setdefault(str(spec.gpu), {})
    if spec.kind == "xid":
        gpu["xids"] = sorted({int(x) for x in gpu.get("xids", [])} | {int(spec.code or 0)})
    elif spec.kind == "ecc-dbe":
        gpu["ecc_dbe"] = int(gpu.get("ecc_dbe", 0)) + 1
    elif spec.kind == "fell-off-bus":
        gpu["fell_off_bus"] = True
    elif spec.kind == "thermal":
        gpu["thermal"] = True
    elif spec.kind == "row-remap":
        gpu["row_remap_failure"] = True
    elif spec.kind == "pcie-replay":
        gpu["pcie_replays_per_min"] = float(spec.code or 1000)
    return out


async def inject_fault(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    node_name: str,
    spec: api.FaultSpec | None,
) -> api.Node:
    """Write a simulated fault into a node of the embedded fleet (``spec``
    None clears them). Org admins only; refused where GPUs are real."""
    require_org_admin(principal, "fault injection")
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    node = await live_node(session, project, node_name, field="node")
    access = rt.node_access
    if access is None:
        raise InvalidStateError("fault injection needs the embedded fleet (provider netns)")
    if node.gpu_backend not in (None, "simulated"):
        raise InvalidStateError(
            f"node {node.name} has real GPUs ({node.gpu_backend}); faults are injected only "
            "into simulated ones"
        )
    if node.phase != NodePhase.RUNNING.value:
        raise InvalidStateError(f"node {node.name} is {node.phase}, not running")
    shell = await access.shell(node.id)
    current: dict[str, Any] = {}
    if spec is not None:
        raw = await shell.read_file(FAULTS_FILE)
        try:
            current = json.loads(raw) if raw else {}
        except ValueError:
            current = {}
        current = add_fault(current, spec)
    await shell.write_file(FAULTS_FILE, json.dumps(current, indent=2).encode())
    cluster = await session.get_one(Cluster, node.cluster_id)
    return (await node_views(session, [node], clusters={cluster.id: cluster}))[0]


# --- active checks ------------------------------------------------------------------------


async def run_checks(
    session: AsyncSession,
    *,
    rt: Runtime,
    principal: Principal,
    project_name: str,
    cluster_name: str,
    body: api.HealthRunCreate,
) -> list[api.HealthRun]:
    """Queue one run of ``body.check`` per node (or on the named node)."""
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.ADMIN
    )
    cid = await _cluster_id(session, project, cluster_name)
    q = select(Node).where(
        Node.cluster_id == cid, Node.deleted_at.is_(None), Node.to_delete.is_(False)
    )
    if body.node is not None:
        q = q.where(Node.name == body.node)
    nodes = list(await session.scalars(q.order_by(Node.name)))
    if body.node is not None and not nodes:
        raise NotFoundError(f"node {body.node!r} not found in {cluster_name}", field="node")
    running = [n for n in nodes if n.phase == NodePhase.RUNNING.value]
    if not running:
        raise InvalidStateError(f"cluster {cluster_name} has no running node to check")
    now = utcnow()
    runs = [
        HealthRun(
            project_id=project.id,
            cluster_id=cid,
            node_id=n.id,
            node_name=n.name,
            check=body.check,
            duration_s=body.duration_s,
            state="pending",
            requested_by=principal.user_name,
            created_at=now,
        )
        for n in running
    ]
    session.add_all(runs)
    await session.commit()
    rt.hints.notify(hints.HEALTH)
    return [health_run_view(h, cluster_name) for h in runs]


async def list_health_runs(
    session: AsyncSession, *, principal: Principal, project_name: str, cluster: str | None
) -> list[api.HealthRun]:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    q = select(HealthRun).where(HealthRun.project_id == project.id)
    if cluster is not None:
        q = q.where(HealthRun.cluster_id == await _cluster_id(session, project, cluster))
    names = await _cluster_names(session, project)
    rows = await session.scalars(q.order_by(HealthRun.created_at.desc(), HealthRun.node_name))
    return [health_run_view(h, names.get(h.cluster_id, "")) for h in rows]


async def get_health_run(
    session: AsyncSession, *, principal: Principal, project_name: str, run_id: str
) -> api.HealthRun:
    project = await resolve_project(
        session, principal=principal, name=project_name, need=ProjectRole.EDITOR
    )
    h = await session.get(HealthRun, run_id)
    if h is None or h.project_id != project.id:
        raise NotFoundError(f"health run {run_id!r} not found", field="id")
    return health_run_view(h, (await _cluster_names(session, project)).get(h.cluster_id, ""))


def check_policy_kinds(kinds: Sequence[str]) -> str:
    known = {k.value for k in AlertKind}
    for k in kinds:
        if k != "*" and k not in known:
            raise ValidationError(
                f"repair.automatic: unknown fault {k!r}; known: *, {', '.join(sorted(known))}",
                field="repair.automatic",
            )
    return ",".join(sorted(set(kinds)))
