"""Cluster add-ons run by the control-plane node: CoreDNS and metrics-server
(pure rendering: Corefile, command lines, API objects; no I/O).

Design, and why:

* **Daemons of the control-plane service node, not pods.** CoreDNS and
  metrics-server run next to etcd and kube-apiserver (``NodeShell.spawn``,
  like them): DNS answers before any GPU node joins, takes nothing of a GPU
  node (no pod, no CPU or memory of the nodes users pay for), and survives
  drains, preemptions and a cluster scaled to zero nodes. Their binaries are
  built by ``scripts/build-k8s-addons`` (``DEFAULT_BIN_DIR``); production
  installs the projects' release binaries of the same versions there.
* **Reached through selectorless Services.** ``kube-dns`` (ClusterIP
  ``10.96.0.10``, the pods' nameserver) and ``metrics-server`` have no pod
  selector; an EndpointSlice of ours points each at the control-plane
  node's address. kube-proxy on every GPU node then DNATs the ClusterIP to
  the control-plane node (pods reach it across the cluster bridge, behind
  their node's address: ``config.pod_egress_rule``), and kube-apiserver,
  started with ``--enable-aggregator-routing``, sends aggregated-API
  requests to the endpoint itself (no kube-proxy runs on the control-plane
  node, so the ClusterIP would lead nowhere there). The slice carries our
  own ``managed-by`` label, so Kubernetes' EndpointSlice controllers leave
  it alone. No v1 Endpoints object: CoreDNS, kube-proxy and the apiserver's
  endpoint resolver all read EndpointSlices (Endpoints is deprecated).
* **Identity by client certificate, RBAC like upstream.** CoreDNS is user
  ``system:coredns`` with kubeadm's ``system:coredns`` ClusterRole;
  metrics-server is user ``system:metrics-server`` with the ClusterRoles and
  bindings of metrics-server's own manifest (``system:metrics-server``,
  ``system:aggregated-metrics-reader`` aggregated into view/edit/admin, the
  auth delegator and the ``extension-apiserver-authentication-reader``
  RoleBinding), bound to that user instead of a service account.
* **CoreDNS** serves ``cluster.local`` and the reverse zones from the API
  (pods by IP too: ``pods insecure``), the cluster's node names from the
  control-plane node's ``/etc/hosts`` (the provider keeps every member of
  the cluster there and rewrites it in place as nodes come and go; the
  ``hosts`` plugin re-reads it every 5 s), and forwards other names to the
  node's resolvers only when its ``/etc/resolv.conf`` lists any: the
  embedded fleet's lists none ("no DNS on the cluster network"), and
  ``forward`` would refuse to start without one. Then other names get
  SERVFAIL at once (the ``hosts`` plugin's "not found", no timeouts). The
  health and readiness ports listen on loopback only, on ports chosen not
  to collide with other daemons of the node (8180/8181; the node's network
  namespace is shared by everything it runs). ``reload`` picks up a
  rewritten Corefile without dropping queries.
* **metrics-server** listens on the control-plane node's address, port
  4443, with a serving certificate of the cluster CA (the APIService's
  ``caBundle``: verified, never ``insecureSkipTLSVerify``); it trusts the
  apiserver's front proxy by the front-proxy CA and name, and scrapes each
  kubelet's ``/metrics/resource`` at its InternalIP and status port,
  verifying the kubelet's serving certificate against the cluster CA.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuclusters.layers.kubernetes import config as cfg

COREDNS_VERSION = "1.12.1"
METRICS_SERVER_VERSION = "0.8.0"
DEFAULT_CACHE = Path("/var/cache/gpuclusters/addons")
DEFAULT_BIN_DIR = DEFAULT_CACHE / "bin"

# Daemon names (NodeShell.spawn): logs at /var/log/gpuclusters/<name>.log.
COREDNS = "coredns"
METRICS_SERVER = "metrics-server"

COREFILE = "/etc/coredns/Corefile"
COREDNS_CONF = f"{cfg.ETC}/coredns.conf"
METRICS_SERVER_CONF = f"{cfg.ETC}/metrics-server.conf"
COREDNS_USER = "system:coredns"
METRICS_SERVER_USER = "system:metrics-server"
DNS_SERVICE = "kube-dns"
METRICS_SERVICE = "metrics-server"
NAMESPACE = "kube-system"
METRICS_PORT = 4443
DNS_METRICS_PORT = 9153
COREDNS_HEALTH = "127.0.0.1:8180"
COREDNS_READY = "127.0.0.1:8181"
METRICS_API = "v1beta1.metrics.k8s.io"
# Our EndpointSlices' manager: not "endpointslice-controller.k8s.io" (nor the
# mirroring controller's), so neither controller touches them.
MANAGED_BY = "control-plane.gpuclusters.io"
ZONES = (cfg.CLUSTER_DOMAIN, "in-addr.arpa", "ip6.arpa")


@dataclass(frozen=True, slots=True)
class AddonBins:
    """Where the add-ons' binaries are (on the control-plane node)."""

    bin_dir: str = str(DEFAULT_BIN_DIR)

    def bin(self, name: str) -> str:
        return f"{self.bin_dir}/{name}"


