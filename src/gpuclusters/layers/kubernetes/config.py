"""Kubernetes on a cluster's nodes: versions, paths, flags and files (pure; no I/O).

Everything a node runs is rendered here from a ``K8sSpec`` (cluster-wide)
and a ``K8sNode`` (one node), so the same inputs always give the same
bytes, and the stack writes a file (or restarts a daemon) only when it
changed. Choices, and why:

* **Release 1.34** (``K8S_VERSION``): this kernel mounts cgroup v1, which
  1.35 refuses by default, and Debian 12's containerd is 1.6, which 1.35 is
  the last to support. ``failCgroupV1: false`` is set anyway, explicitly.
* **One control-plane node per cluster** running etcd (plain HTTP on the
  node's loopback only: nothing else can reach it), kube-apiserver
  (``Node,RBAC``, NodeRestriction), kube-controller-manager and
  kube-scheduler, without leader election (one replica each), and the
  add-ons CoreDNS and metrics-server (``addons``). The apiserver reaches
  aggregated APIs and webhooks at their endpoints' addresses
  (``--enable-aggregator-routing``: no kube-proxy runs there) as the front
  proxy, with a CA of its own.
* **Per-cluster PKI** (``pki``): a CA of the cluster's own, serving and
  client certificates per component, per-user client certificates.
* **Nodes**: containerd with runc (cgroupfs driver), kubelet with its own
  cgroup root (several kubelets share this kernel), Debian's CNI plugins
  (bridge + host-local + portmap) and kube-proxy in iptables mode.
* **Pod network**: node ``10.231.<n>.<h>`` gets pod CIDR ``10.244.<h>.0/24``
  (unique within the cluster, known before the node registers, so the CNI
  file exists when kubelet starts and the node is Ready at once); every
  member of the cluster (control plane included) routes each node's pod
  CIDR to that node. No masquerading inside the cluster; clusters share no
  network, so every cluster can use the same ranges. Pods leaving the pod
  network are masqueraded behind their node (``pod_egress_rule``).
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuclusters.core.catalog import GPU_TYPES
from gpuclusters.layers.base import RegistryRef, TokenIssuerRef

K8S_VERSION = "1.34.4"
DEFAULT_CACHE = Path("/var/cache/gpuclusters/k8s")
DEFAULT_BIN_DIR = DEFAULT_CACHE / f"v{K8S_VERSION}" / "bin"

SERVICE_CIDR = ipaddress.IPv4Network("10.96.0.0/16")
CLUSTER_CIDR = ipaddress.IPv4Network("10.244.0.0/16")
API_PORT = 6443
CLUSTER_DOMAIN = "cluster.local"
# The front proxy's client certificate's name (kube-apiserver to aggregated APIs).
FRONT_PROXY_CLIENT = "front-proxy-client"
GPU_RESOURCE = "nvidia.com/gpu"

# Labels every node carries (kubelet may set labels outside the
# kubernetes.io / k8s.io namespaces on its own node).
LABEL_COMPUTE_CLASS = "gpuclusters.io/compute-class"
LABEL_GPU_TYPE = "gpuclusters.io/gpu-type"
LABEL_GPU_PRODUCT = "nvidia.com/gpu.product"
LABEL_IB_ISLAND = "gpuclusters.io/ib-island"
# SkyPilot reads GPU types from this label first (its GFD formatter would
# read `H100_SXM` off nvidia.com/gpu.product as a type no request matches).
LABEL_SKYPILOT_ACCELERATOR = "skypilot.co/accelerator"
# Our cordons carry this annotation; a cordon without it is a user's.
CORDON_ANNOTATION = "gpuclusters.io/cordoned-by"

SHARED_STORAGE_CLASS = "shared-volume"
SHARED_PV = "shared-volume"
SHARED_PVC = "shared-volume"
LOCAL_STORAGE_CLASS = "local-storage-class"

# Daemon names (NodeShell.spawn): logs at /var/log/gpuclusters/<name>.log.
ETCD = "etcd"
APISERVER = "kube-apiserver"
CONTROLLER_MANAGER = "kube-controller-manager"
SCHEDULER = "kube-scheduler"
CONTAINERD = "containerd"
KUBELET = "kubelet"
KUBE_PROXY = "kube-proxy"

ETC = "/etc/kubernetes"
PKI = f"{ETC}/pki"
ADMIN_CONF = f"{ETC}/admin.conf"
CONTAINERD_CONF = "/etc/containerd/config.toml"
CONTAINERD_SOCK = "/run/containerd/containerd.sock"
CNI_CONF = "/etc/cni/net.d/10-gpuclusters.conflist"
IMAGES_DIR = "/var/lib/gpuclusters/images"
ETCD_DATA = "/var/lib/etcd"
# The per-node read-only registry of earlier versions (stopped where found).
OLD_NODE_REGISTRY = "image-registry"
# Values kubelet insists on for these kernel settings (it writes them at
# start). They are global in a shared kernel, so each node is shown a file
# holding the expected value instead, and the host's settings never change.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
SYSCTL_SHADOW_DIR = "/etc/gpuclusters/k8s-sysctl"


@dataclass(frozen=True, slots=True)
class K8sSpec:
    """One cluster's Kubernetes, as every node sees it."""

    cluster_name: str
    api_address: str  # the control-plane node's address
    api_hostname: str
    bin_dir: str = str(DEFAULT_BIN_DIR)
    version: str = K8S_VERSION
    # Names users reach the apiserver by (the gateway's public host): in the
    # serving certificate, so kubectl from other machines verifies it.
    public_names: tuple[str, ...] = ()
    # The image registry nodes pull from (None: imported images only).
    registry: RegistryRef | None = None
    # Who signs users' tokens (None: users hold client certificates).
    token_issuer: TokenIssuerRef | None = None

    @property
    def server(self) -> str:
        return f"https://{self.api_address}:{API_PORT}"

    def bin(self, name: str) -> str:
        return f"{self.bin_dir}/{name}"

    @property
    def pause_image(self) -> str:
        return f"localhost/gpuclusters-pause:v{self.version}"


