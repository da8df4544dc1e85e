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

One handler per phase (``create_path``, ``delete_path``), each given a
``NodeStep`` loaded afresh and returning an outcome (controllers/outcomes.py).
Past its phase's deadline a node fails with the reason and its last error;
a release instead skips what still fails. A release always finishes: a
layer step is skipped (event ``StepSkipped``) when the cluster's control
plane never came up, when forced, or past the deadline; deleting the
instance is skipped when its host was removed for good, when forced or past
the deadline (then the host is cordoned: ``HostCordoned``).

Crash safety: the node row (with its host) exists before the provider is
asked for anything, and provider calls are idempotent on the node id, so a
crash between "ask" and "record" only means asking again. A node whose
provider instance vanished while booting is asked for again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import literal, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import idblocks
from gpuclusters.core.deadlines import NODE_FINISH_AT_DEADLINE, deadline_at
from gpuclusters.core.enums import EventReason, HostAgentStatus, HostState, NodePhase
from gpuclusters.core.idblocks import IdBlock
from gpuclusters.layers.base import ClusterLayer, ClusterRef, NodeRef
from gpuclusters.providers.base import InstanceState
from gpuclusters.server.controllers import hints, leases
from gpuclusters.server.controllers.base import ControllerContext, SteppedReconciler
from gpuclusters.server.controllers.health_runs import (
    ACCEPTANCE,
    record_outcome,
    run_check_on_node,
)
from gpuclusters.server.controllers.outcomes import (
    MOVED,
    WAIT,
    Outcome,
    StepFailed,
    fail,
    moved,
)
from gpuclusters.server.controllers.refs import (
    cluster_ref,
    load_cluster_ref,
    node_ref,
    node_spec,
)
from gpuclusters.server.db.allocation import PREEMPTED
from gpuclusters.server.db.models import Cluster, HealthRun, Host, Node, Project, utcnow
from gpuclusters.server.db.records import (
    close_usage,
    node_phase_values,
    open_usage,
    record_event,
    set_node_phase,
)
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.keys import hash_key, new_key

log = logging.getLogger(__name__)

P = NodePhase
DRAIN_REASON = "gpuclusters: node removed"
AGENT_TOKEN_PATH = "/etc/gpuclusters/agent-token"
# Where workloads on a node read that it is being preempted, and until when.
PREEMPTION_NOTICE = "/run/gpuclusters/preemption.json"


# Node phases a cluster's status counts (see ``settled``).
_CLUSTER_SEES = {P.RUNNING.value, P.FAILED.value, P.DELETED.value}
# Phases in which a node moves by itself; running, failed and repairing
# nodes wait for something else (a delete, a repair, a restart's check).
_ACTIVE = tuple(p.value for p in P if p not in (P.RUNNING, P.FAILED, P.REPAIRING, P.DELETED))


@dataclass(slots=True)
class NodeStep:
    """What one step of one node sees, loaded afresh for each step (nothing
    is carried between steps but the row itself)."""

    row_id: str
    token: str
    node: Node
    cluster: Cluster
    host: Host | None
    ids: IdBlock  # the project's block of Unix ids
    layer: ClusterLayer
    cref: ClusterRef
    nref: NodeRef
    # The phase's deadline passed: a release skips what still fails.
    overdue: bool = False

    @property
    def phase(self) -> NodePhase:
        return P(self.node.phase)

    @property
    def forced(self) -> str | None:
        """Why failing release steps are skipped at once: a forced delete of
        the cluster, or the release's deadline passed."""
        if self.cluster.force_delete_reason:
            return f"delete forced: {self.cluster.force_delete_reason}"
        if self.overdue:
            return f"{self.node.phase} passed its deadline"
        return None


