"""The Kubernetes layer: a real Kubernetes control plane and kubelet nodes.

Per cluster: a *control-plane* service node (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, the cluster's PKI, and the
add-ons CoreDNS and metrics-server as daemons: ``addons``), and on every
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
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from gpuclusters.builds import status as build_status
from gpuclusters.core import kubeconfig
from gpuclusters.core.autoscale import ScaleSignals
from gpuclusters.core.builds import CLUSTER_ADDONS, still_building, waiting_message
from gpuclusters.core.errors import InvalidStateError
from gpuclusters.core.nodeshell import CommandResult, NodeAccess, NodeShell
from gpuclusters.layers.accounts import ensure_accounts
from gpuclusters.layers.base import ClusterLayer, ClusterRef, LayerError, NodeRef
from gpuclusters.layers.kubernetes import addons, exclusive, images, pki, preemption, stack
from gpuclusters.layers.kubernetes import config as cfg
from gpuclusters.layers.kubernetes.api import KubeAPI
from gpuclusters.layers.waiting import poll_until

log = logging.getLogger(__name__)

CONTROL_PLANE = "control-plane"
NODE_FILE = "/etc/gpuclusters/node.json"
GPUS_PER_NODE = 8
USER_CERT_DAYS = 365
# How long a node's join waits for the apiserver before handing its step
# back (it is asked again); the node-local part is done by then.
API_WAIT_S = 20.0
API_POLL_S = 0.1


def default_addons_bin_dir() -> Path:
    """Where ``scripts/build-k8s-addons`` puts the add-ons' binaries
    (``GPUCLUSTERS_ADDONS_CACHE`` moves its cache, as for the script)."""
    cache = os.environ.get("GPUCLUSTERS_ADDONS_CACHE")
    return Path(cache) / "bin" if cache else addons.DEFAULT_BIN_DIR


class KubernetesLayer(ClusterLayer):
    def __init__(
        self,
        access: NodeAccess,
        *,
        bin_dir: Path = cfg.DEFAULT_BIN_DIR,
        addons_bin_dir: Path | None = None,
    ) -> None:
        self.access = access
        self.bin_dir = bin_dir
        self.addons_bin_dir = addons_bin_dir or default_addons_bin_dir()
        self._apis: dict[str, KubeAPI] = {}
        self._missing_addons_logged: set[str] = set()

    # -- shells and shared pieces ---------------------------------------------

    async def _control_plane(self, cluster: ClusterRef) -> NodeShell:
        return await self.access.ensure_service_node(
            cluster_id=cluster.cluster_id,
            cluster_name=cluster.name,
            role=CONTROL_PLANE,
            volume_id=cluster.volume_id,
            host_ids=cluster.host_ids,
        )

    def _spec(self, cluster: ClusterRef, cp: NodeShell) -> cfg.K8sSpec:
        return cfg.K8sSpec(
            cluster_name=cluster.name,
            api_address=cp.address,
            api_hostname=cp.hostname,
            bin_dir=str(self.bin_dir),
            public_names=(cluster.gateway.host,) if cluster.gateway else (),
            registry=cluster.registry,
            token_issuer=cluster.token_issuer,
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

    def waiting_for_builds(self) -> str | None:
        """CoreDNS and metrics-server, while the background builder has them
        to build: a cluster started without them would lack them for good
        (the add-ons start with the control plane). Missing with no builder
        at work, they are left out as before (``_addon_installed``)."""
        missing = [n for n in CLUSTER_ADDONS if not (self.addons_bin_dir / n).is_file()]
        if not missing:
            return None
        observed = build_status.read()
        if observed is None:
            return None
        waiting = still_building(observed.status, missing, alive=observed.alive)
        return waiting_message(observed.status, waiting) if waiting else None

    def _addon_installed(self, name: str) -> bool:
        """Whether an add-on's binary is there. A missing one is left out
        (logged once): the cluster works without it, as before add-ons."""
        if (self.addons_bin_dir / name).is_file():
            return True
        if name not in self._missing_addons_logged:
            self._missing_addons_logged.add(name)
            log.warning(
                "%s is not installed in %s: clusters run without it (run scripts/build-k8s-addons)",
                name,
                self.addons_bin_dir,
            )
        return False

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
            in_userns=bool(info.get("userns")),
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

    # -- the API client ------------------------------------------------------

    async def _api(self, cluster: ClusterRef, cp: NodeShell) -> KubeAPI | None:
        """The cluster's admin API client (cached; remade when the control
        plane's address or CA changed), or None before the control-plane
        step issued the admin certificate."""
        spec = self._spec(cluster, cp)
        ca = await cp.read_file(stack.CA_CERT)
        cached = self._apis.get(cluster.cluster_id)
        if cached is not None:
            if ca is not None and cached.ca_pem == ca and cached.server == spec.server:
                return cached
            del self._apis[cluster.cluster_id]
            await cached.close()
        if ca is None:
            return None
        api = await stack.admin_api(cp, spec)
        if api is not None:
            self._apis[cluster.cluster_id] = api
        return api

    async def _required_api(self, cluster: ClusterRef, cp: NodeShell) -> KubeAPI:
        api = await self._api(cluster, cp)
        if api is None:
            raise LayerError(
                f"cluster {cluster.name}: its Kubernetes control plane has no admin certificate yet"
            )
        return api

    async def _wait_api(
        self, cluster: ClusterRef, cp: NodeShell, *, timeout_s: float
    ) -> KubeAPI | None:
        """The API once ``/readyz`` answers, or None after ``timeout_s``."""
        api: KubeAPI | None = None

        async def ready() -> KubeAPI | None:
            nonlocal api
            if api is None:
                api = await self._api(cluster, cp)
            return api if api is not None and await api.ready() else None

        return await poll_until(ready, timeout_s=timeout_s, max_delay_s=API_POLL_S)

    async def _cluster_api(self, cluster: ClusterRef) -> KubeAPI | None:
        """``_api`` for steps that need nothing else of the control plane."""
        return await self._api(cluster, await self._control_plane(cluster))

    # -- contract -------------------------------------------------------------

    async def ensure_control_plane(self, cluster: ClusterRef) -> bool:
        self._check_binaries()
        loop = asyncio.get_running_loop()
        marks = [("start", loop.time())]
        cp = await self._control_plane(cluster)
        spec = self._spec(cluster, cp)
        changed = await stack.start_control_plane(cp, spec)
        marks.append(("pki+etcd+apiserver", loop.time()))
        api = await self._required_api(cluster, cp)
        ca = await stack.read_ca(cp)
        if ca is None:
            raise LayerError(f"cluster {cluster.name}: the control plane's CA is missing")
        # The add-ons' files need only the CA: written while the apiserver starts.
        plan, _ = await asyncio.gather(
            stack.prepare_addons(
                cp,
                spec,
                ca,
                coredns=self._addon_installed("coredns"),
                metrics_server=self._addon_installed("metrics-server"),
            ),
            stack.wait_ready(api),
        )
        marks.append(("readyz", loop.time()))
        capacity_gib = 1024  # nominal: a hostPath PV does not enforce it
        objs = cfg.storage_manifests(
            shared_volume=cluster.volume_id is not None, shared_capacity_gib=capacity_gib
        )
        claims = [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
        # The volume first, the claim once the PV binder has made the volume
        # Available: a claim synced while the binder's volume worker still
        # updates the volume loses the write race (409) and waits for the
        # next resync; in this order the binding takes one pass.
        await api.apply([o for o in objs if o["kind"] != "PersistentVolumeClaim"])
        await stack.start_controllers(cp, spec, changed=changed)
        marks.append(("controllers", loop.time()))

        async def bind_claims() -> None:
            if claims:
                await stack.wait_volume_settled(api, cfg.SHARED_PV)
                await api.apply(claims)
                await stack.wait_bound(api, cfg.SHARED_PVC)
                marks.append(("bound", loop.time()))

        async def start_addons() -> None:
            bins = addons.AddonBins(str(self.addons_bin_dir))
            await stack.start_addons(cp, api, spec, bins, plan, ca_pem=ca.cert, changed=changed)
            marks.append(("addons", loop.time()))

        # Independent: the claim waits for the PV binder, the add-ons' few
        # objects and daemons need nothing of it.
        await asyncio.gather(bind_claims(), start_addons())
        await stack.reconcile_rbac(cp, spec, [(u.name, u.admin) for u in cluster.users])
        marks.append(("rbac", loop.time()))
        log.info(
            "Kubernetes control plane of %s up: %s",
            cluster.name,
            ", ".join(f"{m} +{t - marks[0][1]:.2f}s" for m, t in marks[1:]),
        )
        return True

    async def join_node(self, cluster: ClusterRef, node: NodeRef) -> bool:
        self._check_binaries()
        cp = await self._control_plane(cluster)
        spec = self._spec(cluster, cp)
        ca = await stack.read_ca(cp)
        if ca is None:
            return False  # the control-plane step has not made the CA yet; asked again later
        shell = await self.access.shell(node.node_id)
        await ensure_accounts(shell, cluster.users)  # `clusters ssh` lands as the user
        knode = await self._knode(cluster, node, shell)
        await self._route_pods(cp, cluster, node, shell)
        # What needs only the CA is done while the apiserver still starts.
        await stack.prepare_node(shell, spec, knode, ca=ca, images=self._images())
        api = await self._wait_api(cluster, cp, timeout_s=API_WAIT_S)
        if api is None:
            return False  # the control plane is still coming up; asked again later
        await stack.start_node(api, shell, spec, knode, gpus=GPUS_PER_NODE)
        nvme_gib = int((await self._node_info(shell)).get("nvme_gib", 0))
        if nvme_gib:
            await api.apply([cfg.local_pv_manifest(node.name, nvme_gib)])
        return True

    async def cordon(self, cluster: ClusterRef, node: NodeRef, *, reason: str) -> None:
        api = await self._cluster_api(cluster)
        if api is not None:
            await stack.cordon(api, node.name, reason=reason)

    async def drain(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        cp = await self._control_plane(cluster)
        api = await self._api(cluster, cp)
        if api is None:
            return True  # no Kubernetes yet: nothing runs there
        return await stack.drain(cp, self._spec(cluster, cp), api, node.name, reason=reason)

    async def uncordon(self, cluster: ClusterRef, node: NodeRef) -> None:
        api = await self._cluster_api(cluster)
        if api is not None:
            await stack.uncordon(api, node.name)

    async def run_exclusive(
        self, cluster: ClusterRef, node: NodeRef, argv: list[str], *, timeout_s: float
    ) -> CommandResult | None:
        cp = await self._control_plane(cluster)
        api = await self._required_api(cluster, cp)
        shell = await self.access.shell(node.node_id)

        async def run() -> CommandResult:
            return await shell.run(argv, check=False, timeout_s=timeout_s)

        return await exclusive.run_exclusive(api, node.name, run, timeout_s=timeout_s)

    async def scale_signals(self, cluster: ClusterRef) -> ScaleSignals | None:
        """The GPU pods the scheduler cannot place (docs/autoscaling.md):
        the control plane adds nodes for them, and releases nodes idle past
        the cluster's idle time."""
        if cluster.autoscale is None:
            return None
        api = await self._cluster_api(cluster)
        if api is None:
            return None
        pods = await api.list_items("/api/v1/pods", fieldSelector="status.phase=Pending")
        waiting = stack.unschedulable_gpu_pods(pods)
        return ScaleSignals(
            pending_jobs=tuple(name for name, _ in waiting),
            pending_gpus=tuple(gpus for _, gpus in waiting),
            by_pods=True,
        )

    async def running_work(self, cluster: ClusterRef, node: NodeRef) -> int:
        api = await self._cluster_api(cluster)
        return 0 if api is None else await preemption.running_work(api, node.name)

    async def preempt(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> None:
        cp = await self._control_plane(cluster)
        api = await self._api(cluster, cp)
        if api is not None:
            spec = self._spec(cluster, cp)
            await preemption.preempt(cp, spec, api, node.name, reason=reason, deadline=deadline)

    async def preemption_done(
        self, cluster: ClusterRef, node: NodeRef, *, reason: str, deadline: datetime
    ) -> bool:
        api = await self._cluster_api(cluster)
        if api is None:
            return True
        return await preemption.preemption_done(api, node.name, deadline=deadline)

    async def is_cordoned(self, cluster: ClusterRef, node: NodeRef) -> bool:
        api = await self._cluster_api(cluster)
        return api is not None and await stack.is_cordoned_by_user(api, node.name)

    async def remove_node(self, cluster: ClusterRef, node: NodeRef) -> None:
        cp = await self._control_plane(cluster)
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
        api = await self._api(cluster, cp)
        if api is not None:
            await stack.delete_node_object(api, node.name)

    async def delete(self, cluster: ClusterRef) -> None:
        api = self._apis.pop(cluster.cluster_id, None)
        if api is not None:
            await api.close()
        await self.access.delete_service_nodes(cluster_id=cluster.cluster_id)

    async def apply_config(self, cluster: ClusterRef) -> None:
        cp = await self._control_plane(cluster)
        await stack.reconcile_rbac(
            cp, self._spec(cluster, cp), [(u.name, u.admin) for u in cluster.users]
        )

    async def gateway_targets(self, cluster: ClusterRef) -> dict[str, tuple[str, int]]:
        cp = await self._control_plane(cluster)
        return {"kubernetes": (cp.address, cfg.API_PORT)}

    async def sync_access(self, cluster: ClusterRef) -> None:
        """Kubernetes access follows the member list: current members'
        bindings are reconciled (a role change applies), and the bindings of
        removed members and deleted users are deleted, so the client
        certificates they were issued (valid until they expire) are
        authorized for nothing from then on."""
        cp = await self._control_plane(cluster)
        spec = self._spec(cluster, cp)
        api = await self._api(cluster, cp)
        if api is None or not await api.ready():
            raise LayerError(f"cluster {cluster.name}: Kubernetes is not up yet")
        bindings = await api.list_items(cfg.CLUSTER_ROLE_BINDINGS, labelSelector=cfg.MANAGED_LABEL)
        for name in cfg.stale_user_bindings(bindings, {u.name for u in cluster.users}):
            await api.delete(f"{cfg.CLUSTER_ROLE_BINDINGS}/{name}")
            log.info("cluster %s: removed %s (no longer a member)", cluster.name, name)
        members = [(u.name, u.admin) for u in cluster.users]
        have = {str(b.get("metadata", {}).get("name", "")) for b in bindings}
        # Only members who already had Kubernetes access (fetched credentials).
        await stack.reconcile_rbac(
            cp, spec, [(n, a) for n, a in members if cfg.user_binding_name(n) in have]
        )

    async def credentials(
        self, cluster: ClusterRef, *, user: str, admin: bool, project: str = ""
    ) -> str:
        """A kubeconfig for ``user``, whose RBAC binding (cluster-admin or
        edit) is made first. Where the server signs users' tokens its user
        runs the CLI as an exec credential plugin (a token of minutes per
        kubectl run; docs/identity.md); elsewhere it holds a client
        certificate (CN = the user name)."""
        cp = await self._control_plane(cluster)
        spec = self._spec(cluster, cp)
        ca = await stack.read_ca(cp)
        api = await self._api(cluster, cp)
        if ca is None or api is None or not await api.ready():
            raise InvalidStateError(f"cluster {cluster.name}: Kubernetes is not up yet")
        await stack.reconcile_rbac(cp, spec, [(user, admin)])
        # The gateway's endpoint, reachable from users' machines; the node
        # address only where there is no gateway.
        server = (cluster.gateway and cluster.gateway.kubernetes_url) or spec.server
        if spec.token_issuer is not None and project:
            await stack.ensure_token_authentication(cp, spec, api)
            config = kubeconfig.render(
                cluster_name=cluster.name,
                server=server,
                ca_pem=ca.cert,
                user_name=user,
                exec_credential=kubeconfig.exec_user(
                    project=project, cluster=cluster.name, user=user
                ),
            )
            return kubeconfig.dump(config)
        pair = pki.issue(
            ca, user, organizations=["gpuclusters:users"], client=True, days=USER_CERT_DAYS
        )
        config = kubeconfig.render(
            cluster_name=cluster.name,
            server=server,
            ca_pem=ca.cert,
            user_name=user,
            client_cert_pem=pair.cert,
            client_key_pem=pair.key,
        )
        return kubeconfig.dump(config)