def nameservers(resolv_conf: str) -> list[str]:
    """The ``nameserver`` addresses a resolv.conf lists, in order."""
    out = []
    for line in resolv_conf.splitlines():
        words = line.split("#", 1)[0].split(";", 1)[0].split()
        if len(words) >= 2 and words[0] == "nameserver":
            out.append(words[1])
    return out


def corefile(*, upstream: bool) -> str:
    """CoreDNS's configuration. ``upstream``: the control-plane node's
    /etc/resolv.conf lists nameservers, so names outside the cluster are
    forwarded to them; without, ``forward`` is left out (it refuses to start
    with no nameserver) and the cluster's zones answer authoritatively."""
    zones = " ".join(ZONES)
    if upstream:
        # Names not in /etc/hosts go on to the API's zones, and reverse
        # lookups the API does not know on to the upstream resolvers.
        hosts_fall = "fallthrough"
        k8s_fall = "\n        fallthrough in-addr.arpa ip6.arpa"
        forward = "\n    forward . /etc/resolv.conf {\n        max_concurrent 1000\n    }"
    else:
        # Only the cluster's zones go on to the API; any other name not in
        # /etc/hosts is answered at once (nothing to forward to).
        hosts_fall = f"fallthrough {zones}"
        k8s_fall = ""
        forward = ""
    return f"""\
# CoreDNS of this cluster, written by gpuclusters (layers/kubernetes/addons.py)
# at every control-plane step: edits are overwritten.
.:53 {{
    errors
    health {COREDNS_HEALTH} {{
        lameduck 5s
    }}
    ready {COREDNS_READY}
    hosts /etc/hosts {{
        ttl 30
        reload 5s
        {hosts_fall}
    }}
    kubernetes {zones} {{
        kubeconfig {COREDNS_CONF}
        pods insecure
        ttl 30{k8s_fall}
    }}
    prometheus :{DNS_METRICS_PORT}{forward}
    cache 30
    loop
    reload
    loadbalance
}}
"""


def coredns_argv(bins: AddonBins) -> list[str]:
    return [bins.bin("coredns"), "-conf", COREFILE]


def metrics_server_argv(bins: AddonBins, spec: cfg.K8sSpec) -> list[str]:
    conf = METRICS_SERVER_CONF
    return [
        bins.bin("metrics-server"),
        f"--bind-address={spec.api_address}",
        f"--secure-port={METRICS_PORT}",
        f"--tls-cert-file={cfg.pki_path('metrics-server-serving.crt')}",
        f"--tls-private-key-file={cfg.pki_path('metrics-server-serving.key')}",
        f"--kubeconfig={conf}",
        f"--authentication-kubeconfig={conf}",
        f"--authorization-kubeconfig={conf}",
        f"--client-ca-file={cfg.pki_path('ca.crt')}",
        f"--requestheader-client-ca-file={cfg.pki_path('front-proxy-ca.crt')}",
        f"--requestheader-allowed-names={cfg.FRONT_PROXY_CLIENT}",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-username-headers=X-Remote-User",
        "--kubelet-preferred-address-types=InternalIP",
        "--kubelet-use-node-status-port",
        f"--kubelet-certificate-authority={cfg.pki_path('ca.crt')}",
        "--metric-resolution=15s",
        "--profiling=false",
    ]


def metrics_server_names(spec: cfg.K8sSpec) -> tuple[list[str], list[str]]:
    """``(dns_names, ip_addresses)`` of metrics-server's serving certificate:
    the Service's names (kube-apiserver verifies ``<svc>.<ns>.svc``) and
    the control-plane node's address and name (direct requests)."""
    svc = f"{METRICS_SERVICE}.{NAMESPACE}"
    return (
        [svc, f"{svc}.svc", f"{svc}.svc.{cfg.CLUSTER_DOMAIN}", spec.api_hostname],
        [spec.api_address],
    )


# --- API objects --------------------------------------------------------------------------------

_RBAC = "rbac.authorization.k8s.io"
_LABELS = {"gpuclusters.io/managed": "true"}


def _user(name: str) -> list[dict[str, str]]:
    return [{"apiGroup": _RBAC, "kind": "User", "name": name}]


def _cluster_role(name: str, rules: list[dict[str, Any]], **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{_RBAC}/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": {**_LABELS, **labels}},
        "rules": rules,
    }


