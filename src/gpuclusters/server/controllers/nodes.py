"""Node reconciler: drives one node through its phases.

pending -> scheduling -> booting -> bootstrapping -> running, and, once the
node is marked ``to_delete``, draining -> releasing -> deleted.

Preemption (``delete_reason == "preempted"``) is the same path with the
protocol of docs/preemptible.md: T+0 is recorded first (deadline, event
``PreemptionNotified``), then the notice is written on the node and the
layer signals the workloads, then the node is released as soon as the layer
says no work is left, or at the deadline regardless (event ``Preempted``).
A standard node that awaits a host (``awaited_host_id``) stays pending until
the node holding that host is gone, then takes it.

Metering follows the phases: a usage record opens when a node is running
and closes when it is released, fails or is lost.

Crash safety: the node row (with its host) exists before the provider is
asked for anything, and provider calls are idempotent on the node id, so a
crash between "ask" and "record" only means asking again. A node whose
provider instance vanished while booting is asked for again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import idblocks
from gpuclusters.core.enums import EventReason, NodePhase
from gpuclusters.layers.base import ClusterLayer, ClusterRef, NodeRef, PermanentLayerError
from gpuclusters.providers.base import InstanceState, PermanentProviderError
from gpuclusters.server.controllers import hints, leases
from gpuclusters.server.controllers.base import ControllerContext, SteppedReconciler
from gpuclusters.server.controllers.health_runs import (
    ACCEPTANCE,
    record_outcome,
    run_check_on_node,
)
from gpuclusters.server.controllers.refs import (
    cluster_ref,
    load_cluster_ref,
    node_ref,
    node_spec,
)
from gpuclusters.server.db.allocation import PREEMPTED
from gpuclusters.server.db.models import Cluster, HealthRun, Host, Node, Project, utcnow
from gpuclusters.server.db.records import close_usage, open_usage, record_event, set_node_phase
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.keys import hash_key, new_key

log = logging.getLogger(__name__)

P = NodePhase
DRAIN_REASON = "gpuclusters: node removed"
AGENT_TOKEN_PATH = "/etc/gpuclusters/agent-token"
# Where workloads on a node read that it is being preempted, and until when.
PREEMPTION_NOTICE = "/run/gpuclusters/preemption.json"


# Node phases a cluster's status counts (see ``reconcile``).
_CLUSTER_SEES = {P.RUNNING.value, P.FAILED.value, P.DELETED.value}
# Phases in which a node moves by itself; running, failed and repairing
# nodes wait for something else (a delete, a repair, a restart's check).
_ACTIVE = tuple(p.value for p in P if p not in (P.RUNNING, P.FAILED, P.REPAIRING, P.DELETED))


class NodeReconciler(SteppedReconciler):
    name = hints.NODES
    model = Node

    def __init__(
        self, ctx: ControllerContext, rt: Runtime, *, drain_timeout_s: float = 300.0
    ) -> None:
        super().__init__(ctx)
        self.rt = rt
        self.drain_timeout_s = drain_timeout_s
        # After a (re)start every node running then is checked once:
        # re-adopted if its instance is there (join again, which restarts
        # dead daemons), rebuilt if the instance is gone (e.g. the host
        # rebooted). Nodes that reach running later were just joined.
        self._to_verify = rt.nodes_to_verify
        # While a node is in a pass: its cluster, and its phase at the start
        # and after the last write.
        self._cluster_of: dict[str, str] = {}
        self._phase_before: dict[str, str] = {}
        self._phase_after: dict[str, str] = {}

    async def candidates(self, session: AsyncSession) -> Sequence[str]:
        """Live nodes in a phase with work to do, by index (never the whole
        fleet), plus the running nodes still to be checked once."""
        if not self.rt.nodes_snapshot_taken:
            self._to_verify.update(
                await session.scalars(
                    select(Node.id).where(Node.deleted_at.is_(None), Node.phase == P.RUNNING.value)
                )
            )
            self.rt.nodes_snapshot_taken = True
        active = await session.scalars(
            select(Node.id).where(
                Node.deleted_at.is_(None), Node.phase.in_(_ACTIVE) | Node.to_delete
            )
        )
        return [*active, *self._to_verify]

    async def candidates_among(self, session: AsyncSession, ids: set[str]) -> Sequence[str]:
        active = await session.scalars(
            select(Node.id).where(
                Node.id.in_(ids),
                Node.deleted_at.is_(None),
                Node.phase.in_(_ACTIVE) | Node.to_delete,
            )
        )
        return [*active, *(ids & self._to_verify)]

    async def reconcile(self, row_id: str, token: str) -> bool:
        try:
            changed = await super().reconcile(row_id, token)
        finally:
            cluster_id = self._cluster_of.pop(row_id, None)
            before = self._phase_before.pop(row_id, None)
            after = self._phase_after.pop(row_id, before)
        # The cluster's status follows its running, failed and deleted nodes:
        # wake that one cluster when one of those counts moved (a node
        # passing from booting to bootstrapping changes nothing for it).
        if cluster_id is not None and before != after and {before, after} & _CLUSTER_SEES:
            self.ctx.hints.notify_rows(hints.CLUSTERS, [cluster_id])
        return changed

    async def step(self, row_id: str, token: str) -> bool:
        async with self.ctx.sessionmaker() as session:
            node, cluster, host = (
                await session.execute(
                    select(Node, Cluster, Host)
                    .join(Cluster, Cluster.id == Node.cluster_id)
                    .outerjoin(Host, Host.id == Node.host_id)
                    .where(Node.id == row_id)
                )
            ).one()
            self._cluster_of[row_id] = cluster.id
            self._phase_before.setdefault(row_id, node.phase)
            # SSH access only where a join may (re)start the node's sshd.
            joining = node.phase in (P.BOOTSTRAPPING.value, P.RUNNING.value)
            # The cluster as layers see it (its members, its other nodes) only
            # for the steps that call the layer: placing and booting a node
            # do not, and loading it costs a query per member table.
            cref = (
                await load_cluster_ref(session, cluster, self.rt, ssh=joining, users=joining)
                if node.deleted_at is None and (node.to_delete or joining)
                else cluster_ref(cluster)
            )
        phase = P(node.phase)
        layer = self.rt.layer_for(cluster.cluster_type)
        nref = node_ref(node, host)

        if node.deleted_at is not None or phase is not P.RUNNING:
            self._to_verify.discard(row_id)  # only running nodes are checked
        if node.deleted_at is not None:
            return False

        if node.to_delete and node.delete_reason == PREEMPTED and phase is not P.RELEASING:
            return await self._preempt(row_id, token, node, cluster, layer, cref, nref)

        if node.to_delete:
            if phase in (P.RUNNING, P.BOOTSTRAPPING):
                await layer.cordon(cref, nref, reason=DRAIN_REASON)
                return await self._write(row_id, token, phase=P.DRAINING, cordoned=True)
            if phase is P.DRAINING:
                deadline = node.phase_changed_at + timedelta(seconds=self.drain_timeout_s)
                done = await layer.drain(cref, nref, reason=DRAIN_REASON, deadline=deadline)
                if not done and utcnow() < deadline:
                    return False
                return await self._write(row_id, token, phase=P.RELEASING)
            if phase is not P.RELEASING:
                return await self._write(row_id, token, phase=P.RELEASING)
            await layer.remove_node(cref, nref)
            await self.rt.provider.delete(node.id)
            return await self._write(row_id, token, phase=P.DELETED, deleted=True)

        if phase is P.PENDING and node.host_id is None and node.awaited_host_id is not None:
            return await self._take_awaited_host(row_id, token)

        if phase is P.PENDING:
            return await self._write(
                row_id, token, phase=P.SCHEDULING, message=f"placed on {nref.host}"
            )

        if phase is P.SCHEDULING:
            if host is None:
                return await self._write(row_id, token, phase=P.FAILED, message="no host assigned")
            async with self.ctx.sessionmaker() as session:
                id_block = await session.scalar(
                    select(Project.id_block).where(Project.id == cluster.project_id)
                )
            ids = idblocks.block(id_block or 0, self.rt.settings.id_blocks_start)
            try:
                inst = await self.rt.provider.create(node_spec(node, cluster, host, ids))
            except PermanentProviderError as exc:
                return await self._write(row_id, token, phase=P.FAILED, message=str(exc))
            if inst.state is InstanceState.FAILED:
                return await self._write(row_id, token, phase=P.FAILED, message=inst.message)
            return await self._write(row_id, token, phase=P.BOOTING)

        if phase is P.BOOTING:
            inst = await self.rt.provider.status(node.id)
            if inst.state is InstanceState.RUNNING:
                return await self._write(row_id, token, phase=P.BOOTSTRAPPING)
            if inst.state is InstanceState.FAILED:
                return await self._write(row_id, token, phase=P.FAILED, message=inst.message)
            if inst.state is InstanceState.MISSING:
                return await self._write(
                    row_id, token, phase=P.SCHEDULING, message="instance vanished while booting"
                )
            return False

        if phase is P.RUNNING and row_id in self._to_verify:
            inst = await self.rt.provider.status(row_id)
            if inst.state is InstanceState.MISSING:
                return await self._write(
                    row_id, token, phase=P.SCHEDULING, message="instance lost; rebuilding"
                )
            if inst.state is InstanceState.RUNNING and not await layer.join_node(cref, nref):
                return False
            self._to_verify.discard(row_id)
            return False

        if phase is P.BOOTSTRAPPING:
            if node.agent_token_hash is None and self.rt.node_access is not None:
                return await self._enroll_agent(row_id, token)
            try:
                joined = await layer.join_node(cref, nref)
            except PermanentLayerError as exc:
                return await self._write(row_id, token, phase=P.FAILED, message=str(exc))
            if not joined:
                return False
            failed = await self._acceptance(node, cluster)
            if failed:
                return await self._write(row_id, token, phase=P.FAILED, message=failed)
            return await self._write(row_id, token, phase=P.RUNNING)

        return False

    async def _acceptance(self, node: Node, cluster: Cluster) -> str:
        """Acceptance tests before a (re)joined node counts as running: each
        configured check runs on the node and is recorded; a failed one keeps
        the node out (its message says which). Skipped checks (no GPU here)
        pass."""
        checks = self.rt.settings.acceptance_checks
        if not checks:
            return ""
        async with self.ctx.sessionmaker() as session:
            # Runs a crash interrupted are run again below; close them.
            await session.execute(
                update(HealthRun)
                .where(
                    HealthRun.node_id == node.id,
                    HealthRun.requested_by == ACCEPTANCE,
                    HealthRun.state == "running",
                )
                .values(state="failed", reason="interrupted", finished_at=utcnow())
            )
            await session.commit()
        for check in checks:
            duration = self.rt.settings.acceptance_burn_s if check == "gpu-burn" else 60.0
            async with self.ctx.sessionmaker() as session:
                run = HealthRun(
                    project_id=node.project_id,
                    cluster_id=node.cluster_id,
                    node_id=node.id,
                    node_name=node.name,
                    check=check,
                    duration_s=duration,
                    state="running",
                    requested_by=ACCEPTANCE,
                    started_at=utcnow(),
                )
                session.add(run)
                await session.commit()
                run_id = run.id
            # Through the node's shell, not as a Slurm job: a joining node
            # holds no users' work yet (or is still drained by its repair).
            outcome = await run_check_on_node(
                self.rt, node.id, check, duration_s=duration, gpu_type=cluster.gpu_type
            )
            async with self.ctx.sessionmaker() as session:
                row = await session.get_one(HealthRun, run_id)
                record_outcome(row, outcome)
                await session.commit()
            if row.state == "failed":
                return f"acceptance test {check} failed: {row.reason}"
        return ""

    async def _take_awaited_host(self, row_id: str, token: str) -> bool:
        """Take the awaited host once no live node holds it any more."""
        async with self.ctx.sessionmaker() as session:
            await leases.fence(session, Node, row_id, token=token, ttl_s=self.ctx.lease_ttl_s)
            node = await session.get_one(Node, row_id)
            host_id = node.awaited_host_id
            if host_id is None:
                return False
            holder = await session.scalar(
                select(Node.id).where(Node.host_id == host_id, Node.deleted_at.is_(None))
            )
            if holder is not None:
                return False  # still being released; its deletion hints us
            host = await session.get_one(Host, host_id)
            node.host_id, node.awaited_host_id = host_id, None
            set_node_phase(node, P.SCHEDULING.value, f"placed on {host.name}")
            await session.commit()
        return True

    async def _preempt(
        self,
        row_id: str,
        token: str,
        node: Node,
        cluster: Cluster,
        layer: ClusterLayer,
        cref: ClusterRef,
        nref: NodeRef,
    ) -> bool:
        """One step of the preemption protocol (see module docstring)."""
        phase = P(node.phase)
        why = node.message or "host reclaimed for standard capacity"
        if phase in (P.RUNNING, P.BOOTSTRAPPING) or (
            phase is P.DRAINING and node.preempt_deadline is None
        ):
            # T+0, recorded before anything is done, so a crash from here on
            # resumes with the same deadline.
            now = utcnow()
            deadline = now + timedelta(seconds=self.rt.settings.preemption_grace_s)
            async with self.ctx.sessionmaker() as session:
                await leases.fence(session, Node, row_id, token=token, ttl_s=self.ctx.lease_ttl_s)
                row = await session.get_one(Node, row_id)
                set_node_phase(row, P.DRAINING.value, why)
                row.preempt_deadline = deadline
                row.cordoned = True
                await record_event(
                    session,
                    row,
                    EventReason.PREEMPTION_NOTIFIED,
                    f"{why}; workloads get SIGTERM now and the node is released when they "
                    f"have exited, at {deadline.isoformat(timespec='seconds')} at the latest",
                )
                await session.commit()
            self._phase_after[row_id] = P.DRAINING.value
            return True

        if phase is P.DRAINING:
            assert node.preempt_deadline is not None
            deadline = node.preempt_deadline
            reason = f"preempted deadline={deadline:%Y-%m-%dT%H:%M:%SZ}"
            if not node.preempt_signalled:
                await self._write_notice(node, cluster, why=why, deadline=deadline)
                await layer.preempt(cref, nref, reason=reason, deadline=deadline)
                async with self.ctx.sessionmaker() as session:
                    await leases.fence(
                        session, Node, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
                    )
                    row = await session.get_one(Node, row_id)
                    row.preempt_signalled = True
                    await session.commit()
            done = await layer.preemption_done(cref, nref, reason=reason, deadline=deadline)
            now = utcnow()
            if not done and now < deadline:
                return False
            t0 = deadline - timedelta(seconds=self.rt.settings.preemption_grace_s)
            took = max(0.0, (now - t0).total_seconds())
            how = "its workloads exited" if done else "the grace period ended"
            return await self._write(
                row_id,
                token,
                phase=P.RELEASING,
                message=why,
                event=(EventReason.PREEMPTED, f"released {took:.1f}s after notice: {how}"),
            )

        # Not running yet (or failed): nothing to signal, release at once.
        return await self._write(
            row_id,
            token,
            phase=P.RELEASING,
            message=why,
            event=(EventReason.PREEMPTED, f"released before it ran: {why}"),
        )

    async def _write_notice(
        self, node: Node, cluster: Cluster, *, why: str, deadline: datetime
    ) -> None:
        """The notice workloads on the node can read (and poll for)."""
        access = self.rt.node_access
        if access is None:
            return
        notice = {
            "node": node.name,
            "cluster": cluster.name,
            "reason": why,
            "notified_at": (
                deadline - timedelta(seconds=self.rt.settings.preemption_grace_s)
            ).isoformat(),
            "deadline": deadline.isoformat(),
            "grace_seconds": self.rt.settings.preemption_grace_s,
        }
        try:
            shell = await access.shell(node.id)
            await shell.write_file(PREEMPTION_NOTICE, json.dumps(notice, indent=2).encode() + b"\n")
        except Exception as exc:  # a node that is gone has no workloads to tell
            log.info("preemption notice on %s not written: %s", node.name, exc)

    async def _enroll_agent(self, row_id: str, token: str) -> bool:
        """Give the node's agent its token (only the hash is kept) and learn
        the node's address. Re-running makes a new token: harmless, the old
        one was never recorded."""
        access = self.rt.node_access
        assert access is not None
        shell = await access.shell(row_id)
        agent_token = new_key()
        await shell.write_file(AGENT_TOKEN_PATH, agent_token.encode() + b"\n", mode=0o600)
        async with self.ctx.sessionmaker() as session:
            await leases.fence(session, Node, row_id, token=token, ttl_s=self.ctx.lease_ttl_s)
            node = await session.get_one(Node, row_id)
            node.agent_token_hash = hash_key(agent_token)
            node.address = shell.address
            await session.commit()
        return True

    async def _write(
        self,
        row_id: str,
        token: str,
        *,
        phase: NodePhase,
        message: str = "",
        cordoned: bool | None = None,
        deleted: bool = False,
        event: tuple[EventReason, str] | None = None,
    ) -> bool:
        async with self.ctx.sessionmaker() as session:
            await leases.fence(session, Node, row_id, token=token, ttl_s=self.ctx.lease_ttl_s)
            node = await session.get_one(Node, row_id)
            if node.phase == phase.value and not deleted:
                return False
            set_node_phase(node, phase.value, message)
            if cordoned is not None:
                node.cordoned = cordoned
            if phase is P.SCHEDULING:
                # A rebuilt node gets a new agent token and address.
                node.agent_token_hash = None
            if phase is P.RUNNING:
                node.ready_at = utcnow()
                self._to_verify.discard(row_id)  # just joined: nothing to check
                await record_event(
                    session, node, EventReason.NODE_ADDED, f"node {node.name} is running"
                )
                await open_usage(session, node, await session.get_one(Cluster, node.cluster_id))
            elif phase is P.FAILED:
                await record_event(session, node, EventReason.NODE_FAILED, message)
            if phase in (P.RELEASING, P.DELETED, P.FAILED, P.SCHEDULING):
                await close_usage(session, node)  # billing stops at release
            if event is not None:
                await record_event(session, node, event[0], event[1])
            if deleted:
                node.deleted_at = utcnow()
                if node.delete_reason == "scale_down":
                    await record_event(
                        session,
                        node,
                        EventReason.SCALED_DOWN,
                        f"node {node.name} removed by scale-down",
                    )
            await session.commit()
        self._phase_after[row_id] = phase.value
        return True
