"""Bringing Kubernetes up and down through ``NodeShell``; the steps, not the policy.

Each function is one idempotent step the layer may repeat after a crash:
files are written only when their content differs (``write_file`` says
whether it changed anything), daemons are spawned by name (a running one
is left alone, or restarted when a file it reads only at start changed),
certificates are issued only when missing, and every wait polls a real
signal (``/readyz``, ``ctr version``, the Node's ``Ready`` condition and
its allocatable GPUs) with a short backoff; there are no fixed sleeps.

Order on the control-plane node: PKI (the front proxy's CA and client
certificate among it) -> etcd -> kube-apiserver (``/readyz``; meanwhile the
add-ons' certificates and Corefile) -> storage classes and the shared
volume's PV -> controller-manager + scheduler -> the shared volume's claim,
once the PV binder has seen its volume, and, side by side, the add-ons'
RBAC, Services and EndpointSlices -> CoreDNS and metrics-server -> the
metrics APIService -> users' RBAC bindings. (The controller-manager cannot
start with the apiserver: it exits when the apiserver's RBAC is not
bootstrapped yet.)

Order on a GPU node: kernel settings of the node's own network namespace
(forwarding, bridge netfilter) and the kubelet sysctl shadows -> node
certificates -> containerd -> images -> CNI file -> kubelet -> kube-proxy
-> wait Ready with ``nvidia.com/gpu`` allocatable (the node agent's device
plugin registers with the kubelet).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from gpuclusters.core.nodeshell import NodeShell
from gpuclusters.layers.base import LayerError
from gpuclusters.layers.kubernetes import addons, pki
from gpuclusters.layers.kubernetes import config as cfg
from gpuclusters.layers.kubernetes.api import KubeAPI, NotFound
from gpuclusters.layers.kubernetes.images import Image
from gpuclusters.layers.waiting import ok, wait_for

log = logging.getLogger(__name__)

CA_CERT = cfg.pki_path("ca.crt")
CA_KEY = cfg.pki_path("ca.key")


# --- PKI ----------------------------------------------------------------------------------


async def read_ca(cp: NodeShell) -> pki.KeyPair | None:
    cert, key = await cp.read_file(CA_CERT), await cp.read_file(CA_KEY)
    return pki.KeyPair(cert=cert, key=key) if cert and key else None


async def ensure_ca(cp: NodeShell, cluster_name: str) -> pki.KeyPair:
    """The cluster's CA, made once and kept on the control-plane node (like
    kubeadm's /etc/kubernetes/pki). Only the control-plane step creates it,
    so two steps running at once can never make two CAs."""
    return await _ensure_ca_at(cp, "ca", f"gpuclusters {cluster_name} CA")


async def _ensure_ca_at(cp: NodeShell, name: str, common_name: str) -> pki.KeyPair:
    """The CA ``<pki>/<name>.crt`` + ``.key``, made if either is missing."""
    crt, key = cfg.pki_path(f"{name}.crt"), cfg.pki_path(f"{name}.key")
    have_cert, have_key = await cp.read_file(crt), await cp.read_file(key)
    if have_cert and have_key:
        return pki.KeyPair(cert=have_cert, key=have_key)
    ca = pki.new_ca(common_name)
    # Key first: a crash between the two writes leaves no certificate, and
    # the next attempt makes a new pair.
    await cp.write_file(key, ca.key, mode=0o600)
    await cp.write_file(crt, ca.cert)
    return ca


def _issued_by(cert_pem: bytes, ca_pem: bytes) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


async def _ensure_pair(
    shell: NodeShell,
    ca: pki.KeyPair,
    name: str,
    common_name: str,
    *,
    organizations: Sequence[str] = (),
    dns_names: Sequence[str] = (),
    ip_addresses: Sequence[str] = (),
    client: bool = False,
    server: bool = False,
) -> bool:
    """``<pki>/<name>.crt`` + ``.key`` signed by ``ca``; (re)issued when
    missing, signed by another CA, missing a wanted name (the gateway's
    public host changed) or about to expire. True if issued."""
    crt, key = cfg.pki_path(f"{name}.crt"), cfg.pki_path(f"{name}.key")
    have = await shell.read_file(crt)
    if (
        have is not None
        and await shell.read_file(key) is not None
        and _issued_by(have, ca.cert)
        and pki.cert_subject(have) == (common_name, tuple(organizations))
        and pki.cert_sans(have) >= {*dns_names, *ip_addresses}
        and not pki.cert_expires_within(have, 7 * 86400)
    ):
        return False
    pair = pki.issue(
        ca,
        common_name,
        organizations=organizations,
        dns_names=dns_names,
        ip_addresses=ip_addresses,
        client=client,
        server=server,
    )
    await shell.write_file(key, pair.key, mode=0o600)
    await shell.write_file(crt, pair.cert)
    return True


async def _write_text(shell: NodeShell, path: str, text: str, *, mode: int = 0o644) -> bool:
    return await shell.write_file(path, text.encode(), mode=mode)


async def _kubeconfig(
    shell: NodeShell, spec: cfg.K8sSpec, name: str, *, user: str, pair: str
) -> bool:
    text = cfg.component_kubeconfig(
        spec,
        user=user,
        cert=cfg.pki_path(f"{pair}.crt"),
        key=cfg.pki_path(f"{pair}.key"),
    )
    return await _write_text(shell, f"{cfg.ETC}/{name}.conf", text, mode=0o600)


async def _respawn(shell: NodeShell, name: str, argv: Sequence[str], changed: bool) -> None:
    if changed and await shell.is_running(name):
        log.info("%s: restarting %s (its configuration changed)", shell.hostname, name)
        await shell.stop(name, timeout_s=30.0)
    await shell.spawn(name, argv)


# --- control plane ----------------------------------------------------------------------------


async def kubectl(
    cp: NodeShell,
    spec: cfg.K8sSpec,
    *args: str,
    stdin: bytes | None = None,
    check: bool = True,
    timeout_s: float = 60.0,
) -> str:
    result = await cp.run(
        cfg.kubectl_argv(spec, *args), stdin=stdin, check=False, timeout_s=timeout_s
    )
    if check and result.returncode != 0:
        raise LayerError(f"kubectl {' '.join(args[:3])}: {(result.stderr or result.stdout)[-400:]}")
    return result.stdout


async def _ensure_service_account_key(cp: NodeShell) -> bool:
    if await cp.read_file(cfg.pki_path("sa.key")) is not None:
        return False
    private, public = pki.new_service_account_key()
    await cp.write_file(cfg.pki_path("sa.pub"), public)
    await cp.write_file(cfg.pki_path("sa.key"), private, mode=0o600)
    return True


async def start_control_plane(cp: NodeShell, spec: cfg.K8sSpec) -> bool:
    """PKI, etcd and kube-apiserver on the control-plane node (the caller
    waits for ``/readyz``). True if a certificate or kubeconfig changed, so
    ``start_controllers`` restarts the controllers that read them."""
    ca = await ensure_ca(cp, spec.cluster_name)
    public_dns, public_ips = pki.split_names(spec.public_names)
    server_pair = _ensure_pair(
        cp,
        ca,
        "apiserver",
        "kube-apiserver",
        dns_names=[
            spec.api_hostname,
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            f"kubernetes.default.svc.{cfg.CLUSTER_DOMAIN}",
            "localhost",
            *public_dns,
        ],
        ip_addresses=[spec.api_address, cfg.api_service_ip(), "127.0.0.1", *public_ips],
        server=True,
    )
    kubelet_client_pair = _ensure_pair(
        cp,
        ca,
        "apiserver-kubelet-client",
        "kube-apiserver-kubelet-client",
        organizations=["system:masters"],
        client=True,
    )

    async def client(name: str, cn: str, orgs: list[str]) -> bool:
        issued = await _ensure_pair(cp, ca, name, cn, organizations=orgs, client=True)
        return issued | await _kubeconfig(cp, spec, name, user=cn, pair=name)

    clients = {
        "admin": ("gpuclusters-admin", ["system:masters"]),
        "controller-manager": ("system:kube-controller-manager", []),
        "scheduler": ("system:kube-scheduler", []),
    }

    async def front_proxy() -> bool:
        # The aggregation layer's own CA (see apiserver_argv): only the
        # front proxy's client certificate is signed by it.
        proxy_ca = await _ensure_ca_at(
            cp, "front-proxy-ca", f"gpuclusters {spec.cluster_name} front proxy CA"
        )
        return await _ensure_pair(
            cp, proxy_ca, "front-proxy-client", cfg.FRONT_PROXY_CLIENT, client=True
        )

    # Independent files: written concurrently (each write is a helper
    # process; one after another they were most of this step).
    changes = await asyncio.gather(
        server_pair,
        kubelet_client_pair,
        *(client(name, cn, orgs) for name, (cn, orgs) in clients.items()),
        front_proxy(),
        _ensure_service_account_key(cp),
    )
    changed = any(changes[:-1])  # a new service-account key restarts nothing by itself
    authn = await write_authentication_config(cp, spec)

    await cp.run(["install", "-d", "-m", "0700", cfg.ETCD_DATA])
    await cp.spawn(cfg.ETCD, cfg.etcd_argv(spec))
    await _respawn(cp, cfg.APISERVER, cfg.apiserver_argv(spec), changed or authn)
    return changed


async def write_authentication_config(cp: NodeShell, spec: cfg.K8sSpec) -> bool:
    """The apiserver's structured authentication file (users' tokens), where
    the server signs them; whether it changed."""
    if spec.token_issuer is None:
        return False
    return await cp.write_file(cfg.AUTHN_CONFIG, cfg.authentication_config(spec).encode())


async def ensure_token_authentication(cp: NodeShell, spec: cfg.K8sSpec, api: KubeAPI) -> None:
    """For a cluster whose apiserver started before it trusted users' tokens:
    write its authentication file and restart it with the flag (once)."""
    if await write_authentication_config(cp, spec):
        await _respawn(cp, cfg.APISERVER, cfg.apiserver_argv(spec), True)
        await wait_ready(api)


async def wait_ready(api: KubeAPI, *, timeout_s: float = 120.0) -> None:
    async def ready() -> bool | None:
        return True if await api.ready() else None

    await wait_for(ready, what="kube-apiserver /readyz", timeout_s=timeout_s, max_delay_s=0.1)


async def start_controllers(cp: NodeShell, spec: cfg.K8sSpec, *, changed: bool) -> None:
    """controller-manager and scheduler, once the apiserver answers (started
    with it, the controller manager exits: RBAC is not bootstrapped yet)."""
    await _respawn(cp, cfg.CONTROLLER_MANAGER, cfg.controller_manager_argv(spec), changed)
    await _respawn(cp, cfg.SCHEDULER, cfg.scheduler_argv(spec), changed)


@dataclass(frozen=True, slots=True)
class AddonPlan:
    """Which add-ons run (those whose binary is installed), and which of
    them must restart because a file they read only at start changed."""

    coredns: bool
    metrics_server: bool
    restart_coredns: bool = False
    restart_metrics_server: bool = False


async def prepare_addons(
    cp: NodeShell, spec: cfg.K8sSpec, ca: pki.KeyPair, *, coredns: bool, metrics_server: bool
) -> AddonPlan:
    """The add-ons' certificates, kubeconfigs and Corefile on the
    control-plane node (``addons``). Needs only the CA, so it runs while the
    apiserver starts. A rewritten Corefile needs no restart: CoreDNS's
    ``reload`` plugin swaps it in without dropping queries."""

    async def client(name: str, user: str) -> bool:
        issued = await _ensure_pair(cp, ca, name, user, client=True)
        return issued | await _kubeconfig(cp, spec, name, user=user, pair=name)

    async def coredns_files() -> bool:
        if not coredns:
            return False
        resolv = (await cp.read_file("/etc/resolv.conf") or b"").decode(errors="replace")
        upstream = bool(addons.nameservers(resolv))
        changed = await client("coredns", addons.COREDNS_USER)
        await _write_text(cp, addons.COREFILE, addons.corefile(upstream=upstream))
        return changed

    async def metrics_files() -> bool:
        if not metrics_server:
            return False
        dns_names, ips = addons.metrics_server_names(spec)
        serving, changed = await asyncio.gather(
            _ensure_pair(
                cp,
                ca,
                "metrics-server-serving",
                addons.METRICS_SERVICE,
                dns_names=dns_names,
                ip_addresses=ips,
                server=True,
            ),
            client("metrics-server", addons.METRICS_SERVER_USER),
        )
        return serving | changed

    restart_dns, restart_metrics = await asyncio.gather(coredns_files(), metrics_files())
    return AddonPlan(
        coredns=coredns,
        metrics_server=metrics_server,
        restart_coredns=restart_dns,
        restart_metrics_server=restart_metrics,
    )


async def start_addons(
    cp: NodeShell,
    api: KubeAPI,
    spec: cfg.K8sSpec,
    bins: addons.AddonBins,
    plan: AddonPlan,
    *,
    ca_pem: bytes,
    changed: bool,
) -> None:
    """The add-ons' RBAC, Services and EndpointSlices, then the daemons, then
    the metrics APIService: registered only once metrics-server is started,
    since an APIService whose server is absent fails every client's API
    discovery (a binary missing at first would leave it so for good).
    ``changed``: the control plane's certificates changed (the front proxy's
    among them), which metrics-server reads at start."""
    objs = []
    if plan.coredns:
        objs += addons.coredns_manifests(spec)
    if plan.metrics_server:
        objs += addons.metrics_server_manifests(spec)
    # RBAC first: a daemon started without its permissions backs off.
    await api.apply(objs)
    if plan.coredns:
        await _respawn(cp, addons.COREDNS, addons.coredns_argv(bins), plan.restart_coredns)
    if plan.metrics_server:
        await _respawn(
            cp,
            addons.METRICS_SERVER,
            addons.metrics_server_argv(bins, spec),
            plan.restart_metrics_server or changed,
        )
        await api.apply([addons.metrics_apiservice(ca_pem=ca_pem)])


async def admin_api(cp: NodeShell, spec: cfg.K8sSpec) -> KubeAPI | None:
    """A client of the cluster's apiserver as its admin, or None while the
    control-plane step has not issued the admin certificate yet."""
    ca = await cp.read_file(CA_CERT)
    cert = await cp.read_file(cfg.pki_path("admin.crt"))
    key = await cp.read_file(cfg.pki_path("admin.key"))
    if ca is None or cert is None or key is None:
        return None
    return KubeAPI(spec.server, ca_pem=ca, cert_pem=cert, key_pem=key)


async def _wait_phase(
    api: KubeAPI, path: str, done: Callable[[str | None], bool], *, what: str, timeout_s: float
) -> None:
    async def reached() -> bool | None:
        try:
            phase = (await api.get(path)).get("status", {}).get("phase")
        except NotFound:
            phase = None
        return True if done(phase) else None

    await wait_for(reached, what=what, timeout_s=timeout_s, max_delay_s=0.1)


async def wait_volume_settled(api: KubeAPI, pv: str, *, timeout_s: float = 60.0) -> None:
    """Wait until the PV binder has seen ``pv`` (its phase left Pending)."""
    await _wait_phase(
        api,
        f"/api/v1/persistentvolumes/{pv}",
        lambda phase: phase not in (None, "Pending"),
        what=f"PV {pv} seen by the binder",
        timeout_s=timeout_s,
    )


async def wait_bound(
    api: KubeAPI, pvc: str, *, namespace: str = "default", timeout_s: float = 60.0
) -> None:
    """Wait for the PV binder (in kube-controller-manager) to bind ``pvc``;
    it does so asynchronously after the claim is created, and a cluster is
    only ready once its shared-volume claim can be mounted."""
    await _wait_phase(
        api,
        f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{pvc}",
        lambda phase: phase == "Bound",
        what=f"PVC {pvc} Bound",
        timeout_s=timeout_s,
    )


async def reconcile_rbac(
    cp: NodeShell, spec: cfg.K8sSpec, users: Iterable[tuple[str, bool]]
) -> None:
    """Users' ClusterRoleBindings; ``kubectl auth reconcile`` also replaces
    a binding whose role changed (roleRef is immutable)."""
    objs = cfg.user_bindings(list(users))
    if objs:
        await kubectl(cp, spec, "auth", "reconcile", "-f", "-", stdin=cfg.as_list(objs).encode())


# --- nodes --------------------------------------------------------------------------------


async def prepare_kernel(node: NodeShell) -> None:
    """The node's own network namespace forwards (pods are routed) and
    passes bridged traffic through iptables (Services to pods on the same
    bridge); kubelet's global kernel settings are shadowed, not changed."""
    await node.run(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
    await node.run(["sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=1"])
    await node.run(["sh", "-euc", cfg.sysctl_shadow_script()])


async def ensure_pod_egress(node: NodeShell, knode: cfg.K8sNode) -> None:
    """Pods reach beyond the pod network behind the node's address
    (kube-proxy never touches the built-in POSTROUTING chain's rules)."""
    rule = cfg.pod_egress_rule(knode)
    present = await node.run(
        ["iptables", "-w", "-t", "nat", "-C", "POSTROUTING", *rule], check=False
    )
    if present.returncode != 0:
        await node.run(["iptables", "-w", "-t", "nat", "-A", "POSTROUTING", *rule])


async def ensure_service_cidr_closed(node: NodeShell) -> None:
    """Refuse what kube-proxy does not forward in the Service range
    (cfg.service_cidr_reject_rules says why); appended once each."""
    for chain, rule in cfg.service_cidr_reject_rules():
        present = await node.run(["iptables", "-w", "-C", chain, *rule], check=False)
        if present.returncode != 0:
            await node.run(["iptables", "-w", "-A", chain, *rule])


async def ensure_images(node: NodeShell, images: Iterable[Image]) -> None:
    present = await node.run(
        ["ctr", f"--address={cfg.CONTAINERD_SOCK}", "-n", "k8s.io", "images", "ls", "-q"]
    )
    have = set(present.stdout.split())
    for image in images:
        path = f"{cfg.IMAGES_DIR}/{image.file_name}"
        changed = await node.write_file(path, image.archive, mode=0o600)
        if changed or image.name not in have:
            await node.run(
                [
                    "ctr",
                    f"--address={cfg.CONTAINERD_SOCK}",
                    "-n",
                    "k8s.io",
                    "images",
                    "import",
                    "--no-unpack=false",
                    path,
                ],
                timeout_s=120.0,
            )


async def start_containerd(node: NodeShell, spec: cfg.K8sSpec, *, timeout_s: float = 30.0) -> None:
    changed = False
    if spec.registry is not None and spec.registry.ca_pem is not None:
        changed = await _write_text(node, cfg.REGISTRY_CA, spec.registry.ca_pem)
    changed |= await _write_text(node, cfg.CONTAINERD_CONF, cfg.containerd_config(spec))
    await _respawn(node, cfg.CONTAINERD, cfg.containerd_argv(), changed)
    await wait_for(
        lambda: ok(node, ["ctr", f"--address={cfg.CONTAINERD_SOCK}", "version"]),
        what=f"containerd on {node.hostname}",
        timeout_s=timeout_s,
    )


def node_is_ready(obj: dict[str, Any], *, gpus: int) -> bool:
    conditions = obj.get("status", {}).get("conditions", [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    allocatable = obj.get("status", {}).get("allocatable", {})
    return ready and int(allocatable.get(cfg.GPU_RESOURCE, "0")) >= gpus


async def _stop_if_changed(shell: NodeShell, name: str, changed: bool) -> None:
    if changed and await shell.is_running(name):
        log.info("%s: restarting %s (its configuration changed)", shell.hostname, name)
        await shell.stop(name, timeout_s=30.0)


async def prepare_node(
    node: NodeShell,
    spec: cfg.K8sSpec,
    knode: cfg.K8sNode,
    *,
    ca: pki.KeyPair,
    images: Sequence[Image],
) -> None:
    """Everything on a GPU node that needs only the cluster's CA: kernel
    settings, certificates and kubeconfigs, containerd with the images and
    the registry's CA, CNI and the kubelet's and kube-proxy's configuration. Runs
    while the apiserver still starts. A kubelet or kube-proxy whose files
    changed is stopped here and started again by ``start_node``."""

    async def kubelet_files() -> bool:
        client, server = await asyncio.gather(
            _ensure_pair(
                node,
                ca,
                "kubelet-client",
                f"system:node:{knode.name}",
                organizations=["system:nodes"],
                client=True,
            ),
            _ensure_pair(
                node,
                ca,
                "kubelet",
                knode.name,
                dns_names=[knode.name],
                ip_addresses=[knode.address],
                server=True,
            ),
        )
        config = await _kubeconfig(
            node, spec, "kubelet", user=f"system:node:{knode.name}", pair="kubelet-client"
        )
        return client | server | config

    async def proxy_files() -> bool:
        issued = await _ensure_pair(node, ca, "kube-proxy", "system:kube-proxy", client=True)
        return issued | await _kubeconfig(
            node, spec, "kube-proxy", user="system:kube-proxy", pair="kube-proxy"
        )

    # Independent steps, each a few helper processes: run concurrently.
    async def kernel() -> None:
        await prepare_kernel(node)
        await ensure_pod_egress(node, knode)
        await ensure_service_cidr_closed(node)

    _, _, kubelet_changed, proxy_changed, _ = await asyncio.gather(
        kernel(),
        node.write_file(CA_CERT, ca.cert),
        kubelet_files(),
        proxy_files(),
        start_containerd(node, spec),
    )

    async def load_images() -> None:
        await ensure_images(node, images)
        if await node.is_running(cfg.OLD_NODE_REGISTRY):
            await node.stop(cfg.OLD_NODE_REGISTRY, timeout_s=10.0)

    _, _, kubelet_config, proxy_config = await asyncio.gather(
        load_images(),
        _write_text(node, cfg.CNI_CONF, cfg.cni_conflist(knode)),
        _write_text(node, f"{cfg.ETC}/kubelet-config.yaml", cfg.kubelet_config(spec, knode)),
        _write_text(node, f"{cfg.ETC}/kube-proxy-config.yaml", cfg.kube_proxy_config(spec, knode)),
    )
    kubelet_changed |= kubelet_config
    proxy_changed |= proxy_config
    await _stop_if_changed(node, cfg.KUBELET, kubelet_changed)
    await _stop_if_changed(node, cfg.KUBE_PROXY, proxy_changed)


async def start_node(
    api: KubeAPI,
    node: NodeShell,
    spec: cfg.K8sSpec,
    knode: cfg.K8sNode,
    *,
    gpus: int,
    timeout_s: float = 90.0,
) -> dict[str, Any]:
    """kubelet and kube-proxy on a prepared node, once the apiserver
    answers (the kubelet backs off up to 7 s between registration attempts,
    so it starts only when one will succeed); returns the Node object once
    it is Ready with its GPUs allocatable."""
    await node.spawn(cfg.KUBELET, cfg.kubelet_argv(spec, knode))
    await node.spawn(cfg.KUBE_PROXY, cfg.kube_proxy_argv(spec))

    async def ready() -> dict[str, Any] | None:
        try:
            obj = await api.get_node(knode.name)
        except NotFound:
            return None  # the kubelet has not registered it yet
        return obj if node_is_ready(obj, gpus=gpus) else None

    obj = await wait_for(
        ready, what=f"node {knode.name} Ready", timeout_s=timeout_s, max_delay_s=0.1
    )
    if not obj.get("spec", {}).get("podCIDR"):
        # For tools that read it; set once (the field is immutable after).
        patch = {"spec": {"podCIDR": knode.pod_cidr, "podCIDRs": [knode.pod_cidr]}}
        await api.merge_patch(f"/api/v1/nodes/{knode.name}", patch)
    return obj


async def ensure_routes(shell: NodeShell, routes: dict[str, str]) -> None:
    """``pod CIDR -> node address`` routes in this member's network namespace."""
    for cidr, via in sorted(routes.items()):
        if via == shell.address:
            continue
        await shell.run(["ip", "route", "replace", cidr, "via", via])


async def remove_routes(shell: NodeShell, cidrs: Iterable[str]) -> None:
    for cidr in cidrs:
        await shell.run(["ip", "route", "del", cidr], check=False)


# --- cordon, drain, remove --------------------------------------------------------------------


async def cordon(api: KubeAPI, name: str, *, reason: str) -> bool:
    """Mark the node unschedulable (ours: annotated with the reason). A node
    a user cordoned keeps their cordon. False if Kubernetes does not know it."""
    try:
        obj = await api.get_node(name)
    except NotFound:
        return False
    if obj.get("spec", {}).get("unschedulable"):
        return True
    reason_text = f"gpuclusters: {reason}".strip()
    patch = {
        "metadata": {"annotations": {cfg.CORDON_ANNOTATION: reason_text}},
        "spec": {"unschedulable": True},
    }
    await api.merge_patch(f"/api/v1/nodes/{name}", patch)
    return True


def workload_pods(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pods that still hold the node: not DaemonSet-owned, not finished."""
    left = []
    for pod in pods:
        owners = pod.get("metadata", {}).get("ownerReferences", [])
        if any(o.get("kind") == "DaemonSet" for o in owners):
            continue
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        left.append(pod)
    return left


async def drain(cp: NodeShell, spec: cfg.K8sSpec, api: KubeAPI, name: str, *, reason: str) -> bool:
    """Cordon, evict what runs there (graceful, through the eviction API so
    PodDisruptionBudgets count: kubectl drain's own logic), and answer
    whether the node is empty. Never blocks for long: the caller asks again
    until True or its deadline."""
    if not await cordon(api, name, reason=reason):
        return True
    await kubectl(
        cp,
        spec,
        "drain",
        name,
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        "--force",
        "--timeout=3s",
        check=False,
    )
    return not workload_pods(await api.pods_on(name))


async def uncordon(api: KubeAPI, name: str) -> bool:
    """Undo *our* cordon (annotated); a user's stays. True if uncordoned."""
    try:
        obj = await api.get_node(name)
    except NotFound:
        return False
    if not obj.get("spec", {}).get("unschedulable"):
        return False
    if cfg.CORDON_ANNOTATION not in obj.get("metadata", {}).get("annotations", {}):
        return False
    patch = {
        "metadata": {"annotations": {cfg.CORDON_ANNOTATION: None}},
        "spec": {"unschedulable": None},
    }
    await api.merge_patch(f"/api/v1/nodes/{name}", patch)
    return True


async def is_cordoned_by_user(api: KubeAPI, name: str) -> bool:
    try:
        obj = await api.get_node(name)
    except NotFound:
        return False
    if not obj.get("spec", {}).get("unschedulable"):
        return False
    annotations = obj.get("metadata", {}).get("annotations", {})
    return cfg.CORDON_ANNOTATION not in annotations


async def stop_node(node: NodeShell) -> None:
    """Stop the node's Kubernetes daemons (kube-proxy, kubelet, containerd);
    the containers go with the node, or with its next power-off."""
    for name in (cfg.KUBE_PROXY, cfg.KUBELET, cfg.CONTAINERD):
        await node.stop(name, timeout_s=30.0)


async def delete_node_object(api: KubeAPI, name: str) -> None:
    await api.delete(f"/api/v1/nodes/{name}")
    await api.delete(f"/api/v1/persistentvolumes/{cfg.local_pv_name(name)}")


GPU_RESOURCE = "nvidia.com/gpu"


def pod_gpus(pod: dict[str, Any]) -> int:
    """The GPUs a pod asks for: the larger of its containers' sum and its
    largest init container (the scheduler's rule for a pod's request)."""

    def ask(c: dict[str, Any]) -> int:
        res = c.get("resources") or {}
        value = (res.get("limits") or {}).get(GPU_RESOURCE) or (res.get("requests") or {}).get(
            GPU_RESOURCE
        )
        try:
            return int(value or 0)
        except (TypeError, ValueError):
            return 0

    spec = pod.get("spec") or {}
    main = sum(ask(c) for c in spec.get("containers") or [])
    init = max((ask(c) for c in spec.get("initContainers") or []), default=0)
    return max(main, init)


def unschedulable_gpu_pods(pods: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """Pending pods the scheduler found no node for that ask for GPUs:
    (namespace/name, GPUs), oldest first."""
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or ""):
        status = pod.get("status") or {}
        if status.get("phase") != "Pending" or (pod.get("spec") or {}).get("nodeName"):
            continue
        scheduled = next(
            (c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None
        )
        if scheduled is None or scheduled.get("reason") != "Unschedulable":
            continue
        gpus = pod_gpus(pod)
        if gpus > 0:
            meta = pod["metadata"]
            out.append((f"{meta.get('namespace', 'default')}/{meta['name']}", gpus))
    return out
