"""Health-run reconciler: runs queued active checks on their nodes.

A run executes ``python -m gpuclusters.agent.checks`` on the node (the
same interpreter and package the node agent uses) with the cluster's
thresholds for the GPU type, as the orchestrator's exclusive work where it
can (Slurm: an exclusive batch job; Kubernetes: while a placeholder Job
holds all the node's GPUs), so it waits for users' work to leave and
nothing lands beside it. GPU checks report ``skipped: no GPU`` where
PyTorch sees no GPU. Providers without shells (the fake one) skip with the
reason.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.layers.base import ClusterLayer, ClusterRef, NodeRef
from gpuclusters.server.controllers import hints, leases
from gpuclusters.server.controllers.base import ControllerContext, Reconciler
from gpuclusters.server.controllers.refs import load_cluster_ref, node_ref
from gpuclusters.server.db.models import Cluster, HealthRun, Host, Node, utcnow
from gpuclusters.server.runtime import Runtime

RUN_TIMEOUT_MARGIN_S = 300.0
ACCEPTANCE = "acceptance"  # HealthRun.requested_by of acceptance tests
# What every check gives where the provider has no shell on its nodes.
NO_SHELL: dict[str, Any] = {"state": "skipped", "reason": "no shell on this provider's nodes"}


async def run_check_on_node(
    rt: Runtime,
    node_id: str,
    check: str,
    *,
    duration_s: float,
    gpu_type: str,
    layer: ClusterLayer | None = None,
    cref: ClusterRef | None = None,
    nref: NodeRef | None = None,
) -> dict[str, Any]:
    """Run one active check on the node; its JSON result (or a failure).
    Where the orchestrator can (Slurm), the check is its exclusive job and
    waits for users' work to leave; otherwise it runs through the shell."""
    access = rt.node_access
    if access is None:
        return NO_SHELL
    thresholds = rt.settings.health_thresholds.get(gpu_type, {})
    shell = await access.shell(node_id)
    argv = [
        shell.python,
        "-m",
        "gpuclusters.agent.checks",
        check,
        "--duration",
        str(duration_s),
        "--gpu-type",
        gpu_type,
        "--thresholds",
        json.dumps(thresholds),
    ]
    timeout = duration_s + RUN_TIMEOUT_MARGIN_S
    result = None
    if layer is not None and cref is not None and nref is not None:
        result = await layer.run_exclusive(cref, nref, argv, timeout_s=timeout)
        if result is not None and result.returncode != 0 and not result.stdout.strip():
            return {
                "state": "skipped",
                "reason": "the node stayed busy: the check's job did not run in time",
                "output": result.stderr[-2000:],
            }
    if result is None:
        result = await shell.run(argv, check=False, timeout_s=timeout)
    try:
        outcome = json.loads(result.stdout.strip().splitlines()[-1])
        assert isinstance(outcome, dict)
    except (ValueError, IndexError, AssertionError):
        outcome = {
            "state": "failed",
            "reason": f"the check did not report (exit {result.returncode})",
            "output": (result.stdout + result.stderr)[-4000:],
        }
    return outcome


def record_outcome(run: HealthRun, outcome: dict[str, Any]) -> None:
    """Store a check's result on its run (the caller commits)."""
    run.state = str(outcome.get("state", "failed"))
    run.reason = str(outcome.get("reason", ""))
    run.metrics = json.dumps(outcome.get("metrics") or {})
    run.output = str(outcome.get("output", ""))[-20000:]
    run.finished_at = utcnow()


class HealthRunReconciler(Reconciler):
    name = hints.HEALTH
    model = HealthRun

    def __init__(self, ctx: ControllerContext, rt: Runtime) -> None:
        super().__init__(ctx)
        self.rt = rt

    async def candidates(self, session: AsyncSession) -> Sequence[str]:
        rows = await session.scalars(
            select(HealthRun.id)
            # Acceptance runs belong to the node reconciler that made them.
            .where(
                HealthRun.state.in_(("pending", "running")),
                HealthRun.requested_by.is_distinct_from(ACCEPTANCE),
            )
            .order_by(HealthRun.created_at)
        )
        return list(rows)

    async def _finish(self, row_id: str, token: str, outcome: dict[str, Any]) -> None:
        async with self.ctx.sessionmaker() as session:
            await leases.fence(session, HealthRun, row_id, token=token, ttl_s=self.ctx.lease_ttl_s)
            record_outcome(await session.get_one(HealthRun, row_id), outcome)
            await session.commit()

    async def reconcile(self, row_id: str, token: str) -> bool:
        async with self.ctx.sessionmaker() as session:
            run = await session.get_one(HealthRun, row_id)
            node = await session.get(Node, run.node_id)
            cluster = await session.get_one(Cluster, run.cluster_id)
            host = await session.get(Host, node.host_id) if node and node.host_id else None
            cref = await load_cluster_ref(session, cluster, self.rt)
            await leases.fence(session, HealthRun, row_id, token=token, ttl_s=self.ctx.lease_ttl_s)
            run.state, run.started_at = "running", utcnow()
            await session.commit()
        access = self.rt.node_access
        if node is None or node.deleted_at is not None:
            await self._finish(row_id, token, {"state": "skipped", "reason": "the node is gone"})
            return True
        if access is None:
            await self._finish(
                row_id, token, {"state": "skipped", "reason": "no shell on this provider's nodes"}
            )
            return True
        layer = self.rt.layer_for(cluster.cluster_type)
        nref = node_ref(node, host)
        outcome = await run_check_on_node(
            self.rt,
            node.id,
            run.check,
            duration_s=run.duration_s,
            gpu_type=cluster.gpu_type,
            layer=layer,
            cref=cref,
            nref=nref,
        )
        await self._finish(row_id, token, outcome)
        return True