@dataclass(frozen=True, slots=True)
class K8sNode:
    """One GPU node, as its kubelet and kube-proxy see it."""

    name: str
    address: str
    cgroup_root: str
    labels: dict[str, str] = field(default_factory=dict)
    # The node runs in its own user namespace (docs/security.md): kubelet
    # then tolerates what only host root may do (KubeletInUserNamespace).
    in_userns: bool = False

    @property
    def pod_cidr(self) -> str:
        return pod_cidr_for(self.address)


def pod_cidr_for(address: str) -> str:
    """``10.244.<h>.0/24`` for node address ``a.b.c.<h>``."""
    host_part = int(ipaddress.IPv4Address(address)) & 0xFF
    return str(ipaddress.IPv4Network((int(CLUSTER_CIDR.network_address) + (host_part << 8), 24)))


def api_service_ip() -> str:
    """The ``kubernetes`` Service's ClusterIP: the first of the service range."""
    return str(SERVICE_CIDR.network_address + 1)


def dns_service_ip() -> str:
    """The ``kube-dns`` Service's ClusterIP (``10.96.0.10``, kubeadm's
    choice, so tools and images that assume it work): every pod's
    nameserver (kubelet's ``clusterDNS``)."""
    return str(SERVICE_CIDR.network_address + 10)


def node_labels(*, compute_class: str, gpu_type: str, ib_island: str | None) -> dict[str, str]:
    labels = {
        LABEL_COMPUTE_CLASS: compute_class,
        LABEL_GPU_TYPE: gpu_type,
        LABEL_GPU_PRODUCT: gpu_type,
    }
    if ib_island:
        labels[LABEL_IB_ISLAND] = ib_island
    spec = GPU_TYPES.get(gpu_type)
    if spec is not None:
        labels[LABEL_SKYPILOT_ACCELERATOR] = spec.skypilot_accelerator
    return labels


# --- files ----------------------------------------------------------------------------------


def pki_path(name: str) -> str:
    return f"{PKI}/{name}"


def component_kubeconfig(spec: K8sSpec, *, user: str, cert: str, key: str) -> str:
    """A kubeconfig for one of our components (certificate files on the node)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": spec.cluster_name,
                "cluster": {"server": spec.server, "certificate-authority": pki_path("ca.crt")},
            }
        ],
        "users": [{"name": user, "user": {"client-certificate": cert, "client-key": key}}],
        "contexts": [{"name": "default", "context": {"cluster": spec.cluster_name, "user": user}}],
        "current-context": "default",
    }
    return json.dumps(config, indent=1) + "\n"


def containerd_config(spec: K8sSpec) -> str:
    """containerd 1.6 (config version 2): CRI with runc on cgroupfs, our pause image."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""\
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
# Snapshotters that cannot work here, and the /opt plugin (/opt is read-only
# in a node), would only log errors at every start.
disabled_plugins = [
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.internal.v1.opt",
]

