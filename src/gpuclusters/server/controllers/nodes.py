"""Node reconciler: drives one node through its phases.

pending -> scheduling -> booting -> bootstrapping -> running, and, once the
node is marked ``to_delete``, draining -> releasing -> deleted.

Crash safety: the node row (with its host) exists before the provider is
asked for anything, and provider calls are idempotent on the node id, so a
crash between "ask" and "record" only means asking again. A node whose
provider instance vanished while booting is asked for again.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.enums import EventReason, NodePhase
from gpuclusters.layers.base import PermanentLayerError
from gpuclusters.providers.base import InstanceState, PermanentProviderError
from gpuclusters.server.controllers import hints, leases
from gpuclusters.server.controllers.base import ControllerContext, SteppedReconciler
from gpuclusters.server.controllers.refs import load_cluster_ref, node_ref, node_spec
from gpuclusters.server.db.models import Cluster, Host, Node, utcnow
from gpuclusters.server.db.records import record_event, set_node_phase
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.keys import hash_key, new_key

P = NodePhase
DRAIN_REASON = "gpuclusters: node removed"
AGENT_TOKEN_PATH = "/etc/gpuclusters/agent-token"


class NodeReconciler(SteppedReconciler):
    name = hints.NODES
    model = Node

    def __init__(
        self, ctx: ControllerContext, rt: Runtime, *, drain_timeout_s: float = 300.0
    ) -> None:
        super().__init__(ctx)
        self.rt = rt
        self.drain_timeout_s = drain_timeout_s
        # Running nodes this process has re-checked since it started. After a
        # restart every running node is checked once: re-adopted if its
        # instance is there (join again, which restarts dead daemons), rebuilt
        # if the instance is gone (e.g. the host rebooted).
        self._verified = rt.verified_nodes

    async def candidates(self, session: AsyncSession) -> Sequence[str]:
        rows = await session.execute(
            select(Node.id, Node.phase, Node.to_delete).where(Node.deleted_at.is_(None))
        )
        return [
            node_id
            for node_id, phase, to_delete in rows
            if to_delete
            or (phase == P.RUNNING.value and node_id not in self._verified)
            or phase not in (P.RUNNING.value, P.FAILED.value)
        ]

    async def reconcile(self, row_id: str, token: str) -> bool:
        changed = await super().reconcile(row_id, token)
        if changed:
            self.ctx.hints.notify(hints.CLUSTERS)  # cluster status follows its nodes
        return changed

    async def step(self, row_id: str, token: str) -> bool:
        async with self.ctx.sessionmaker() as session:
            node = await session.get_one(Node, row_id)
            cluster = await session.get_one(Cluster, node.cluster_id)
            host = await session.get(Host, node.host_id) if node.host_id else None
            cref = await load_cluster_ref(session, cluster)
        phase = P(node.phase)
        layer = self.rt.layer_for(cluster.cluster_type)
        nref = node_ref(node, host)

        if node.deleted_at is not None:
            return False

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

        if phase is P.PENDING:
            return await self._write(
                row_id, token, phase=P.SCHEDULING, message=f"placed on {nref.host}"
            )

        if phase is P.SCHEDULING:
            if host is None:
                return await self._write(row_id, token, phase=P.FAILED, message="no host assigned")
            try:
                inst = await self.rt.provider.create(node_spec(node, cluster, host))
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

        if phase is P.RUNNING and row_id not in self._verified:
            inst = await self.rt.provider.status(row_id)
            if inst.state is InstanceState.MISSING:
                return await self._write(
                    row_id, token, phase=P.SCHEDULING, message="instance lost; rebuilding"
                )
            if inst.state is InstanceState.RUNNING and not await layer.join_node(cref, nref):
                return False
            self._verified.add(row_id)
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
            return await self._write(row_id, token, phase=P.RUNNING)

        return False

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
                self._verified.add(row_id)
                await record_event(
                    session, node, EventReason.NODE_ADDED, f"node {node.name} is running"
                )
            elif phase is P.FAILED:
                await record_event(session, node, EventReason.NODE_FAILED, message)
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
        return True
