"""Slurm clusters run Kubernetes too: every GPU node is a Slurm compute node
*and* a kubelet node, so a user can ``sbatch`` and ``kubectl apply`` on the
same cluster (operators, Kueue, webhooks on the Kubernetes side; batch jobs
on the Slurm side).

This layer runs the two layers side by side. Control planes come up
concurrently (they live on different service nodes); a node has joined once
both orchestrators list it; cordon, drain and removal go to both (a node is
empty only when neither has work on it); a drain a user set in either
counts as a user's cordon. Configuration (slurm.conf extras, prolog,
epilog) is Slurm's, users' RBAC is reconciled on both; credentials are
Kubernetes'.

Both orchestrators see all of the node's 8 GPUs: this layer does not
partition them. Work placed by both at once on one node shares its GPUs,
as on any cluster where two schedulers manage the same machines; a site
that mixes them keeps them apart with a Slurm partition or a node label.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

from gpuclusters.core.autoscale import ScaleSignals
from gpuclusters.core.nodeshell import CommandResult
from gpuclusters.layers.base import ClusterLayer, ClusterRef, NodeRef
from gpuclusters.layers.kubernetes.layer import KubernetesLayer
from gpuclusters.layers.slurm.layer import SlurmLayer


class SlurmAndKubernetesLayer(ClusterLayer):
    def __init__(self, slurm: SlurmLayer, kubernetes: KubernetesLayer) -> None:
        self.slurm = slurm
        self.kubernetes = kubernetes

    def waiting_for_builds(self) -> str | None:
        return self.slurm.waiting_for_builds() or self.kubernetes.waiting_for_builds()

    async def ensure_control_plane(self, cluster: ClusterRef) -> bool:
        done = await asyncio.gather(
            self.slurm.ensure_control_plane(cluster),
            self.kubernetes.ensure_control_plane(cluster),
        )
        return all(done)

    async def join_node(self, cluster: ClusterRef, node: NodeRef) -> bool:
        # Slurm's node-local part first: /home on the shared volume, then the
        # members' accounts, whose homes must land there (the Kubernetes join
        # makes accounts too, and finds them made). Then both joins at once:
        # each waits for its own control plane, which start side by side.
        await self.slurm.prepare_node(cluster, node)
        results = await asyncio.gather(
            self.slurm.join_node(cluster, node),
            self.kubernetes.join_node(cluster, node),
            return_exceptions=True,  # a failed half is raised once the other is done
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return all(results)

    async def cordon(self, cluster: ClusterRef, node: NodeRef, *, reason: str) -> None:
        await asyncio.gather(
            self.slurm.cordon(cluster, node, reason=reason),
            self.kubernetes.cordon(cluster, node, reason=reason),
        )

    async def drain(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        empty = await asyncio.gather(
            self.slurm.drain(cluster, node, reason=reason, deadline=deadline),
            self.kubernetes.drain(cluster, node, reason=reason, deadline=deadline),
        )
        return all(empty)

    async def uncordon(self, cluster: ClusterRef, node: NodeRef) -> None:
        await asyncio.gather(
            self.slurm.uncordon(cluster, node), self.kubernetes.uncordon(cluster, node)
        )

    async def run_exclusive(
        self, cluster: ClusterRef, node: NodeRef, argv: list[str], *, timeout_s: float
    ) -> CommandResult | None:
        # Slurm queues it behind users' batch work (Kubernetes pods on the
        # node are not waited for: a site mixing both keeps them apart).
        return await self.slurm.run_exclusive(cluster, node, argv, timeout_s=timeout_s)

    async def scale_signals(self, cluster: ClusterRef) -> ScaleSignals | None:
        # Slurm's power saving decides; a node's pods still keep it (the
        # autoscaler asks running_work, which counts both).
        return await self.slurm.scale_signals(cluster)

    async def running_work(self, cluster: ClusterRef, node: NodeRef) -> int:
        counts = await asyncio.gather(
            self.slurm.running_work(cluster, node), self.kubernetes.running_work(cluster, node)
        )
        return sum(counts)

    async def preempt(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> None:
        await asyncio.gather(
            self.slurm.preempt(cluster, node, reason=reason, deadline=deadline),
            self.kubernetes.preempt(cluster, node, reason=reason, deadline=deadline),
        )

    async def preemption_done(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        empty = await asyncio.gather(
            self.slurm.preemption_done(cluster, node, reason=reason, deadline=deadline),
            self.kubernetes.preemption_done(cluster, node, reason=reason, deadline=deadline),
        )
        return all(empty)

    async def is_cordoned(self, cluster: ClusterRef, node: NodeRef) -> bool:
        if await self.slurm.is_cordoned(cluster, node):
            return True
        return await self.kubernetes.is_cordoned(cluster, node)

    async def remove_node(self, cluster: ClusterRef, node: NodeRef) -> None:
        await self.kubernetes.remove_node(cluster, node)
        await self.slurm.remove_node(cluster, node)

    async def delete(self, cluster: ClusterRef) -> None:
        # Both layers' service nodes belong to the cluster: one call removes all.
        await self.slurm.delete(cluster)

    async def apply_config(self, cluster: ClusterRef) -> None:
        await asyncio.gather(
            self.slurm.apply_config(cluster), self.kubernetes.apply_config(cluster)
        )

    async def gateway_targets(self, cluster: ClusterRef) -> dict[str, tuple[str, int]]:
        ssh, kubernetes = await asyncio.gather(
            self.slurm.gateway_targets(cluster), self.kubernetes.gateway_targets(cluster)
        )
        return {**kubernetes, **ssh}

    async def sync_access(self, cluster: ClusterRef) -> None:
        await asyncio.gather(self.slurm.sync_access(cluster), self.kubernetes.sync_access(cluster))

    async def credentials(
        self, cluster: ClusterRef, *, user: str, admin: bool, project: str = ""
    ) -> str:
        return await self.kubernetes.credentials(cluster, user=user, admin=admin, project=project)