[grpc]
  address = "{CONTAINERD_SOCK}"

[{cri}]
  sandbox_image = "{spec.pause_image}"
  disable_apparmor = true
  # Never ask for an oom_score_adj below containerd's own: lowering it needs
  # CAP_SYS_RESOURCE, which some hosts (this one) withhold even from root.
  restrict_oom_score_adj = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/etc/cni/net.d"
{containerd_registry(spec.registry)}"""


REGISTRY_CA = "/etc/containerd/registry-ca.pem"


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a TOML basic string is a JSON string for these values


def containerd_registry(registry: RegistryRef | None) -> str:
    """CRI's registry section: the cluster's registry with the cluster's pull
    credential and CA; ``localhost/NAME`` (the project's own images, e.g.
    ``localhost/gpuclusters-base:latest``) mirrored to the registry's
    top-level repositories, where the system images are pushed (a ``:latest``
    image is pulled at every pod start, so the name must resolve); and the
    operator's mirrors (pull-through caches) for other registries."""
    if registry is None:
        return ""
    cri = 'plugins."io.containerd.grpc.v1.cri".registry'
    addr = _toml_str(registry.address)
    lines = [
        f'  [{cri}.mirrors."localhost"]',
        f"    endpoint = [{_toml_str(f'https://{registry.address}')}]",
    ]
    for host, endpoints in registry.mirrors:
        lines.append(f"  [{cri}.mirrors.{_toml_str(host)}]")
        lines.append(f"    endpoint = [{', '.join(_toml_str(e) for e in endpoints)}]")
    lines += [
        f"  [{cri}.configs.{addr}.auth]",
        f"    username = {_toml_str(registry.user)}",
        f"    password = {_toml_str(registry.password)}",
    ]
    if registry.ca_pem is not None:
        lines += [f"  [{cri}.configs.{addr}.tls]", f'    ca_file = "{REGISTRY_CA}"']
    return "\n".join(lines) + "\n"


def pod_egress_rule(node: K8sNode) -> list[str]:
    """The node's ``nat POSTROUTING`` rule that hides its pods behind the
    node's address on the way out of the pod network: pods of every cluster
    use the same ranges, so the host could not route replies to them (the
    host then masquerades the node, docs/access.md). Pod to pod keeps its
    addresses, as Kubernetes wants."""
    return ["-s", node.pod_cidr, "!", "-d", str(CLUSTER_CIDR), "-j", "MASQUERADE"]


def service_cidr_reject_rules() -> list[tuple[str, list[str]]]:
    """``filter`` rules (chain, rule) that refuse traffic to a Service
    address kube-proxy has no rule for: a port a Service does not have, or
    an address no Service holds. kube-proxy rewrites the destination of
    every Service port it knows before these chains (nat PREROUTING and
    OUTPUT), so only the unknown still point into the Service range here.
    Without them such packets follow the default route out of the node and
    the host (the operator's network, or a proxy there that accepts any
    connection), where a client would see a connection it should not;
    with them it is refused at once (TCP reset, ICMP port unreachable), as
    kube-proxy's own rules refuse a Service without endpoints. Conformance
    checks it: a Service's removed port must stop answering."""
    rules: list[tuple[str, list[str]]] = []
    for chain in ("FORWARD", "OUTPUT"):
        to_services = ["-d", str(SERVICE_CIDR)]
        reset = ["-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"]
        rules.append((chain, [*to_services, *reset]))
        rules.append((chain, [*to_services, "-j", "REJECT"]))
    return rules