def _cluster_binding(name: str, role: str, user: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{_RBAC}/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name, "labels": dict(_LABELS)},
        "roleRef": {"apiGroup": _RBAC, "kind": "ClusterRole", "name": role},
        "subjects": _user(user),
    }


def _service(
    name: str, ports: list[dict[str, Any]], *, cluster_ip: str | None = None, **labels: str
) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "ClusterIP", "ports": ports}
    if cluster_ip is not None:
        spec["clusterIP"] = cluster_ip
    # No selector: the EndpointSlice below is ours (see the module docstring).
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {**_LABELS, **labels}},
        "spec": spec,
    }


def _endpoint_slice(service: str, address: str, ports: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-control-plane",
            "namespace": NAMESPACE,
            "labels": {
                **_LABELS,
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": MANAGED_BY,
            },
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": True, "serving": True, "terminating": False},
            }
        ],
        "ports": ports,
    }


def coredns_manifests(spec: cfg.K8sSpec) -> list[dict[str, Any]]:
    """RBAC for CoreDNS (kubeadm's ``system:coredns``), the ``kube-dns``
    Service at ``10.96.0.10`` and its EndpointSlice: the control-plane node."""
    dns_ports = [
        {"name": "dns", "port": 53, "protocol": "UDP"},
        {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
        {"name": "metrics", "port": DNS_METRICS_PORT, "protocol": "TCP"},
    ]
    return [
        _cluster_role(
            COREDNS_USER,
            [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        ),
        _cluster_binding(COREDNS_USER, COREDNS_USER, COREDNS_USER),
        _service(
            DNS_SERVICE,
            [{**p, "targetPort": p["port"]} for p in dns_ports],
            cluster_ip=cfg.dns_service_ip(),
            **{"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"},
        ),
        _endpoint_slice(DNS_SERVICE, spec.api_address, dns_ports),
    ]


def metrics_server_manifests(spec: cfg.K8sSpec) -> list[dict[str, Any]]:
    """metrics-server's RBAC (its own manifest's, bound to its user), its
    Service and EndpointSlice (the control-plane node, port 4443). The
    APIService is separate (``metrics_apiservice``): registered once the
    daemon runs, so API discovery is not left failing meanwhile."""
    aggregate = {
        f"rbac.authorization.k8s.io/aggregate-to-{r}": "true" for r in ("view", "edit", "admin")
    }
    return [
        _cluster_role(
            "system:aggregated-metrics-reader",
            [
                {
                    "apiGroups": ["metrics.k8s.io"],
                    "resources": ["pods", "nodes"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
            **aggregate,
        ),
        _cluster_role(
            METRICS_SERVER_USER,
            [
                {"apiGroups": [""], "resources": ["nodes/metrics"], "verbs": ["get"]},
                {
                    "apiGroups": [""],
                    "resources": ["pods", "nodes"],
                    "verbs": ["get", "list", "watch"],
                },
            ],
        ),
        _cluster_binding(METRICS_SERVER_USER, METRICS_SERVER_USER, METRICS_SERVER_USER),
        _cluster_binding(
            "metrics-server:system:auth-delegator", "system:auth-delegator", METRICS_SERVER_USER
        ),
        {
            "apiVersion": f"{_RBAC}/v1",
            "kind": "RoleBinding",
            "metadata": {
                "name": "metrics-server-auth-reader",
                "namespace": NAMESPACE,
                "labels": dict(_LABELS),
            },
            "roleRef": {
                "apiGroup": _RBAC,
                "kind": "Role",
                "name": "extension-apiserver-authentication-reader",
            },
            "subjects": _user(METRICS_SERVER_USER),
        },
        _service(
            METRICS_SERVICE,
            [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": METRICS_PORT}],
            **{"k8s-app": "metrics-server"},
        ),
        # The port's name must match the Service's: the apiserver's endpoint
        # resolver pairs them by name.
        _endpoint_slice(
            METRICS_SERVICE,
            spec.api_address,
            [{"name": "https", "port": METRICS_PORT, "protocol": "TCP"}],
        ),
    ]


def metrics_apiservice(*, ca_pem: bytes) -> dict[str, Any]:
    """``v1beta1.metrics.k8s.io``, served by the ``metrics-server`` Service
    and verified against the cluster CA (its serving certificate's issuer)."""
    return {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": METRICS_API, "labels": dict(_LABELS)},
        "spec": {
            "service": {"name": METRICS_SERVICE, "namespace": NAMESPACE, "port": 443},
            "group": "metrics.k8s.io",
            "version": "v1beta1",
            "caBundle": base64.b64encode(ca_pem).decode(),
            "groupPriorityMinimum": 100,
            "versionPriority": 100,
        },
    }
