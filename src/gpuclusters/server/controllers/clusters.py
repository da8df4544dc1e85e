"""Cluster reconciler: walks a cluster through its states.

queued -> waiting_for_control_plane (<-> waiting_for_build) -> waiting_for_volume
-> waiting_for_nodes -> running_acceptance_tests -> ready <-> degraded, and
deleting -> deleted.

Node rows of standard nodes are created by the services (so capacity
errors are answered synchronously and atomically); this reconciler only
watches them. It also fills the cluster's preemptible pool: once the control
plane is up, it adds preemptible nodes on spare hosts toward the target
(``num_preemptible_gpus``) whenever spare capacity appears. Each pass may
take several steps; every write is fenced by the lease token.

A cluster that only waits for its nodes is woken by their hints as they
settle, not stepped at every full pass (``candidates``: a sweep every
``sweep_s`` catches what no hint announced). One handler per status
(``handlers``), each given a ``ClusterStep`` loaded afresh. Every status
but the settled ones and ``queued`` has a deadline (core/deadlines.py):
past it the cluster fails with the reason and its last
error, except ``deleting``, where a layer delete that still fails is
skipped so that the delete finishes (as at once for a forced delete).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

from sqlalchemy import Select, exists, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.capacity.preemption import preemptible_deficit
from gpuclusters.core.deadlines import CLUSTER_FINISH_AT_DEADLINE
from gpuclusters.core.enums import (
    GPUS_PER_NODE,
    BillingType,
    ClusterStatus,
    ComputeClass,
    EventReason,
    NodePhase,
    VolumeStatus,
)
from gpuclusters.core.errors import CapacityUnavailableError
from gpuclusters.core.nodeshell import GatewayTarget
from gpuclusters.layers.base import ClusterLayer, ClusterRef
from gpuclusters.server.controllers import hints, leases
from gpuclusters.server.controllers.base import ControllerContext, SteppedReconciler
from gpuclusters.server.controllers.outcomes import (
    MOVED,
    WAIT,
    Outcome,
    StepFailed,
    fail,
    moved,
    of,
)
from gpuclusters.server.controllers.refs import cluster_ref, load_cluster_ref, work_probe
from gpuclusters.server.db.allocation import (
    allocate_nodes,
    free_counts,
    placement_guard,
    spare_hosts,
)
from gpuclusters.server.db.gateway import assign_ports
from gpuclusters.server.db.models import Cluster, ClusterPhase, Node, Volume, utcnow
from gpuclusters.server.db.records import record_event, set_cluster_status
from gpuclusters.server.runtime import Runtime

S = ClusterStatus
_SETTLED = (S.READY.value, S.FAILED.value)
# Statuses in which a cluster moves only when its nodes do (and its nodes'
# hints wake it): ``deleting`` while it still has nodes, the rest always.
_WAITING_ON_NODES = (
    *_SETTLED,
    S.WAITING_FOR_NODES.value,
    S.DELETING.value,
    S.DEGRADED.value,
)
# Statuses in which the preemptible pool grows (the control plane is up).
RESERVATION_ENDED = "reservation_ended"  # Node.delete_reason
_ENDING = (BillingType.RESERVED.value, BillingType.SCHEDULED_CAPACITY.value)
_POOL_STATUSES = (
    S.WAITING_FOR_NODES.value,
    S.RUNNING_ACCEPTANCE_TESTS.value,
    S.READY.value,
    S.DEGRADED.value,
)


class ClusterNode(NamedTuple):
    """What a cluster's step reads of each of its live nodes: plain
    columns, not entities (a cluster is stepped each time a node settles,
    and building ORM objects for all its nodes was most of that cost)."""

    id: str
    name: str
    phase: str
    compute_class: str
    to_delete: bool
    message: str


@dataclass(slots=True)
class ClusterStep:
    """What one step of one cluster sees, loaded afresh for each step."""

    row_id: str
    token: str
    cluster: Cluster
    nodes: list[ClusterNode]
    layer: ClusterLayer
    ref: ClusterRef
    overdue: bool = False  # the status's deadline passed

    @property
    def status(self) -> ClusterStatus:
        return S(self.cluster.status)

    def standard_counts(self) -> tuple[list[ClusterNode], list[ClusterNode], int]:
        """The standard nodes that failed and run, and how many are wanted."""
        standard = [
            n
            for n in self.nodes
            if n.compute_class == ComputeClass.STANDARD.value and not n.to_delete
        ]
        failed = [n for n in standard if n.phase == NodePhase.FAILED.value]
        running = [n for n in standard if n.phase == NodePhase.RUNNING.value]
        return failed, running, self.cluster.num_gpus // GPUS_PER_NODE


Handler = Callable[[ClusterStep], Awaitable[Outcome]]


class ClusterReconciler(SteppedReconciler):
    name = hints.CLUSTERS
    model = Cluster
    # A cluster hears from each of its nodes as it settles; their hints a
    # moment apart make one pass.
    gather_s = 0.2
    # How often a full pass also looks at clusters that only wait for their
    # nodes (see ``candidates``); the first pass of a process always does.
    sweep_s = 30.0

    def __init__(self, ctx: ControllerContext, rt: Runtime) -> None:
        super().__init__(ctx)
        self.rt = rt
        # Clusters ready when this process started, whose control plane it
        # has not yet re-ensured (taken once, by the first pass).
        self._to_verify: set[str] = set()
        self._snapshot_taken = False
        self._last_sweep = -math.inf
        # One handler per status (deleted and failed have none).
        self.handlers: dict[ClusterStatus, Handler] = {
            S.DELETING: self._deleting,
            S.QUEUED: self._queued,
            S.WAITING_FOR_BUILD: self._control_plane,
            S.WAITING_FOR_CONTROL_PLANE: self._control_plane,
            S.WAITING_FOR_VOLUME: self._waiting_for_volume,
            S.WAITING_FOR_NODES: self._waiting_for_nodes,
            S.RUNNING_ACCEPTANCE_TESTS: self._acceptance_tests,
            S.READY: self._usable,
            S.DEGRADED: self._usable,
        }

    @property
    def deadlines(self) -> dict[str, float]:
        return self.rt.settings.cluster_phase_deadlines_s

    @staticmethod
    def _busy(*, with_waiting: bool = True) -> Select[str]:
        """Live clusters not settled: moving, with a node that is not
        running (or is going), or with configuration still to apply.
        Without ``with_waiting``, only those with work of their own: not
        the ones that only wait for their nodes to move (see
        ``candidates``)."""
        unsettled_node = exists().where(
            Node.cluster_id == Cluster.id,
            Node.deleted_at.is_(None),
            (Node.phase != NodePhase.RUNNING.value) | Node.to_delete,
        )
        config_due = Cluster.config_generation != Cluster.applied_config_generation
        if with_waiting:
            return select(Cluster.id).where(
                Cluster.deleted_at.is_(None),
                Cluster.status.not_in(_SETTLED) | unsettled_node | config_due,
            )
        live_node = exists().where(Node.cluster_id == Cluster.id, Node.deleted_at.is_(None))
        # Configuration is applied once usable (a new cluster's counts as
        # due until then, as its control plane started with it).
        usable = Cluster.status.in_((S.READY.value, S.DEGRADED.value))
        return select(Cluster.id).where(
            Cluster.deleted_at.is_(None),
            Cluster.status.not_in(_WAITING_ON_NODES)
            | ((Cluster.status == S.DELETING.value) & ~live_node)
            | (usable & config_due),
        )

    async def candidates_among(self, session: AsyncSession, ids: set[str]) -> Sequence[str]:
        if not self._snapshot_taken:
            return await super().candidates_among(session, ids)
        busy = await session.scalars(self._busy().where(Cluster.id.in_(ids)))
        pool = await self._pool_candidates(session)
        ending = await self._ending_candidates(session)
        return [*busy, *(ids & (self._to_verify | set(pool) | set(ending)))]

    async def candidates(self, session: AsyncSession) -> Sequence[str]:
        # Clusters that only wait for their nodes (waiting_for_nodes,
        # deleting while nodes are left, ready or degraded with a node
        # moving) are woken by their nodes' hints as those settle
        # (``NodeReconciler.settled`` and ``fail``); a full pass due by the
        # poll interval looks at them only every ``sweep_s``, one asked for
        # by a full hint (``Hints.notify``: a node failed by housekeeping, a
        # repair, a host removed) at once. Hints are this process's, so the
        # sweep is what catches another replica's moves, a crashed
        # process's, and deadlines. Stepping every one of them at every
        # full pass cost as many steps as their nodes' own in a burst.
        now = time.monotonic()
        sweep = self.full_pass_asked or now - self._last_sweep >= self.sweep_s
        busy = await session.scalars(self._busy(with_waiting=sweep))
        if sweep:
            self._last_sweep = now
        if not self._snapshot_taken:
            self._to_verify.update(
                await session.scalars(
                    select(Cluster.id).where(
                        Cluster.deleted_at.is_(None),
                        Cluster.status.in_((S.READY.value, S.DEGRADED.value)),
                    )
                )
            )
            self._snapshot_taken = True
        pool = await self._pool_candidates(session)
        ending = await self._ending_candidates(session)
        # Ready clusters need one look per server process (see step()).
        return list(dict.fromkeys([*busy, *self._to_verify, *pool, *ending]))

    async def _ending_candidates(self, session: AsyncSession) -> list[str]:
        """Reserved and scheduled clusters due a warning or at their end."""
        rows = await session.scalars(
            select(Cluster).where(
                Cluster.deleted_at.is_(None),
                Cluster.reservation_end.is_not(None),
                Cluster.billing_type.in_(_ENDING),
                Cluster.status != S.DELETING.value,
            )
        )
        return [c.id for c in rows if self._end_due(c) is not None]

    def _end_due(self, cluster: Cluster) -> str | None:
        """ "end" when the reservation is over, "warn" when it ends within the
        warning period and no warning was given for this end yet."""
        end = cluster.reservation_end
        if end is None or cluster.billing_type not in _ENDING:
            return None
        now = utcnow()
        if now >= end:
            return "end"
        warn = timedelta(hours=self.rt.settings.reservation_warning_h)
        # Warned once it has nodes to warn (a queued one has none yet).
        if now >= end - warn and cluster.nodes_placed and cluster.end_warned_for != end:
            return "warn"
        return None

    async def _reservation_end(self, row_id: str, token: str, due: str) -> bool:
        """Warn every node once, 24 h before the end; at the end, delete the
        cluster (its volume stays, as after any delete without
        --delete-volume)."""
        async with self.ctx.sessionmaker() as session:
            await leases.fence(session, Cluster, row_id, token=token, ttl_s=self.ctx.lease_ttl_s)
            cluster, nodes = await self._load(session, row_id)
            end = cluster.reservation_end
            assert end is not None
            when = end.isoformat(timespec="seconds")
            if due == "warn":
                for node in nodes:
                    await record_event(
                        session,
                        node,
                        EventReason.RESERVATION_ENDING,
                        f"the {cluster.billing_type} capacity of cluster {cluster.name} ends at "
                        f"{when}; the cluster is deleted then (extend it with "
                        "`gpuclusters clusters scale --reservation-end`)",
                    )
                cluster.end_warned_for = end
            else:
                await set_cluster_status(
                    session, cluster, S.DELETING.value, f"reservation ended at {when}"
                )
                for node in nodes:
                    if not node.to_delete:
                        node.to_delete = True
                        node.delete_reason = RESERVATION_ENDED
            await session.commit()
        self.ctx.hints.notify(hints.NODES)
        return True

    async def _place_queued(self, row_id: str, token: str) -> bool:
        """A queued request whose start has come: place its standard nodes,
        or say what is missing and try again at the next pass."""
        async with (
            self.ctx.sessionmaker() as session,
            placement_guard(session, self.rt.placement_lock),
        ):
            cluster = await leases.fenced(
                session, Cluster, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            if (
                cluster.nodes_placed
                or cluster.status == S.DELETING.value
                or (cluster.start_at and cluster.start_at > utcnow())
            ):
                return False
            try:
                await allocate_nodes(
                    session,
                    cluster=cluster,
                    count=cluster.num_gpus // GPUS_PER_NODE,
                    compute_class=ComputeClass.STANDARD.value,
                    work=work_probe(session, self.rt),
                    deadlines=self.rt.settings.node_phase_deadlines_s,
                )
            except CapacityUnavailableError as exc:
                await session.rollback()
                await leases.fence(
                    session, Cluster, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
                )
                cluster = await session.get_one(Cluster, row_id)
                if cluster.status == S.DELETING.value:
                    return False
                await set_cluster_status(
                    session, cluster, S.QUEUED.value, f"waiting for capacity: {exc}"
                )
                await session.commit()
                return False
            cluster.nodes_placed = True
            await set_cluster_status(
                session, cluster, S.WAITING_FOR_CONTROL_PLANE.value, deadlines=self.deadlines
            )
            await session.commit()
        self.ctx.hints.notify(hints.NODES)
        return True

    async def _pool_candidates(self, session: AsyncSession) -> list[str]:
        """Clusters short of their preemptible target while spare hosts of
        their GPU type exist. Runs at every poll: three queries, whatever
        the number of clusters."""
        clusters = list(
            await session.scalars(
                select(Cluster).where(
                    Cluster.deleted_at.is_(None),
                    Cluster.num_preemptible_gpus > 0,
                    Cluster.status.in_(_POOL_STATUSES),
                )
            )
        )
        if not clusters:
            return []
        rows = await session.execute(
            select(Node.cluster_id, func.count(Node.id))
            .where(
                Node.cluster_id.in_([c.id for c in clusters]),
                Node.deleted_at.is_(None),
                Node.to_delete.is_(False),
                Node.compute_class == ComputeClass.PREEMPTIBLE.value,
            )
            .group_by(Node.cluster_id)
        )
        live = {cluster_id: int(n) for cluster_id, n in rows}
        spare = await free_counts(session)
        return [
            c.id
            for c in clusters
            if spare[(c.gpu_type, c.region)]
            and preemptible_deficit(
                target_gpus=c.num_preemptible_gpus, live_nodes=live.get(c.id, 0)
            )
        ]

    @staticmethod
    async def _pool_deficit(session: AsyncSession, cluster: Cluster) -> int:
        live = len(
            list(
                await session.scalars(
                    select(Node.id).where(
                        Node.cluster_id == cluster.id,
                        Node.deleted_at.is_(None),
                        Node.to_delete.is_(False),
                        Node.compute_class == ComputeClass.PREEMPTIBLE.value,
                    )
                )
            )
        )
        return preemptible_deficit(target_gpus=cluster.num_preemptible_gpus, live_nodes=live)

    async def _fill_pool(self, row_id: str, token: str) -> bool:
        """Add preemptible nodes on spare hosts toward the target; True if any."""
        async with (
            self.ctx.sessionmaker() as session,
            placement_guard(session, self.rt.placement_lock),
        ):
            cluster = await leases.fenced(
                session, Cluster, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            if cluster.status not in _POOL_STATUSES:
                return False
            count = min(
                await self._pool_deficit(session, cluster),
                await spare_hosts(session, cluster=cluster),
            )
            if count <= 0:
                return False
            added = await allocate_nodes(
                session,
                cluster=cluster,
                count=count,
                compute_class=ComputeClass.PREEMPTIBLE.value,
                deadlines=self.rt.settings.node_phase_deadlines_s,
            )
            await session.flush()
            for node in added:
                await record_event(
                    session,
                    node,
                    EventReason.SCALED_UP,
                    f"preemptible node {node.name} added on spare capacity "
                    f"(target {cluster.num_preemptible_gpus} GPUs)",
                )
            await session.commit()
        self.ctx.hints.notify(hints.NODES)
        return True

    async def _load(self, session: AsyncSession, row_id: str) -> tuple[Cluster, list[Node]]:
        cluster = await session.get_one(Cluster, row_id)
        nodes = list(
            await session.scalars(
                select(Node).where(Node.cluster_id == row_id, Node.deleted_at.is_(None))
            )
        )
        return cluster, nodes

    async def load(self, row_id: str, token: str) -> ClusterStep:
        async with self.ctx.sessionmaker() as session:
            cluster = await session.get_one(Cluster, row_id)
            nodes = [
                ClusterNode(*row)
                for row in await session.execute(
                    select(
                        Node.id,
                        Node.name,
                        Node.phase,
                        Node.compute_class,
                        Node.to_delete,
                        Node.message,
                    ).where(Node.cluster_id == row_id, Node.deleted_at.is_(None))
                )
            ]
            # SSH access only for the steps that (re)start the login node's sshd.
            brings_up = cluster.status == S.WAITING_FOR_CONTROL_PLANE.value or (
                cluster.status in (S.READY.value, S.DEGRADED.value) and row_id in self._to_verify
            )
            # The cluster as layers see it (members, nodes, SSH access) only
            # for the steps that call the layer; waiting for nodes does not.
            calls_layer = (
                (cluster.status == S.DELETING.value and not nodes)
                or brings_up
                or (
                    cluster.status in (S.READY.value, S.DEGRADED.value)
                    and cluster.applied_config_generation != cluster.config_generation
                )
            )
            ref = (
                await load_cluster_ref(session, cluster, self.rt, ssh=brings_up)
                if calls_layer
                else cluster_ref(cluster)
            )
        return ClusterStep(
            row_id=row_id,
            token=token,
            cluster=cluster,
            nodes=nodes,
            layer=self.rt.layer_for(cluster.cluster_type),
            ref=ref,
        )

    async def step(self, row_id: str, token: str) -> Outcome:
        """One transition: the deadline, the reservation's end and the
        preemptible pool apply to every status; then the status's handler."""
        s = await self.load(row_id, token)
        if s.status not in (S.READY, S.DEGRADED):
            self._to_verify.discard(row_id)  # only a usable cluster is re-checked
        if s.cluster.deleted_at is not None:
            return WAIT
        deadline = s.cluster.phase_deadline_at
        if deadline is not None and utcnow() >= deadline:
            if s.status.value not in CLUSTER_FINISH_AT_DEADLINE:
                limit = self.deadlines.get(s.status.value, 0)
                why = f"still {s.status.value} after its deadline ({limit:.0f} s)"
                if s.cluster.last_error:
                    why += f"; last error: {s.cluster.last_error}"
                elif s.cluster.status_message:
                    why += f": {s.cluster.status_message}"
                return fail(why)
            s.overdue = True
        if s.status is not S.DELETING:
            due = self._end_due(s.cluster)
            if due is not None:
                return of(await self._reservation_end(row_id, token, due))
            if (
                s.cluster.status in _POOL_STATUSES
                and s.cluster.num_preemptible_gpus > 0
                and await self._fill_pool(row_id, token)
            ):
                return MOVED
        handler = self.handlers.get(s.status)
        return WAIT if handler is None else await handler(s)

    async def fail(self, row_id: str, token: str, reason: str) -> None:
        """A permanent error or a deadline passed: the cluster fails with the
        reason (a delete in progress goes on instead)."""
        async with self.ctx.sessionmaker() as session:
            await leases.fence(session, Cluster, row_id, token=token, ttl_s=self.ctx.lease_ttl_s)
            status = await session.scalar(select(Cluster.status).where(Cluster.id == row_id))
        if status == S.DELETING.value:
            raise StepFailed(reason)
        await self._transition(row_id, token, S.FAILED, reason)

    async def _deleting(self, s: ClusterStep) -> Outcome:
        """Once its nodes are released (the node reconciler does that and
        hints us), stop the control plane and forget the cluster. A delete
        always finishes: a layer delete that keeps failing is skipped once
        forced or past the deadline, and the skip is kept in the history."""
        if s.nodes:
            return WAIT
        note = ""
        try:
            await s.layer.delete(s.ref)  # idempotent, outside any transaction
        except Exception as exc:
            why = (
                f"delete forced: {s.cluster.force_delete_reason}"
                if s.cluster.force_delete_reason
                else ("deleting passed its deadline" if s.overdue else None)
            )
            if why is None:
                raise StepFailed(f"stopping the control plane: {exc}") from exc
            note = f"; stopping the control plane skipped ({why}): {exc}"
        async with self.ctx.sessionmaker() as session:
            await leases.fence(
                session, Cluster, s.row_id, token=s.token, ttl_s=self.ctx.lease_ttl_s
            )
            cluster, _ = await self._load(session, s.row_id)
            await self._release_volume(session, cluster)
            await set_cluster_status(session, cluster, S.DELETED.value, "cluster deleted" + note)
            cluster.deleted_at = utcnow()
            await session.commit()
        self.ctx.hints.notify(hints.VOLUMES)
        # Nothing is left to do: the pass ends (no step to find it deleted).
        return moved(S.DELETING.value, S.DELETED.value, settled=True)

    async def _queued(self, s: ClusterStep) -> Outcome:
        if not s.cluster.nodes_placed:
            return of(await self._place_queued(s.row_id, s.token))
        return of(await self._transition(s.row_id, s.token, S.WAITING_FOR_CONTROL_PLANE))

    async def _control_plane(self, s: ClusterStep) -> Outcome:
        waiting = s.layer.waiting_for_builds()
        if waiting is not None:
            return of(await self._transition(s.row_id, s.token, S.WAITING_FOR_BUILD, waiting))
        if s.status is S.WAITING_FOR_BUILD:
            return of(await self._transition(s.row_id, s.token, S.WAITING_FOR_CONTROL_PLANE))
        if not await s.layer.ensure_control_plane(s.ref):
            return WAIT
        await self._open_gateway(s.row_id, s.token, s.ref)
        self.ctx.hints.notify(hints.NODES)  # nodes waiting to join can go now
        return of(await self._transition(s.row_id, s.token, S.WAITING_FOR_VOLUME))

    async def _waiting_for_volume(self, s: ClusterStep) -> Outcome:
        return of(await self._bind_volume(s.row_id, s.token))

    async def _waiting_for_nodes(self, s: ClusterStep) -> Outcome:
        failed, running, wanted = s.standard_counts()
        if failed:
            names = ", ".join(n.name for n in failed)
            # A cluster that was ready before (this is a scale-up) only
            # degrades; one that never became ready has failed.
            was_ready = await self._was_ready(s.row_id)
            return of(
                await self._transition(
                    s.row_id,
                    s.token,
                    S.DEGRADED if was_ready else S.FAILED,
                    f"node(s) failed to come up: {names}: {failed[0].message}",
                )
            )
        if len(running) >= wanted:
            return of(await self._transition(s.row_id, s.token, S.RUNNING_ACCEPTANCE_TESTS))
        return of(
            await self._transition(
                s.row_id, s.token, S.WAITING_FOR_NODES, f"{len(running)}/{wanted} nodes running"
            )
        )

    async def _acceptance_tests(self, s: ClusterStep) -> Outcome:
        # Each node passed its acceptance tests before it counted as
        # running (the node reconciler runs them); nothing is left here.
        _, running, wanted = s.standard_counts()
        return of(
            await self._transition(
                s.row_id, s.token, S.READY, f"{len(running)}/{wanted} nodes running"
            )
        )

    async def _usable(self, s: ClusterStep) -> Outcome:
        """Ready or degraded: re-checked once per server process, new
        configuration applied, and the status following the nodes."""
        row_id, token = s.row_id, s.token
        if row_id in self._to_verify:
            # First look since this process started: make sure the control
            # plane is really there (daemons restarted, service nodes rebuilt).
            if not await s.layer.ensure_control_plane(s.ref):
                return WAIT
            await self._open_gateway(row_id, token, s.ref)
            self._to_verify.discard(row_id)
            return MOVED
        if s.cluster.applied_config_generation != s.cluster.config_generation:
            generation = s.cluster.config_generation
            await s.layer.apply_config(s.ref)
            await self._open_gateway(row_id, token, s.ref)  # egress may have changed
            async with self.ctx.sessionmaker() as session:
                await leases.fence(
                    session, Cluster, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
                )
                row = await session.get_one(Cluster, row_id)
                row.applied_config_generation = generation
                await session.commit()
            return MOVED
        failed, running, wanted = s.standard_counts()
        # An autoscaled cluster's nodes come and go with its queue: one
        # still booting does not degrade it (the cluster stays usable).
        short = len(running) < wanted and s.cluster.autoscale_max_gpus is None
        status = S.DEGRADED if failed or short else S.READY
        return of(
            await self._transition(row_id, token, status, f"{len(running)}/{wanted} nodes running")
        )

    async def _open_gateway(self, row_id: str, token: str, ref: ClusterRef) -> None:
        """The cluster's gateway ports (given now to clusters made before
        there were any) forwarded to where its layer says, and its egress;
        idempotent, and cheap when nothing changed."""
        access = self.rt.node_access
        if access is None:
            return
        async with self.ctx.sessionmaker() as session:
            cluster = await leases.fenced(
                session, Cluster, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            settings = self.rt.settings
            if await assign_ports(
                session, cluster, host=settings.gateway_host, port_range=settings.gateway_port_range
            ):
                await session.commit()
            public = {"ssh": cluster.ssh_port, "kubernetes": cluster.kubernetes_port}
            egress = cluster.egress
        targets = await self.rt.layer_for(ref.cluster_type).gateway_targets(ref)
        forwards = {
            name: GatewayTarget(public_port=port, address=address, port=target_port)
            for name, (address, target_port) in targets.items()
            if (port := public.get(name)) is not None
        }
        await access.ensure_gateway(cluster_id=ref.cluster_id, egress=egress, forwards=forwards)

    async def _was_ready(self, row_id: str) -> bool:
        async with self.ctx.sessionmaker() as session:
            hit = await session.scalar(
                select(ClusterPhase.id)
                .where(ClusterPhase.cluster_id == row_id, ClusterPhase.phase == S.READY.value)
                .limit(1)
            )
        return hit is not None

    async def _transition(self, row_id: str, token: str, status: S, message: str = "") -> bool:
        async with self.ctx.sessionmaker() as session:
            cluster = await leases.fenced(
                session, Cluster, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            if cluster.status == S.DELETING.value:
                return False  # a delete arrived meanwhile; next pass handles it
            changed = await set_cluster_status(
                session, cluster, status.value, message, deadlines=self.deadlines
            )
            if status is S.WAITING_FOR_VOLUME and cluster.control_plane_ready_at is None:
                cluster.control_plane_ready_at = utcnow()
            await session.commit()
        if status is S.READY:
            self._to_verify.discard(row_id)  # it just got here: nothing to re-check
        return changed

    async def _bind_volume(self, row_id: str, token: str) -> bool:
        async with self.ctx.sessionmaker() as session:
            cluster = await leases.fenced(
                session, Cluster, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            if cluster.status == S.DELETING.value:
                return False  # a delete arrived meanwhile (as in _transition)
            volume = await session.get(Volume, cluster.volume_id) if cluster.volume_id else None
            if volume is not None:
                if volume.status == VolumeStatus.PROVISIONING.value:
                    return False  # the volume reconciler makes it; it hints us
                if volume.status == VolumeStatus.AVAILABLE.value or (
                    volume.status == VolumeStatus.BOUND.value and volume.cluster_id == cluster.id
                ):
                    volume.status = VolumeStatus.BOUND.value
                    volume.cluster_id = cluster.id
                else:
                    await set_cluster_status(
                        session, cluster, S.FAILED.value, f"volume {volume.name} is {volume.status}"
                    )
                    await session.commit()
                    return True
            await set_cluster_status(
                session, cluster, S.WAITING_FOR_NODES.value, deadlines=self.deadlines
            )
            await session.commit()
        self.ctx.hints.notify(hints.NODES)
        return True

    async def _release_volume(self, session: AsyncSession, cluster: Cluster) -> None:
        """Detach the cluster's volume; delete it only when asked (or when it
        was created tied to the cluster's lifecycle). Data is never removed
        otherwise."""
        if not cluster.volume_id:
            return
        volume = await session.get(Volume, cluster.volume_id)
        if volume is None or volume.deleted_at is not None:
            return
        if volume.cluster_id not in (None, cluster.id):
            return  # bound elsewhere since; not ours to touch
        volume.cluster_id = None
        if cluster.delete_volume or not volume.is_lifecycle_independent:
            volume.status = VolumeStatus.DELETING.value
        elif volume.status == VolumeStatus.BOUND.value:
            volume.status = VolumeStatus.AVAILABLE.value
