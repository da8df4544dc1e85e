"""Repair reconciler: carries out approved remediations, one step at a time.

pending -> running: an automatic repair no person has approved starts only
once it has settled and the cluster as a whole is within the unhealthy
limit (``alerts.start_decision``, decided and recorded in one fenced
transaction); over the limit it goes back to ``pending_approval``.
Then ``cordoning`` (the orchestrators stop placing work
there; our drain reason) -> ``draining`` (job protection: wait for the node
to be idle, up to the cluster's ``repair_max_wait_s`` (default 2 h), then
drain, which requeues Slurm jobs and evicts pods; ``-1`` never interrupts
running work) -> ``repairing`` (reboot or reprovision the node in place) or
``migrating`` (the old host is cordoned, the node is rebuilt on a free host)
-> ``joining`` (the node reconciler brings it back: boot, agent, join) ->
succeeded once the node runs again (uncordoned, its alerts resolved), failed
if it does not come back. ``remove`` takes the node away for good.

Crash safety: every step is idempotent and recorded before the next; the
migration records the old host before it touches anything, and a host is
taken only through the unique index on live nodes. A node whose state is
unknown is never deleted: only ``remove``, which a person asks for, deletes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.enums import HostState, NodePhase
from gpuclusters.core.errors import CapacityUnavailableError
from gpuclusters.core.health.rules import RepairAction, Verdict
from gpuclusters.layers.base import ClusterRef, NodeRef
from gpuclusters.server.controllers import hints, leases
from gpuclusters.server.controllers.alerts import start_decision
from gpuclusters.server.controllers.base import ControllerContext, SteppedReconciler
from gpuclusters.server.controllers.outcomes import Released
from gpuclusters.server.controllers.refs import load_cluster_ref, node_ref
from gpuclusters.server.db.allocation import choose_free_hosts
from gpuclusters.server.db.models import (
    Alert,
    Cluster,
    HealthRun,
    Host,
    Node,
    Remediation,
    utcnow,
)
from gpuclusters.server.db.records import close_usage, set_node_phase
from gpuclusters.server.runtime import Runtime

P = NodePhase
A = RepairAction


def repair_reason(rem: Remediation) -> str:
    return f"repair {rem.action} ({rem.id[:8]})"


class RepairReconciler(SteppedReconciler):
    name = hints.REPAIRS
    model = Remediation

    def __init__(self, ctx: ControllerContext, rt: Runtime) -> None:
        super().__init__(ctx)
        self.rt = rt

    async def candidates(self, session: AsyncSession) -> Sequence[str]:
        rows = await session.scalars(
            select(Remediation.id)
            .where(
                (Remediation.state.in_(("pending", "running")))
                | ((Remediation.state == "cancelled") & (Remediation.step != ""))
            )
            .order_by(Remediation.created_at)
        )
        return list(rows)

    async def reconcile(self, row_id: str, token: str) -> bool | Released:
        changed = await super().reconcile(row_id, token)
        if changed:
            self.ctx.hints.notify(hints.NODES, hints.CLUSTERS)
        return changed

    async def _save(self, row_id: str, token: str, **fields: object) -> bool:
        async with self.ctx.sessionmaker() as session:
            await leases.fence(
                session, Remediation, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            rem = await session.get_one(Remediation, row_id)
            now = utcnow()
            if "step" in fields and fields["step"] != rem.step:
                rem.step_changed_at = now
            for key, value in fields.items():
                setattr(rem, key, value)
            rem.updated_at = now
            if fields.get("state") in ("succeeded", "failed", "cancelled"):
                rem.finished_at = now
            await session.commit()
        return True

    async def step(self, row_id: str, token: str) -> bool:
        async with self.ctx.sessionmaker() as session:
            rem = await session.get_one(Remediation, row_id)
            node = await session.get(Node, rem.node_id)
            cluster = await session.get_one(Cluster, rem.cluster_id)
            host = await session.get(Host, node.host_id) if node and node.host_id else None
            cref = await load_cluster_ref(session, cluster, self.rt)
        layer = self.rt.layer_for(cluster.cluster_type)

        if rem.state == "cancelled":
            # Cancelled after the node was cordoned: give it back.
            if node is not None and node.deleted_at is None and host is not None:
                await layer.uncordon(cref, node_ref(node, host))
                await self._node(row_id, token, rem.node_id, cordoned=False)
            return await self._save(row_id, token, step="")

        if (
            node is None
            or node.deleted_at is not None
            or (node.to_delete and rem.action != A.REMOVE)
        ):
            return await self._save(
                row_id, token, state="cancelled", message="the node left the cluster"
            )
        nref = node_ref(node, host)
        action = A(rem.action)

        if rem.state == "pending":
            if rem.trigger == "automated" and rem.reviewed_by is None:
                return await self._start_automatic(row_id, token)
            if node.phase != P.RUNNING.value:
                return False  # e.g. still booting; repaired once it runs
            return await self._save(
                row_id, token, state="running", step="cordoning", started_at=utcnow()
            )

        if rem.step == "cordoning":
            await layer.cordon(cref, nref, reason=repair_reason(rem))
            await self._node(row_id, token, node.id, cordoned=True)
            return await self._save(row_id, token, step="draining")

        if rem.step == "draining":
            max_wait = cluster.repair_max_wait_s
            waited = (utcnow() - rem.step_changed_at).total_seconds()
            if await layer.running_work(cref, nref) > 0:
                if max_wait < 0 or waited < max_wait:
                    return False  # job protection: wait for the node to be idle
                if not await layer.drain(cref, nref, reason=repair_reason(rem), deadline=utcnow()):
                    return False
            return await self._save(
                row_id, token, step="migrating" if action is A.MIGRATE else "repairing"
            )

        if rem.step == "repairing":
            return await self._repair_in_place(row_id, token, rem, node, action)

        if rem.step == "migrating":
            return await self._migrate(row_id, token, rem, node, host, cref, nref)

        if rem.step == "joining":
            if action is A.REMOVE:
                if node.deleted_at is not None:
                    return await self._save(row_id, token, state="succeeded", step="")
                return False
            if node.phase == P.FAILED.value:
                return await self._save(
                    row_id,
                    token,
                    state="failed",
                    message=f"the node did not come back: {node.message}",
                )
            if node.phase != P.RUNNING.value:
                return False
            await layer.uncordon(cref, nref)
            await self._finish(row_id, token, rem, node)
            return True
        return False

    async def _start_automatic(self, row_id: str, token: str) -> bool:
        """Start an automatic repair no person has approved, or hold it for
        one: decided with the cluster's unhealthy nodes counted as a set,
        once it has settled (``alerts.start_decision``). The count and the
        new state are one transaction, so a fault another heartbeat records
        meanwhile is either counted here or holds this repair itself
        (``alerts.hold_if_paused`` changes only repairs still ``pending``)."""
        async with self.ctx.sessionmaker() as session:
            await leases.fence(
                session, Remediation, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            rem = await session.get_one(Remediation, row_id)
            node = await session.get_one(Node, rem.node_id)
            if rem.state != "pending" or rem.reviewed_by is not None:
                await session.commit()
                # Held, approved or cancelled meanwhile: the next pass takes
                # it from there (a cancelled one must not look cordoned).
                return False
            decision = await start_decision(session, rt=self.rt, rem=rem, node=node)
            now = utcnow()
            if decision.verdict is Verdict.HOLD:
                rem.state, rem.message, rem.updated_at = "pending_approval", decision.reason, now
            elif decision.verdict is Verdict.WAIT or node.phase != P.RUNNING.value:
                await session.commit()
                return False  # settling, or e.g. still booting: repaired once it runs
            else:
                rem.state, rem.step, rem.started_at = "running", "cordoning", now
                rem.step_changed_at = rem.updated_at = now
                rem.message = ""
            await session.commit()
        return True

    async def _node(self, row_id: str, token: str, node_id: str, **fields: object) -> None:
        async with self.ctx.sessionmaker() as session:
            await leases.fence(
                session, Remediation, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            node = await session.get_one(Node, node_id)
            for key, value in fields.items():
                setattr(node, key, value)
            await session.commit()

    async def _repair_in_place(
        self, row_id: str, token: str, rem: Remediation, node: Node, action: RepairAction
    ) -> bool:
        if action is A.REMOVE:
            async with self.ctx.sessionmaker() as session:
                await leases.fence(
                    session, Remediation, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
                )
                row = await session.get_one(Node, node.id)
                row.to_delete, row.delete_reason = True, "repair_remove"
                await session.commit()
            return await self._save(row_id, token, step="joining")
        if node.phase != P.REPAIRING.value:
            # Recorded first, so the node reconciler leaves it alone while
            # the provider works on it.
            async with self.ctx.sessionmaker() as session:
                await leases.fence(
                    session, Remediation, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
                )
                row = await session.get_one(Node, node.id)
                set_node_phase(row, P.REPAIRING.value, repair_reason(rem))
                await close_usage(session, row)
                await session.commit()
        if action is A.REBOOT:
            await self.rt.provider.reboot(node.id)
        else:
            await self.rt.provider.reprovision(node.id)
        async with self.ctx.sessionmaker() as session:
            await leases.fence(
                session, Remediation, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            row = await session.get_one(Node, node.id)
            # The node reconciler joins it again (daemons restart, the agent
            # keeps its token: its /etc survives both).
            set_node_phase(
                row,
                P.BOOTSTRAPPING.value,
                f"{rem.action} done; joining",
                deadlines=self.rt.settings.node_phase_deadlines_s,
            )
            await session.commit()
        return await self._save(row_id, token, step="joining")

    async def _migrate(
        self,
        row_id: str,
        token: str,
        rem: Remediation,
        node: Node,
        host: Host | None,
        cref: ClusterRef,
        nref: NodeRef,
    ) -> bool:
        async with self.ctx.sessionmaker() as session:
            await leases.fence(
                session, Remediation, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            row = await session.get_one(Node, node.id)
            r = await session.get_one(Remediation, row_id)
            cluster = await session.get_one(Cluster, row.cluster_id)
            if r.old_host_id is None:
                r.old_host_id = row.host_id
            if row.phase != P.REPAIRING.value:
                set_node_phase(
                    row, P.REPAIRING.value, f"migrating off {host.name if host else '?'}"
                )
                await close_usage(session, row)
            if r.old_host_id:
                old = await session.get_one(Host, r.old_host_id)
                old.state = HostState.CORDONED.value  # the faulty host takes nothing new
            await session.commit()
            old_host_id = r.old_host_id
            cluster_layer = self.rt.layer_for(cluster.cluster_type)
        # Off the old host: deregistered from the orchestrators, instance gone
        # (its /scratch with it). Both idempotent.
        if node.host_id == old_host_id:
            await cluster_layer.remove_node(cref, nref)
            await self.rt.provider.delete(node.id)
        async with self.ctx.sessionmaker() as session:
            await leases.fence(
                session, Remediation, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            row = await session.get_one(Node, node.id)
            cluster = await session.get_one(Cluster, row.cluster_id)
            if row.host_id == old_host_id:
                row.host_id = None
                await session.flush()
            if row.host_id is None:
                try:
                    ((host_id, _),) = await choose_free_hosts(
                        session,
                        count=1,
                        gpu_type=cluster.gpu_type,
                        region=cluster.region,
                        used_islands=[],
                    )
                except CapacityUnavailableError as exc:
                    await session.commit()
                    return await self._save(
                        row_id, token, message=f"waiting for a free host: {exc}"
                    )
                row.host_id = host_id
            set_node_phase(
                row,
                P.SCHEDULING.value,
                "migrated; rebuilding on a new host",
                deadlines=self.rt.settings.node_phase_deadlines_s,
            )
            row.agent_token_hash = None
            await session.commit()
        return await self._save(row_id, token, step="joining", message="")

    async def _finish(self, row_id: str, token: str, rem: Remediation, node: Node) -> None:
        now = utcnow()
        async with self.ctx.sessionmaker() as session:
            await leases.fence(
                session, Remediation, row_id, token=token, ttl_s=self.ctx.lease_ttl_s
            )
            row = await session.get_one(Node, node.id)
            row.cordoned = False
            # What the repair addressed is gone with the old state; a fault
            # that is still there is reported again by the next heartbeat.
            for alert_id in json.loads(rem.alert_ids):
                alert = await session.get(Alert, alert_id)
                if alert is not None and alert.resolved_at is None:
                    alert.resolved_at = now
            r = await session.get_one(Remediation, row_id)
            # The acceptance tests the node passed when it rejoined.
            if r.started_at is not None:
                runs = await session.scalars(
                    select(HealthRun.id).where(
                        HealthRun.node_id == node.id, HealthRun.created_at >= r.started_at
                    )
                )
                r.health_run_ids = json.dumps(sorted(runs))
            r.state, r.step, r.finished_at, r.updated_at = "succeeded", "", now, now
            r.message = f"{r.action} done; the node runs again"
            await session.commit()
