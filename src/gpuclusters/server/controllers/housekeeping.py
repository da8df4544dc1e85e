"""Periodic housekeeping, outside the reconcilers' row leases:

* garbage-collect provider instances that no live node row owns (orphans
  left by a crash between a node's deletion and its provider delete, or by
  a provider create whose row was rolled back);
* notice running nodes whose instance failed or vanished while this server
  ran (they go ``failed`` so the cluster shows ``degraded`` and repair can
  act); instances missing after a server *restart* are expected (a host
  reboot wipes the embedded fleet's namespaces) and the node reconciler
  rebuilds those instead;
* drop lifecycle events older than the retention (72 h by default);
* open a ``heartbeat_missed`` alert on running nodes whose agent went silent;
* mark hosts whose host agent went silent ``unreachable`` (docs/hosts.md);
* budgets: alerts, and the policy of a project whose budget is spent
  (controllers/budgets.py).

Orphan collection never deletes an instance whose node row is live, and the
node row always exists before its instance is asked for, so it cannot race
a create.

With several server replicas one does the chores for all: the holder of the
``housekeeping`` controller lease, renewed at every pass; when it dies the
lease expires and another replica takes over. The chores look at ids and the
few rows that need something, never load the whole fleet's rows, and ask the
provider for one listing per pass, not one call per node.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from sqlalchemy import delete, select

from gpuclusters.core.enums import EventReason, HostAgentStatus, NodePhase
from gpuclusters.providers.base import InstanceState, ProviderError
from gpuclusters.server.controllers import hints, leases
from gpuclusters.server.controllers.alerts import note_missed_heartbeats
from gpuclusters.server.controllers.budgets import enforce_budgets
from gpuclusters.server.controllers.sso_sessions import recheck_sessions
from gpuclusters.server.db.models import AuditEvent, Host, Node, NodeEvent, utcnow
from gpuclusters.server.db.records import close_usage, record_event, set_node_phase
from gpuclusters.server.runtime import Runtime

log = logging.getLogger(__name__)


async def collect_orphans(rt: Runtime) -> list[str]:
    instances = await rt.provider.list_instances()
    if not instances:
        return []
    async with rt.sessionmaker() as session:
        live = set(await session.scalars(select(Node.id).where(Node.deleted_at.is_(None))))
    orphans = [i.node_id for i in instances if i.node_id not in live]
    for node_id in orphans:
        log.warning("deleting orphaned provider instance %s", node_id)
        await rt.provider.delete(node_id)
    return orphans


async def check_running_nodes(rt: Runtime) -> int:
    """Mark running nodes whose instance failed or vanished as failed."""
    if not rt.nodes_snapshot_taken:
        return 0  # the node reconciler has not yet said which nodes are unchecked
    async with rt.sessionmaker() as session:
        nodes = (
            await session.execute(
                select(Node.id, Node.name).where(
                    Node.deleted_at.is_(None),
                    Node.phase == NodePhase.RUNNING.value,
                    Node.to_delete.is_(False),
                    Node.lock_token.is_(None),
                )
            )
        ).all()
    if not nodes:
        return 0
    # One listing for the whole fleet; only the nodes it shows as failed or
    # does not show at all (a silent host lists nothing, a node may have
    # been made since) are asked about one by one.
    listed = {i.node_id: i for i in await rt.provider.list_instances()}
    failed = 0
    for node_id, node_name in nodes:
        if node_id in rt.nodes_to_verify:
            continue  # not yet checked since start: the node reconciler rebuilds it if lost
        seen = listed.get(node_id)
        if seen is not None and seen.state not in (InstanceState.MISSING, InstanceState.FAILED):
            continue
        try:
            inst = await rt.provider.status(node_id)
        except ProviderError as exc:
            # Cannot tell (its host agent is unreachable): the node is left
            # as it is, to the health rules; never failed on a guess.
            log.info("node %s: status unknown: %s", node_name, exc)
            continue
        if inst.state not in (InstanceState.MISSING, InstanceState.FAILED):
            continue
        message = inst.message or f"provider reports the node {inst.state.value}"
        async with rt.sessionmaker() as session:
            row = await session.get_one(Node, node_id)
            if row.phase != NodePhase.RUNNING.value or row.lock_token is not None:
                continue
            set_node_phase(row, NodePhase.FAILED.value, message)
            await record_event(session, row, EventReason.NODE_FAILED, message)
            await close_usage(session, row)
            await session.commit()
        failed += 1
    if failed:
        rt.hints.notify(hints.CLUSTERS)
    return failed


async def _delete_older(rt: Runtime, model: type[NodeEvent | AuditEvent], age: timedelta) -> int:
    """Delete the rows of ``model`` whose timestamp is older than ``age``."""
    cutoff = utcnow() - age
    async with rt.sessionmaker() as session:
        result = await session.execute(delete(model).where(model.timestamp < cutoff))
        await session.commit()
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


async def expire_events(rt: Runtime) -> int:
    return await _delete_older(rt, NodeEvent, timedelta(hours=rt.settings.event_retention_h))


async def expire_audit_events(rt: Runtime) -> int:
    return await _delete_older(rt, AuditEvent, timedelta(days=rt.settings.audit_retention_days))


async def missed_heartbeats(rt: Runtime) -> int:
    return await note_missed_heartbeats(rt, missed_after_s=rt.settings.heartbeat_timeout_s)


async def sweep_unreachable_hosts(rt: Runtime) -> list[str]:
    """Hosts whose agent went silent become ``unreachable``; returns them."""
    cutoff = utcnow() - timedelta(seconds=rt.settings.host_agent_timeout_s)
    async with rt.sessionmaker() as session:
        silent = list(
            await session.scalars(
                select(Host).where(
                    Host.agent_status.in_(
                        [HostAgentStatus.READY.value, HostAgentStatus.JOINING.value]
                    ),
                    Host.last_heartbeat_at.is_not(None),
                    Host.last_heartbeat_at < cutoff,
                )
            )
        )
        for host in silent:
            log.warning(
                "host %s: no heartbeat since %s; unreachable (nothing on it is deleted)",
                host.name,
                host.last_heartbeat_at,
            )
            host.agent_status = HostAgentStatus.UNREACHABLE.value
        await session.commit()
    return [h.name for h in silent]


HOUSEKEEPING_LEASE = "housekeeping"


async def run_housekeeping(rt: Runtime) -> None:
    """Loop forever (until cancelled) while holding the housekeeping lease;
    one failing chore does not stop the others."""
    await leases.run_singleton(
        rt.sessionmaker,
        HOUSEKEEPING_LEASE,
        interval_s=rt.settings.housekeeping_interval_s,
        ttl_s=2 * rt.settings.housekeeping_interval_s + rt.settings.lease_ttl_s,
        work=lambda: _chores(rt),
    )


async def _chores(rt: Runtime) -> None:
    for chore in (
        sweep_unreachable_hosts,
        collect_orphans,
        check_running_nodes,
        expire_events,
        expire_audit_events,
        recheck_sessions,
        missed_heartbeats,
        enforce_budgets,
    ):
        try:
            await chore(rt)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("housekeeping: %s failed", chore.__name__)