def cni_conflist(node: K8sNode) -> str:
    conf = {
        "cniVersion": "0.4.0",
        "name": "gpuclusters",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node.pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    return json.dumps(conf, indent=1) + "\n"


def kubelet_config(spec: K8sSpec, node: K8sNode) -> str:
    config: dict[str, Any] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node.address,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": pki_path("ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": pki_path("kubelet.crt"),
        "tlsPrivateKeyFile": pki_path("kubelet.key"),
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCK}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": node.cgroup_root,
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        "failCgroupV1": False,
        "failSwapOn": False,
        # Pods ask the cluster's CoreDNS (on the control-plane node, behind
        # the kube-dns Service: ``addons``) and get the namespace's search
        # domains; the node's own resolv.conf only adds its search list.
        "clusterDNS": [dns_service_ip()],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "/etc/resolv.conf",
        "volumePluginDir": "/var/lib/kubelet/volume-plugins",
        # Images are imported, not pulled: image GC must never remove them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "registerNode": True,
        # The device plugin's GPUs appear at the next status update: every
        # 2 s instead of 10 (a small PATCH; the node is usable sooner).
        "nodeStatusUpdateFrequency": "2s",
        "staticPodPath": "",
        # Lowering oom_score_adj needs CAP_SYS_RESOURCE (see containerd_config).
        "oomScoreAdj": 0,
    }
    if node.in_userns:
        # Root in the node is not the host's: kubelet must not fail on the
        # host's sysctls, oom_score_adj or /dev/kmsg, as rootless Kubernetes
        # runs it. Its cgroup root is the node's cgroup namespace's.
        config["featureGates"] = {"KubeletInUserNamespace": True}
    return json.dumps(config, indent=1) + "\n"


def kube_proxy_config(spec: K8sSpec, node: K8sNode) -> str:
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": f"{ETC}/kube-proxy.conf"},
        "mode": "iptables",
        "clusterCIDR": str(CLUSTER_CIDR),
        "hostnameOverride": node.name,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "oomScoreAdj": 0,
        # Conntrack limits are global in a shared kernel: leave them alone.
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
    }
    return json.dumps(config, indent=1) + "\n"


# --- command lines ----------------------------------------------------------------------------


def etcd_argv(spec: K8sSpec) -> list[str]:
    local = "http://127.0.0.1"
    return [
        spec.bin("etcd"),
        f"--name={spec.api_hostname}",
        f"--data-dir={ETCD_DATA}",
        f"--listen-client-urls={local}:2379",
        f"--advertise-client-urls={local}:2379",
        f"--listen-peer-urls={local}:2380",
        f"--initial-advertise-peer-urls={local}:2380",
        f"--initial-cluster={spec.api_hostname}={local}:2380",
        "--log-level=warn",
    ]


AUTHN_CONFIG = f"{ETC}/authentication.yaml"


def authentication_config(spec: K8sSpec) -> str:
    """The apiserver's structured authentication (docs/identity.md): users'
    short-lived tokens from the gpuclusters server, for this cluster only
    (its audience), their name and groups as the RBAC bindings carry them
    (no prefix: the names are the users' own, as in a client certificate's
    CN, and a token's ``sub`` is always a user name the server checked)."""
    issuer = spec.token_issuer
    assert issuer is not None
    entry: dict[str, Any] = {
        "issuer": {
            "url": issuer.issuer,
            "discoveryURL": issuer.discovery_url,
            "audiences": [issuer.audience],
        },
        "claimMappings": {
            "username": {"claim": "sub", "prefix": ""},
            "groups": {"claim": "groups", "prefix": ""},
        },
        "userValidationRules": [
            {
                "expression": "!user.username.startsWith('system:')",
                "message": "a user token may not name a system: user",
            }
        ],
    }
    if issuer.ca_pem:
        entry["issuer"]["certificateAuthority"] = issuer.ca_pem
    doc = {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "AuthenticationConfiguration",
        "jwt": [entry],
    }
    return json.dumps(doc, indent=1) + "\n"


def apiserver_argv(spec: K8sSpec) -> list[str]:
    authn = [f"--authentication-config={AUTHN_CONFIG}"] if spec.token_issuer else []
    return [*_apiserver_argv(spec), *authn]