Handler = Callable[[NodeStep], Awaitable[Outcome]]


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
        # Creation times of the candidates seen, for ``rank``.
        self._created: dict[str, float] = {}
        # One handler per phase: the way up, and the way out once the node
        # is marked ``to_delete`` (preempted nodes take _preempt first).
        self.create_path: dict[NodePhase, Handler] = {
            P.PENDING: self._pending,
            P.SCHEDULING: self._scheduling,
            P.BOOTING: self._booting,
            P.BOOTSTRAPPING: self._bootstrapping,
            P.RUNNING: self._verify,
        }
        self.delete_path: dict[NodePhase, Handler] = {
            P.RUNNING: self._cordon,
            P.BOOTSTRAPPING: self._cordon,
            P.DRAINING: self._drain,
            P.RELEASING: self._release,
        }

    @property
    def deadlines(self) -> dict[str, float]:
        return self.rt.settings.node_phase_deadlines_s

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
        active = await session.execute(
            select(Node.id, Node.created_at).where(
                Node.deleted_at.is_(None), Node.phase.in_(_ACTIVE) | Node.to_delete
            )
        )
        # A full pass sees every candidate: forget the ranks of the others.
        self._created = {row_id: created.timestamp() for row_id, created in active}
        return [*self._created, *self._to_verify]

    async def batch_moves(self, session: AsyncSession, among: set[str] | None) -> None:
        """pending -> scheduling for every node placement gave a host (the
        usual case: placed when its cluster was created or grew), in one
        statement: the move only records where the node goes, so it needs
        no step. Nodes awaiting a host, leased, backing off or being deleted
        take the step (``_pending``) instead."""
        now = utcnow()
        where = [
            Node.phase == P.PENDING.value,
            Node.host_id.is_not(None),
            Node.deleted_at.is_(None),
            Node.to_delete.is_(False),
            *leases.claimable(Node, now),
        ]
        if among is not None:
            where.append(Node.id.in_(among))
        host_name = select(Host.name).where(Host.id == Node.host_id).scalar_subquery()
        moved = await session.execute(
            update(Node)
            .where(*where)
            .values(
                node_phase_values(
                    P.SCHEDULING.value,
                    literal("placed on ") + host_name,
                    deadlines=self.deadlines,
                    now=now,
                )
            )
            .execution_options(synchronize_session=False)
        )
        if moved.rowcount:  # type: ignore[attr-defined]
            await session.commit()

    async def candidates_among(self, session: AsyncSession, ids: set[str]) -> Sequence[str]:
        active = await session.execute(
            select(Node.id, Node.created_at).where(
                Node.id.in_(ids),
                Node.deleted_at.is_(None),
                Node.phase.in_(_ACTIVE) | Node.to_delete,
            )
        )
        found = {row_id: created.timestamp() for row_id, created in active}
        self._created.update(found)
        return [*found, *(ids & self._to_verify)]

    def rank(self, row_id: str) -> tuple[Any, ...]:
        # Oldest first (a cluster's nodes are made together); the running
        # nodes checked once after a restart (no rank kept) before them.
        return (self._created.get(row_id, 0.0), row_id)

    async def settled(self, row_id: str, taken: list[Outcome]) -> None:
        # The cluster's status follows its running, failed and deleted nodes:
        # wake that one cluster when one of those counts moved (a node
        # passing from booting to bootstrapping changes nothing for it).
        moves = [o for o in taken if o.moved is not None]
        if not moves:
            return
        before, after = moves[0].moved[0], moves[-1].moved[1]  # type: ignore[index]
        cluster_id = next((o.parent for o in moves if o.parent is not None), None)
        if before != after and {before, after} & _CLUSTER_SEES and cluster_id is not None:
            self.ctx.hints.notify_rows(hints.CLUSTERS, [cluster_id])

    async def load(self, row_id: str, token: str) -> NodeStep | None:
        """The node, its cluster and host, and the refs layers take; None
        for a deleted node."""
        async with self.ctx.sessionmaker() as session:
            # The project as an entity: the cluster ref's queries find it in
            # the session instead of asking the database again.
            node, cluster, host, project = (
                await session.execute(
                    select(Node, Cluster, Host, Project)
                    .join(Cluster, Cluster.id == Node.cluster_id)
                    .join(Project, Project.id == Cluster.project_id)
                    .outerjoin(Host, Host.id == Node.host_id)
                    .where(Node.id == row_id)
                )
            ).one()
            if node.deleted_at is not None:
                return None
            # SSH access only where a join may (re)start the node's sshd.
            joining = node.phase == P.BOOTSTRAPPING.value or (
                node.phase == P.RUNNING.value and row_id in self._to_verify
            )
            # The cluster as layers see it (its members, its other nodes) only
            # for the steps that call the layer: placing and booting a node
            # do not, and loading it costs a query per member table.
            cref = (
                await load_cluster_ref(session, cluster, self.rt, ssh=joining, users=joining)
                if node.to_delete or joining
                else cluster_ref(cluster)
            )
        return NodeStep(
            row_id=row_id,
            token=token,
            node=node,
            cluster=cluster,
            host=host,
            ids=idblocks.block(project.id_block, self.rt.settings.id_blocks_start),
            layer=self.rt.layer_for(cluster.cluster_type),
            cref=cref,
            nref=node_ref(node, host),
        )

    def deadline(self, node: Node) -> datetime | None:
        """The phase's deadline: as written when the phase was entered, or
        (a node made in its phase, e.g. pending) from when it was entered."""
        if node.phase_deadline_at is not None:
            return node.phase_deadline_at
        return deadline_at(self.deadlines, node.phase, node.phase_changed_at)

    async def step(self, row_id: str, token: str) -> Outcome:
        s = await self.load(row_id, token)
        if s is None or s.phase is not P.RUNNING:
            self._to_verify.discard(row_id)  # only running nodes are checked
        if s is None:
            return WAIT
        deadline = self.deadline(s.node)
        if deadline is not None and utcnow() >= deadline:
            if s.node.phase not in NODE_FINISH_AT_DEADLINE and not s.node.to_delete:
                limit = self.deadlines.get(s.node.phase, 0)
                why = f"still {s.node.phase} after its deadline ({limit:.0f} s)"
                if s.node.last_error:
                    why += f"; last error: {s.node.last_error}"
                return fail(why)
            s.overdue = True
        if s.node.to_delete and s.node.delete_reason == PREEMPTED and s.phase is not P.RELEASING:
            return await self._preempt(s)
        if s.node.to_delete:
            return await self.delete_path.get(s.phase, self._to_releasing)(s)
        handler = self.create_path.get(s.phase)
        return WAIT if handler is None else await handler(s)

    async def fail(self, row_id: str, token: str, reason: str) -> None:
        """A permanent error, or a deadline passed: the node fails with the
        reason (its repair policy takes over from there; docs/health.md).
        A node being deleted does not fail: its release goes on."""
        async with self.ctx.sessionmaker() as session:
            node = await leases.fenced(
                session, Node, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            to_delete, cluster_id = node.to_delete, node.cluster_id
        if to_delete:
            raise StepFailed(reason)
        await self._write(row_id, token, phase=P.FAILED, message=reason)
        # Its cluster counts failed nodes (``settled`` sees no move here).
        self.ctx.hints.notify_rows(hints.CLUSTERS, [cluster_id])

    # -- the way up ------------------------------------------------------------

    async def _pending(self, s: NodeStep) -> Outcome:
        if s.node.host_id is None and s.node.awaited_host_id is not None:
            return await self._take_awaited_host(s.row_id, s.token)
        return await self._write(
            s.row_id, s.token, seen=s, phase=P.SCHEDULING, message=f"placed on {s.nref.host}"
        )

    async def _scheduling(self, s: NodeStep) -> Outcome:
        if s.host is None:
            return fail("no host assigned")
        inst = await self.rt.provider.create(node_spec(s.node, s.cluster, s.host, s.ids))
        if inst.state is InstanceState.FAILED:
            return fail(inst.message)
        if inst.state is InstanceState.RUNNING:
            # Made and up already (the embedded fleet, an instant fake
            # node): no boot to wait for, so one write and one step fewer.
            return await self._write(s.row_id, s.token, seen=s, phase=P.BOOTSTRAPPING)
        return await self._write(s.row_id, s.token, seen=s, phase=P.BOOTING)

    async def _booting(self, s: NodeStep) -> Outcome:
        inst = await self.rt.provider.status(s.node.id)
        if inst.state is InstanceState.RUNNING:
            return await self._write(s.row_id, s.token, seen=s, phase=P.BOOTSTRAPPING)
        if inst.state is InstanceState.FAILED:
            return fail(inst.message)
        if inst.state is InstanceState.MISSING:
            return await self._write(
                s.row_id,
                s.token,
                seen=s,
                phase=P.SCHEDULING,
                message="instance vanished while booting",
            )
        return WAIT

    async def _bootstrapping(self, s: NodeStep) -> Outcome:
        if s.node.agent_token_hash is None and self.rt.node_access is not None:
            return await self._enroll_agent(s.row_id, s.token)
        if not await s.layer.join_node(s.cref, s.nref):
            return WAIT
        failed, runs = await self._acceptance(s.node, s.cluster)
        if failed:
            return fail(failed)
        return await self._write(s.row_id, s.token, seen=s, phase=P.RUNNING, runs=runs)

    async def _verify(self, s: NodeStep) -> Outcome:
        """A running node this process has not checked since it started."""
        if s.row_id not in self._to_verify:
            return WAIT
        inst = await self.rt.provider.status(s.row_id)
        if inst.state is InstanceState.MISSING:
            return await self._write(
                s.row_id, s.token, seen=s, phase=P.SCHEDULING, message="instance lost; rebuilding"
            )
        if inst.state is InstanceState.RUNNING and not await s.layer.join_node(s.cref, s.nref):
            return WAIT
        self._to_verify.discard(s.row_id)
        return WAIT

    # -- the way out -------------------------------------------------------------

    def _layer_gone(self, s: NodeStep) -> str | None:
        """Why the cluster's layer has nothing to undo for this node: its
        control plane never came up."""
        if s.cluster.control_plane_ready_at is None:
            return "the cluster's control plane never came up"
        return None

    async def _layer_step(
        self, s: NodeStep, what: str, call: Callable[[], Awaitable[object]]
    ) -> tuple[bool, str | None]:
        """Run a layer step of a release. Returns (done, skipped): a step
        that fails is skipped (with the reason, recorded as an event) when
        the layer never came up or the release is forced; otherwise the
        failure is raised to be retried with backoff."""
        gone = self._layer_gone(s)
        try:
            await call()
        except Exception as exc:
            why = gone or s.forced
            if why is None:
                raise StepFailed(f"{what}: {exc}") from exc
            return True, f"{what} skipped ({why}): {exc}"
        return True, None

    async def _cordon(self, s: NodeStep) -> Outcome:
        _, skipped = await self._layer_step(
            s, "cordon", lambda: s.layer.cordon(s.cref, s.nref, reason=DRAIN_REASON)
        )
        return await self._write(
            s.row_id, s.token, seen=s, phase=P.DRAINING, cordoned=True, skipped=[skipped]
        )

    async def _drain(self, s: NodeStep) -> Outcome:
        deadline = s.node.phase_changed_at + timedelta(seconds=self.drain_timeout_s)
        result: list[bool] = []

        async def drain() -> None:
            result.append(
                await s.layer.drain(s.cref, s.nref, reason=DRAIN_REASON, deadline=deadline)
            )

        _, skipped = await self._layer_step(s, "drain", drain)
        done = skipped is not None or (result and result[0])
        if not done and utcnow() < deadline and not s.forced:
            return WAIT
        return await self._write(s.row_id, s.token, seen=s, phase=P.RELEASING, skipped=[skipped])

    async def _to_releasing(self, s: NodeStep) -> Outcome:
        """A node marked for deletion before it ran: nothing to drain."""
        return await self._write(s.row_id, s.token, seen=s, phase=P.RELEASING)

    async def _release(self, s: NodeStep) -> Outcome:
        """Forget the node in the cluster's layer, then delete its instance.
        A release always finishes: what cannot work is skipped with an
        event (see ``_layer_step``), and an instance that cannot be deleted
        (its host is gone, or past the deadline) leaves its host cordoned
        for an operator rather than the node stuck."""
        _, layer_skipped = await self._layer_step(
            s, "removing the node from the cluster", lambda: s.layer.remove_node(s.cref, s.nref)
        )
        provider_skipped: str | None = None
        host_removed = s.host is not None and s.host.agent_status == HostAgentStatus.REMOVED.value
        try:
            await self.rt.provider.delete(s.node.id)
        except Exception as exc:
            why = (f"host {s.host.name} was removed" if s.host and host_removed else None) or (
                s.forced
            )
            if why is None:
                raise StepFailed(f"deleting the instance: {exc}") from exc
            provider_skipped = f"deleting the instance skipped ({why}): {exc}"
        return await self._write(
            s.row_id,
            s.token,
            seen=s,
            phase=P.DELETED,
            deleted=True,
            skipped=[layer_skipped, provider_skipped],
            cordon_host=provider_skipped is not None and not host_removed,
        )

    async def _acceptance(self, node: Node, cluster: Cluster) -> tuple[str, list[HealthRun]]:
        """Acceptance tests before a (re)joined node counts as running: each
        configured check runs on the node and is recorded; a failed one keeps
        the node out (its message says which). Skipped checks (no GPU here)
        pass. Returns the failure ("" if none) and the runs whose results are
        still to be written: a check that took under a second is written
        with the next write (the node's move to running), one that took
        longer at once, so a long check's result shows as soon as it is in."""
        checks = self.rt.settings.acceptance_checks
        if not checks:
            return "", []
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
            # Every check's run at once (one transaction), each shown
            # running until its result is written.
            runs = [
                HealthRun(
                    project_id=node.project_id,
                    cluster_id=node.cluster_id,
                    node_id=node.id,
                    node_name=node.name,
                    check=check,
                    duration_s=self.rt.settings.acceptance_burn_s if check == "gpu-burn" else 60.0,
                    state="running",
                    requested_by=ACCEPTANCE,
                    started_at=utcnow(),
                )
                for check in checks
            ]
            session.add_all(runs)
            await session.commit()
        unwritten: list[HealthRun] = []
        for run in runs:
            started = time.monotonic()
            # Through the node's shell, not as a Slurm job: a joining node
            # holds no users' work yet (or is still drained by its repair).
            outcome = await run_check_on_node(
                self.rt, node.id, run.check, duration_s=run.duration_s, gpu_type=cluster.gpu_type
            )
            record_outcome(run, outcome)
            unwritten.append(run)
            if run.state == "failed" or time.monotonic() - started >= 1.0:
                async with self.ctx.sessionmaker() as session:
                    # Detached since their insert; written back as they are.
                    session.add_all(unwritten)
                    await session.commit()
                unwritten = []
            if run.state == "failed":
                return f"acceptance test {run.check} failed: {run.reason}", []
        return "", unwritten

    async def _take_awaited_host(self, row_id: str, token: str) -> Outcome:
        """Take the awaited host once no live node holds it any more."""
        async with self.ctx.sessionmaker() as session:
            node = await leases.fenced(
                session, Node, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            host_id = node.awaited_host_id
            if host_id is None:
                return WAIT
            holder = await session.scalar(
                select(Node.id).where(Node.host_id == host_id, Node.deleted_at.is_(None))
            )
            if holder is not None:
                return WAIT  # still being released; its deletion hints us
            host = await session.get_one(Host, host_id)
            node.host_id, node.awaited_host_id = host_id, None
            set_node_phase(
                node, P.SCHEDULING.value, f"placed on {host.name}", deadlines=self.deadlines
            )
            await session.commit()
        return moved(P.PENDING.value, P.SCHEDULING.value, parent=node.cluster_id)

    async def _preempt(self, s: NodeStep) -> Outcome:
        """One step of the preemption protocol (see module docstring)."""
        row_id, token, node, cluster = s.row_id, s.token, s.node, s.cluster
        layer, cref, nref = s.layer, s.cref, s.nref
        phase = s.phase
        why = node.message or "host reclaimed for standard capacity"
        if phase in (P.RUNNING, P.BOOTSTRAPPING) or (
            phase is P.DRAINING and node.preempt_deadline is None
        ):
            # T+0, recorded before anything is done, so a crash from here on
            # resumes with the same deadline.
            now = utcnow()
            deadline = now + timedelta(seconds=self.rt.settings.preemption_grace_s)
            async with self.ctx.sessionmaker() as session:
                row = await leases.fenced(
                    session, Node, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
                )
                set_node_phase(row, P.DRAINING.value, why, deadlines=self.deadlines)
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
            return moved(phase.value, P.DRAINING.value, parent=node.cluster_id)

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
                return WAIT
            t0 = deadline - timedelta(seconds=self.rt.settings.preemption_grace_s)
            took = max(0.0, (now - t0).total_seconds())
            how = "its workloads exited" if done else "the grace period ended"
            return await self._write(
                row_id,
                token,
                seen=s,
                phase=P.RELEASING,
                message=why,
                event=(EventReason.PREEMPTED, f"released {took:.1f}s after notice: {how}"),
            )

        # Not running yet (or failed): nothing to signal, release at once.
        return await self._write(
            row_id,
            token,
            seen=s,
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

    async def _enroll_agent(self, row_id: str, token: str) -> Outcome:
        """Give the node's agent its token (only the hash is kept) and learn
        the node's address. Re-running makes a new token: harmless, the old
        one was never recorded."""
        access = self.rt.node_access
        assert access is not None
        shell = await access.shell(row_id)
        agent_token = new_key()
        await shell.write_file(AGENT_TOKEN_PATH, agent_token.encode() + b"\n", mode=0o600)
        async with self.ctx.sessionmaker() as session:
            node = await leases.fenced(
                session, Node, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            node.agent_token_hash = hash_key(agent_token)
            node.address = shell.address
            await session.commit()
        return MOVED

    async def _write(
        self,
        row_id: str,
        token: str,
        *,
        phase: NodePhase,
        seen: NodeStep | None = None,
        message: str = "",
        cordoned: bool | None = None,
        deleted: bool = False,
        event: tuple[EventReason, str] | None = None,
        skipped: Sequence[str | None] = (),
        cordon_host: bool = False,
        runs: Sequence[HealthRun] = (),
    ) -> Outcome:
        """Move the node to ``phase`` (fenced), with what goes with it:
        metering, events, the steps a release skipped, acceptance results
        still to record (``runs``), all in one transaction.

        ``seen``: the step's view of the node, loaded under this lease (so
        its phase is still the row's: only the lease holder moves a leased
        node). The move is then written by the fence itself, and a move to
        running or deleted, which ends the pass, gives the lease back in the
        same statement (``leases.fenced``): one statement where the fence,
        the move and the release were three."""
        now = utcnow()
        ttl = self.ctx.lease_ttl_s
        async with self.ctx.sessionmaker() as session:
            if seen is None:
                row = await leases.fenced(session, Node, row_id, token=token, ttl_s=ttl)
                before, was_live = row.phase, row.ready_at is not None
            else:
                before, was_live = seen.node.phase, seen.node.ready_at is not None
            if before == phase.value and not deleted:
                return WAIT
            values = node_phase_values(phase.value, message, deadlines=self.deadlines, now=now)
            if cordoned is not None:
                values["cordoned"] = cordoned
            if phase is P.SCHEDULING:
                # A rebuilt node gets a new agent token and address.
                values["agent_token_hash"] = None
            if phase is P.RUNNING:
                values["ready_at"] = now
            if deleted:
                values["deleted_at"] = now
            release = seen is not None and phase in (P.RUNNING, P.DELETED)
            node = await leases.fenced(
                session, Node, row_id, token=token, ttl_s=ttl, values=values, release=release
            )
            if phase is P.RUNNING:
                self._to_verify.discard(row_id)  # just joined: nothing to check
                await record_event(
                    session, node, EventReason.NODE_ADDED, f"node {node.name} is running"
                )
                cluster = (
                    seen.cluster
                    if seen is not None
                    else await session.get_one(Cluster, node.cluster_id)
                )
                await open_usage(session, node, cluster, never_live=not was_live)
            elif phase is P.FAILED:
                await record_event(session, node, EventReason.NODE_FAILED, message)
            if phase in (P.RELEASING, P.DELETED, P.FAILED, P.SCHEDULING):
                await close_usage(session, node)  # billing stops at release
            if event is not None:
                await record_event(session, node, event[0], event[1])
            for note in skipped:
                if note:
                    await record_event(session, node, EventReason.STEP_SKIPPED, note)
            if cordon_host and node.host_id is not None:
                # Its instance may still be there: nothing new lands on the
                # host until an operator has looked (hosts uncordon).
                host = await session.get_one(Host, node.host_id)
                host.state = HostState.CORDONED.value
                await record_event(
                    session,
                    node,
                    EventReason.HOST_CORDONED,
                    f"host {host.name} cordoned: the instance of {node.name} may still be there",
                )
            if deleted and node.delete_reason == "scale_down":
                await record_event(
                    session,
                    node,
                    EventReason.SCALED_DOWN,
                    f"node {node.name} removed by scale-down",
                )
            session.add_all(runs)  # detached since their insert; written back as they are
            await session.commit()
        # Running, failed and deleted nodes have nothing more to do now:
        # the pass ends here instead of loading the node once more.
        settled = phase in (P.RUNNING, P.FAILED, P.DELETED)
        return moved(before, phase.value, parent=node.cluster_id, settled=settled, released=release)
