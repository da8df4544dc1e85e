"""The Kubernetes layer: a real Kubernetes control plane and kubelet nodes.

Per cluster: a *control-plane* service node (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, the cluster's PKI), and on every
GPU node containerd + runc, kubelet (its own cgroup root), CNI and
kube-proxy; the node agent's device plugin advertises ``nvidia.com/gpu``.
Pod CIDRs are routed between all of the cluster's members (``config``).

The CA key stays on the control-plane node (like kubeadm's); the layer
reads it to sign node certificates and users' client certificates, so the
control plane's database never holds it.

The steps live in ``stack``; this module only decides which shells they run
on, from the ``ClusterRef`` the control plane passes in.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

from gpuclusters.core import kubeconfig
from gpuclusters.core.errors import InvalidStateError
from gpuclusters.core.nodeshell import CommandResult, NodeAccess, NodeShell
from gpuclusters.layers.accounts import ensure_accounts
from gpuclusters.layers.base import ClusterLayer, ClusterRef, LayerError, NodeRef
from gpuclusters.layers.kubernetes import config as cfg
from gpuclusters.layers.kubernetes import exclusive, images, pki, preemption, stack

log = logging.getLogger(__name__)

CONTROL_PLANE = "control-plane"
NODE_FILE = "/etc/gpuclusters/node.json"
GPUS_PER_NODE = 8
USER_CERT_DAYS = 365


class KubernetesLayer(ClusterLayer):
    def __init__(self, access: NodeAccess, *, bin_dir: Path = cfg.DEFAULT_BIN_DIR) -> None:
        self.access = access
        self.bin_dir = bin_dir

    # -- shells and shared pieces ---------------------------------------------

    async def _control_plane(self, cluster: ClusterRef) -> NodeShell:
        return await self.access.ensure_service_node(
            cluster_id=cluster.cluster_id,
            cluster_name=cluster.name,
            role=CONTROL_PLANE,
            volume_id=cluster.volume_id,
        )

    def _spec(self, cluster: ClusterRef, cp: NodeShell) -> cfg.K8sSpec:
        return cfg.K8sSpec(
            cluster_name=cluster.name,
            api_address=cp.address,
            api_hostname=cp.hostname,
            bin_dir=str(self.bin_dir),
        )

    def _check_binaries(self) -> None:
        missing = [
            n
            for n in ("etcd", "kube-apiserver", "kubelet", "kube-proxy", "kubectl", "pause")
            if not (self.bin_dir / n).is_file()
        ]
        if missing:
            raise LayerError(
                f"Kubernetes binaries missing in {self.bin_dir}: {', '.join(missing)} "
                "(run scripts/build-k8s, or set GPUCLUSTERS_K8S_BIN)"
            )

    def _images(self) -> list[images.Image]:
        return [
            images.pause_image(self.bin_dir / "pause", f"v{cfg.K8S_VERSION}"),
            images.base_image(),
        ]

    async def _node_info(self, shell: NodeShell) -> dict[str, Any]:
        raw = await shell.read_file(NODE_FILE)
        info: dict[str, Any] = json.loads(raw) if raw else {}
        return info

    async def _knode(self, cluster: ClusterRef, node: NodeRef, shell: NodeShell) -> cfg.K8sNode:
        info = await self._node_info(shell)
        cgroup_root = info.get("cgroup_root")
        if not cgroup_root:
            raise LayerError(f"node {node.name} has no cgroup root in {NODE_FILE}")
        return cfg.K8sNode(
            name=node.name,
            address=shell.address,
            cgroup_root=str(cgroup_root),
            labels=cfg.node_labels(
                compute_class=node.compute_class,
                gpu_type=cluster.gpu_type,
                ib_island=info.get("ib_island"),
            ),
        )

    async def _members(self, cluster: ClusterRef) -> list[tuple[NodeRef, NodeShell]]:
        out = []
        for n in cluster.nodes:
            try:
                out.append((n, await self.access.shell(n.node_id)))
            except Exception as exc:  # a node being rebuilt or deleted: routed later
                log.debug("node %s has no shell now: %s", n.name, exc)
        return out

    async def _route_pods(
        self, cp: NodeShell, cluster: ClusterRef, node: NodeRef, shell: NodeShell
    ) -> None:
        """This node's pod CIDR on every other member, theirs on this node."""
        peers = [(n, s) for n, s in await self._members(cluster) if n.node_id != node.node_id]
        routes = {cfg.pod_cidr_for(s.address): s.address for _, s in peers}
        await stack.ensure_routes(shell, routes)
        mine = {cfg.pod_cidr_for(shell.address): shell.address}
        for peer in [cp, *(s for _, s in peers)]:
            try:
                await stack.ensure_routes(peer, mine)
            except Exception as exc:  # the peer is going away; its join re-adds routes
                log.info("route to %s on %s not set: %s", node.name, peer.hostname, exc)

    # -- contract -------------------------------------------------------------

    async def ensure_control_plane(self, cluster: ClusterRef) -> bool:
        self._check_binaries()
        cp = await self._control_plane(cluster)
        spec = self._spec(cluster, cp)
        await stack.start_control_plane(cp, spec)
        capacity_gib = 1024  # nominal: a hostPath PV does not enforce it
        await stack.apply(
            cp,
            spec,
            cfg.storage_manifests(
                shared_volume=cluster.volume_id is not None, shared_capacity_gib=capacity_gib
            ),
        )
        if cluster.volume_id is not None:
            await stack.wait_bound(cp, spec, cfg.SHARED_PVC)
        await stack.reconcile_rbac(cp, spec, [(u.name, u.admin) for u in cluster.users])
        return True

    async def join_node(self, cluster: ClusterRef, node: NodeRef) -> bool:
        self._check_binaries()
        cp = await self._control_plane(cluster)
        spec = self._spec(cluster, cp)
        ca = await stack.read_ca(cp)
        if ca is None or not await stack.apiserver_ready(cp, spec):
            return False  # the control plane is still coming up; asked again later
        shell = await self.access.shell(node.node_id)
        await ensure_accounts(shell, cluster.users)  # `clusters ssh` lands as the user
        knode = await self._knode(cluster, node, shell)
        await self._route_pods(cp, cluster, node, shell)
        await stack.join_node(
            cp, shell, spec, knode, ca=ca, images=self._images(), gpus=GPUS_PER_NODE
        )
        nvme_gib = int((await self._node_info(shell)).get("nvme_gib", 0))
        if nvme_gib:
            await stack.apply(cp, spec, [cfg.local_pv_manifest(node.name, nvme_gib)])
        return True

    async def cordon(self, cluster: ClusterRef, node: NodeRef, *, reason: str) -> None:
        cp = await self._control_plane(cluster)
        await stack.cordon(cp, self._spec(cluster, cp), node.name, reason=reason)

    async def drain(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        cp = await self._control_plane(cluster)
        return await stack.drain(cp, self._spec(cluster, cp), node.name, reason=reason)

    async def uncordon(self, cluster: ClusterRef, node: NodeRef) -> None:
        cp = await self._control_plane(cluster)
        await stack.uncordon(cp, self._spec(cluster, cp), node.name)

    async def run_exclusive(
        self, cluster: ClusterRef, node: NodeRef, argv: list[str], *, timeout_s: float
    ) -> CommandResult | None:
        cp = await self._control_plane(cluster)
        shell = await self.access.shell(node.node_id)

        async def run() -> CommandResult:
            return await shell.run(argv, check=False, timeout_s=timeout_s)

        return await exclusive.run_exclusive(
            cp, self._spec(cluster, cp), node.name, run, timeout_s=timeout_s
        )

    async def running_work(self, cluster: ClusterRef, node: NodeRef) -> int:
        cp = await self._control_plane(cluster)
        return await preemption.running_work(cp, self._spec(cluster, cp), node.name)

    async def preempt(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> None:
        cp = await self._control_plane(cluster)
        spec = self._spec(cluster, cp)
        await preemption.preempt(cp, spec, node.name, reason=reason, deadline=deadline)

    async def preemption_done(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        cp = await self._control_plane(cluster)
        spec = self._spec(cluster, cp)
        return await preemption.preemption_done(cp, spec, node.name, deadline=deadline)

    async def is_cordoned(self, cluster: ClusterRef, node: NodeRef) -> bool:
        cp = await self._control_plane(cluster)
        return await stack.is_cordoned_by_user(cp, self._spec(cluster, cp), node.name)

    async def remove_node(self, cluster: ClusterRef, node: NodeRef) -> None:
        cp = await self._control_plane(cluster)
        spec = self._spec(cluster, cp)
        shell: NodeShell | None
        try:
            shell = await self.access.shell(node.node_id)
        except Exception:  # already gone: only the API objects and routes remain
            shell = None
        if shell is not None:
            await stack.stop_node(shell)
            cidr = cfg.pod_cidr_for(shell.address)
            peers = [s for n, s in await self._members(cluster) if n.node_id != node.node_id]
            await asyncio.gather(
                *(stack.remove_routes(p, [cidr]) for p in [cp, *peers]), return_exceptions=True
            )
        await stack.delete_node_object(cp, spec, node.name)

    async def delete(self, cluster: ClusterRef) -> None:
        await self.access.delete_service_nodes(cluster_id=cluster.cluster_id)

    async def apply_config(self, cluster: ClusterRef) -> None:
        cp = await self._control_plane(cluster)
        await stack.reconcile_rbac(
            cp, self._spec(cluster, cp), [(u.name, u.admin) for u in cluster.users]
        )

    async def credentials(self, cluster: ClusterRef, *, user: str, admin: bool) -> str:
        """A kubeconfig with a client certificate for ``user`` (CN = the user
        name), whose RBAC binding (cluster-admin or edit) is made first."""
        cp = await self._control_plane(cluster)
        spec = self._spec(cluster, cp)
        ca = await stack.read_ca(cp)
        if ca is None or not await stack.apiserver_ready(cp, spec):
            raise InvalidStateError(f"cluster {cluster.name}: Kubernetes is not up yet")
        await stack.reconcile_rbac(cp, spec, [(user, admin)])
        pair = pki.issue(
            ca, user, organizations=["gpuclusters:users"], client=True, days=USER_CERT_DAYS
        )
        config = kubeconfig.render(
            cluster_name=cluster.name,
            server=spec.server,
            ca_pem=ca.cert,
            user_name=user,
            client_cert_pem=pair.cert,
            client_key_pem=pair.key,
        )
        return kubeconfig.dump(config)