def _apiserver_argv(spec: K8sSpec) -> list[str]:
    return [
        spec.bin("kube-apiserver"),
        f"--advertise-address={spec.api_address}",
        "--bind-address=0.0.0.0",
        f"--secure-port={API_PORT}",
        "--etcd-servers=http://127.0.0.1:2379",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true",
        f"--client-ca-file={pki_path('ca.crt')}",
        f"--tls-cert-file={pki_path('apiserver.crt')}",
        f"--tls-private-key-file={pki_path('apiserver.key')}",
        f"--kubelet-client-certificate={pki_path('apiserver-kubelet-client.crt')}",
        f"--kubelet-client-key={pki_path('apiserver-kubelet-client.key')}",
        f"--kubelet-certificate-authority={pki_path('ca.crt')}",
        "--kubelet-preferred-address-types=InternalIP",
        # Aggregated APIs (metrics-server) and webhooks are reached at their
        # Service's endpoint addresses, not its ClusterIP: no kube-proxy
        # runs on the control-plane node, so a ClusterIP leads nowhere here.
        "--enable-aggregator-routing=true",
        # The front proxy: the apiserver forwards requests to aggregated
        # APIs with this client certificate and the user in headers, which
        # an extension apiserver trusts only from a certificate of this CA
        # with this name (a CA of its own, as kubeadm: a client certificate
        # of the cluster CA must never be able to claim any user).
        f"--requestheader-client-ca-file={pki_path('front-proxy-ca.crt')}",
        f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-username-headers=X-Remote-User",
        f"--proxy-client-cert-file={pki_path('front-proxy-client.crt')}",
        f"--proxy-client-key-file={pki_path('front-proxy-client.key')}",
        f"--service-account-issuer=https://kubernetes.default.svc.{CLUSTER_DOMAIN}",
        f"--service-account-key-file={pki_path('sa.pub')}",
        f"--service-account-signing-key-file={pki_path('sa.key')}",
        "--profiling=false",
        "--v=1",
    ]


def controller_manager_argv(spec: K8sSpec) -> list[str]:
    conf = f"{ETC}/controller-manager.conf"
    return [
        spec.bin("kube-controller-manager"),
        f"--kubeconfig={conf}",
        f"--authentication-kubeconfig={conf}",
        f"--authorization-kubeconfig={conf}",
        "--bind-address=127.0.0.1",
        "--leader-elect=false",
        "--use-service-account-credentials=true",
        f"--root-ca-file={pki_path('ca.crt')}",
        f"--service-account-private-key-file={pki_path('sa.key')}",
        f"--cluster-signing-cert-file={pki_path('ca.crt')}",
        f"--cluster-signing-key-file={pki_path('ca.key')}",
        f"--cluster-name={spec.cluster_name}",
        # Pod CIDRs are ours (see the module docstring), not allocated here.
        "--allocate-node-cidrs=false",
        "--controllers=*,bootstrapsigner,tokencleaner",
        # The PV binder retries a claim whose volume its cache had not seen
        # yet only at this period (default 15 s): the shared-volume claim,
        # applied with its PV, then waited up to 30 s before the cluster was
        # ready. Binding is cheap at a cluster's scale.
        "--pvclaimbinder-sync-period=2s",
        # At start every controller gets its own service account and token
        # (--use-service-account-credentials): ~3 requests each, 40
        # controllers. The default client limit (20 QPS, burst 30) spaced the
        # starts 0.15 s apart, 6 s in all, before the PV binder ran.
        "--kube-api-qps=200",
        "--kube-api-burst=400",
        "--profiling=false",
        "--v=1",
    ]


def scheduler_argv(spec: K8sSpec) -> list[str]:
    conf = f"{ETC}/scheduler.conf"
    return [
        spec.bin("kube-scheduler"),
        f"--kubeconfig={conf}",
        f"--authentication-kubeconfig={conf}",
        f"--authorization-kubeconfig={conf}",
        "--bind-address=127.0.0.1",
        "--leader-elect=false",
        "--profiling=false",
        "--v=1",
    ]


def containerd_argv() -> list[str]:
    return ["containerd", f"--config={CONTAINERD_CONF}"]


def kubelet_argv(spec: K8sSpec, node: K8sNode) -> list[str]:
    labels = ",".join(f"{k}={v}" for k, v in sorted(node.labels.items()))
    argv = [
        spec.bin("kubelet"),
        f"--config={ETC}/kubelet-config.yaml",
        f"--kubeconfig={ETC}/kubelet.conf",
        f"--hostname-override={node.name}",
        f"--node-ip={node.address}",
        "--v=1",
    ]
    if labels:
        argv.append(f"--node-labels={labels}")
    return argv


def kube_proxy_argv(spec: K8sSpec) -> list[str]:
    return [spec.bin("kube-proxy"), f"--config={ETC}/kube-proxy-config.yaml", "--v=1"]


def kubectl_argv(spec: K8sSpec, *args: str) -> list[str]:
    """kubectl as cluster admin, run on the control-plane node."""
    return [spec.bin("kubectl"), f"--kubeconfig={ADMIN_CONF}", *args]


def sysctl_shadow_script() -> str:
    """Shell lines run inside a node before kubelet starts: bind a file with
    the value kubelet expects over each kernel setting it would change
    (only in the node's own mount namespace)."""
    lines = [f"mkdir -p {SYSCTL_SHADOW_DIR}"]
    for key, value in sorted(KUBELET_SYSCTLS.items()):
        shadow = f"{SYSCTL_SHADOW_DIR}/{key.replace('/', '.')}"
        target = f"/proc/sys/{key}"
        lines.append(
            f'if [ -e {target} ] && [ "$(cat {target})" != {shlex.quote(value)} ]; then '
            f"printf '%s\\n' {shlex.quote(value)} > {shadow} && mount --bind {shadow} {target}; fi"
        )
    return "\n".join(lines) + "\n"


# --- cluster objects --------------------------------------------------------------------------


def storage_manifests(*, shared_volume: bool, shared_capacity_gib: int) -> list[dict[str, Any]]:
    """Storage classes and the shared volume's PV + PVC.

    The shared volume is the same directory on every node (``/mnt/shared``),
    so a hostPath PV serves it ReadWriteMany; ``Retain`` so deleting the
    claim never touches the data. Local NVMe is ``local-storage-class``
    (static local PVs on each node's ``/scratch``, bound when a pod lands)."""
    objs: list[dict[str, Any]] = [
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": LOCAL_STORAGE_CLASS},
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "WaitForFirstConsumer",
            "reclaimPolicy": "Retain",
        }
    ]
    if not shared_volume:
        return objs
    objs += [
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {"name": SHARED_STORAGE_CLASS},
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "Immediate",
            "reclaimPolicy": "Retain",
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": SHARED_PV, "labels": {"gpuclusters.io/volume": "shared"}},
            "spec": {
                "capacity": {"storage": f"{shared_capacity_gib}Gi"},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": SHARED_STORAGE_CLASS,
                "hostPath": {"path": "/mnt/shared", "type": "Directory"},
                # Pre-bound from both sides: no other claim can take it.
                "claimRef": {"namespace": "default", "name": SHARED_PVC},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": SHARED_PVC, "namespace": "default"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": SHARED_STORAGE_CLASS,
                "volumeName": SHARED_PV,
                "resources": {"requests": {"storage": f"{shared_capacity_gib}Gi"}},
            },
        },
    ]
    return objs


def local_pv_name(node_name: str) -> str:
    return f"local-scratch-{node_name}"


def local_pv_manifest(node_name: str, capacity_gib: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": local_pv_name(node_name),
            "labels": {"gpuclusters.io/volume": "local"},
        },
        "spec": {
            "capacity": {"storage": f"{capacity_gib}Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": LOCAL_STORAGE_CLASS,
            "local": {"path": "/scratch"},
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/hostname",
                                    "operator": "In",
                                    "values": [node_name],
                                }
                            ]
                        }
                    ]
                }
            },
        },
    }


def user_binding_name(user: str) -> str:
    return f"gpuclusters:user:{user}"


def user_bindings(users: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    """Project admins get cluster-admin, editors the built-in ``edit`` role in
    every namespace. Bound by user name (the CN of their certificate), so a
    role change takes effect at the next reconcile without new certificates."""
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {
                "name": user_binding_name(name),
                "labels": {"gpuclusters.io/managed": "true"},
            },
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "cluster-admin" if admin else "edit",
            },
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": name}],
        }
        for name, admin in users
    ]


MANAGED_LABEL = "gpuclusters.io/managed=true"
CLUSTER_ROLE_BINDINGS = "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"


def stale_user_bindings(bindings: list[dict[str, Any]], members: set[str]) -> list[str]:
    """Names of our users' bindings (``user_bindings``) whose user is no
    longer a member: deleting them leaves a removed user's certificate
    (valid until it expires) authorized for nothing."""
    stale = []
    for b in bindings:
        name = str(b.get("metadata", {}).get("name", ""))
        if not name.startswith(user_binding_name("")):
            continue
        if name.removeprefix(user_binding_name("")) not in members:
            stale.append(name)
    return sorted(stale)


def as_list(objs: list[dict[str, Any]]) -> str:
    """Objects as one ``kind: List`` document for ``kubectl apply -f -``."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}) + "\n"
