"""Cluster add-ons on the control-plane node (layers/kubernetes/addons) and
the control plane's aggregation layer: the Corefile with and without
upstream resolvers, command lines, the API objects (checked field by field,
and against Kubernetes' own naming rules), the apiserver's front-proxy and
aggregator-routing flags, kubelet's cluster DNS, and the stack's steps on
an in-memory node: certificates made once and re-issued by the same rules
as the others, restarts only when a file a daemon reads at start changed,
and the metrics APIService registered only once its server runs."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from cryptography import x509

from gpuclusters.core.nodeshell import CommandResult
from gpuclusters.layers.kubernetes import addons, pki, stack
from gpuclusters.layers.kubernetes import config as cfg
from gpuclusters.layers.kubernetes.api import object_path

SPEC = cfg.K8sSpec(cluster_name="k1", api_address="10.231.3.2", api_hostname="k1-control-plane")
NODE = cfg.K8sNode(name="k1-gpu-0", address="10.231.3.17", cgroup_root="/gpc-abc123")
BINS = addons.AddonBins("/opt/addons/bin")


# --- DNS ------------------------------------------------------------------------------------


def test_dns_service_ip_is_kubeadms() -> None:
    assert cfg.dns_service_ip() == "10.96.0.10"


def test_kubelet_points_pods_at_cluster_dns() -> None:
    conf = json.loads(cfg.kubelet_config(SPEC, NODE))
    assert conf["clusterDNS"] == ["10.96.0.10"]
    assert conf["clusterDomain"] == "cluster.local"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("", []),
        ("# the cluster network has no DNS: names come from /etc/hosts\n", []),
        ("nameserver 10.0.0.2\nsearch example.com\nnameserver 10.0.0.3 # second\n",
         ["10.0.0.2", "10.0.0.3"]),
        ("; nameserver 1.1.1.1\n#nameserver 8.8.8.8\noptions ndots:2\n", []),
        ("nameserver\n", []),
    ],
)  # fmt: skip
def test_nameservers(text: str, want: list[str]) -> None:
    assert addons.nameservers(text) == want


def _blocks(corefile: str) -> dict[str, list[str]]:
    """Directive name -> its lines (with the block's body), for checks."""
    out: dict[str, list[str]] = {}
    depth, current = 0, ""
    for raw in corefile.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if depth == 1 and not line.startswith("}"):
            current = line.split()[0]
            out.setdefault(current, []).append(line)
        elif depth >= 2:
            out[current].append(line)
        depth += line.count("{") - line.count("}")
        assert depth >= 0
    assert depth == 0, "unbalanced braces"
    return out


def test_corefile_without_upstream_answers_only_from_the_cluster() -> None:
    text = addons.corefile(upstream=False)
    assert text.splitlines()[2] == ".:53 {"
    d = _blocks(text)
    assert "forward" not in d  # refuses to start with no nameserver
    assert d["kubernetes"][0] == "kubernetes cluster.local in-addr.arpa ip6.arpa {"
    assert f"kubeconfig {addons.COREDNS_CONF}" in d["kubernetes"]
    assert "pods insecure" in d["kubernetes"]
    assert not any(x.startswith("fallthrough") for x in d["kubernetes"])
    # Unknown outside names stop at hosts; cluster names go on to the API.
    assert "fallthrough cluster.local in-addr.arpa ip6.arpa" in d["hosts"]
    assert d["hosts"][0] == "hosts /etc/hosts {"
    assert d["health"][0].startswith(f"health {addons.COREDNS_HEALTH}")
    assert d["ready"] == [f"ready {addons.COREDNS_READY}"]
    assert d["prometheus"] == ["prometheus :9153"]
    for plugin in ("errors", "cache", "loop", "reload", "loadbalance"):
        assert plugin in d


def test_corefile_with_upstream_forwards_the_rest() -> None:
    d = _blocks(addons.corefile(upstream=True))
    assert d["forward"][0] == "forward . /etc/resolv.conf {"
    assert "fallthrough in-addr.arpa ip6.arpa" in d["kubernetes"]
    assert "fallthrough" in d["hosts"]


def test_health_and_ready_listen_on_loopback_only() -> None:
    for listen in (addons.COREDNS_HEALTH, addons.COREDNS_READY):
        assert listen.startswith("127.0.0.1:")


def test_coredns_argv() -> None:
    assert addons.coredns_argv(BINS) == ["/opt/addons/bin/coredns", "-conf", addons.COREFILE]


# --- apiserver and metrics-server flags -----------------------------------------------------


def _flags(argv: Sequence[str]) -> dict[str, str]:
    out = {}
    for a in argv[1:]:
        key, _, value = a.partition("=")
        out[key] = value
    return out


def test_apiserver_has_aggregation_layer_flags() -> None:
    f = _flags(cfg.apiserver_argv(SPEC))
    assert f["--enable-aggregator-routing"] == "true"
    assert f["--requestheader-client-ca-file"] == f"{cfg.PKI}/front-proxy-ca.crt"
    assert f["--requestheader-allowed-names"] == "front-proxy-client"
    assert f["--requestheader-extra-headers-prefix"] == "X-Remote-Extra-"
    assert f["--requestheader-group-headers"] == "X-Remote-Group"
    assert f["--requestheader-username-headers"] == "X-Remote-User"
    assert f["--proxy-client-cert-file"] == f"{cfg.PKI}/front-proxy-client.crt"
    assert f["--proxy-client-key-file"] == f"{cfg.PKI}/front-proxy-client.key"
    # The front proxy's CA is not the cluster's: no client certificate of
    # the cluster CA can claim a user through the headers.
    assert f["--requestheader-client-ca-file"] != f["--client-ca-file"]


def test_metrics_server_argv() -> None:
    argv = addons.metrics_server_argv(BINS, SPEC)
    assert argv[0] == "/opt/addons/bin/metrics-server"
    f = _flags(argv)
    assert f["--bind-address"] == SPEC.api_address
    assert f["--secure-port"] == "4443"
    assert f["--kubelet-preferred-address-types"] == "InternalIP"
    assert "--kubelet-use-node-status-port" in f
    assert f["--kubelet-certificate-authority"] == f"{cfg.PKI}/ca.crt"
    assert f["--metric-resolution"] == "15s"
    for key in ("--kubeconfig", "--authentication-kubeconfig", "--authorization-kubeconfig"):
        assert f[key] == addons.METRICS_SERVER_CONF
    assert f["--requestheader-client-ca-file"] == f"{cfg.PKI}/front-proxy-ca.crt"
    assert f["--requestheader-allowed-names"] == "front-proxy-client"
    assert f["--tls-cert-file"] == f"{cfg.PKI}/metrics-server-serving.crt"
    assert "--kubelet-insecure-tls" not in f


def test_metrics_server_serving_names_cover_what_the_apiserver_verifies() -> None:
    dns, ips = addons.metrics_server_names(SPEC)
    assert "metrics-server.kube-system.svc" in dns  # the aggregator's ServerName
    assert ips == [SPEC.api_address]


# --- API objects ----------------------------------------------------------------------------

_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(
    r"^(([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


def _all_objects() -> list[dict[str, Any]]:
    return [
        *addons.coredns_manifests(SPEC),
        *addons.metrics_server_manifests(SPEC),
        addons.metrics_apiservice(ca_pem=b"PEM"),
    ]


def test_objects_follow_kubernetes_naming_rules_and_have_paths() -> None:
    for obj in _all_objects():
        meta = obj["metadata"]
        kind = obj["kind"]
        # RBAC names may hold ':' (path segment names); the rest are DNS subdomains.
        if not kind.endswith(("Role", "Binding")):
            assert _NAME.match(meta["name"]), (kind, meta["name"])
        for key, value in meta.get("labels", {}).items():
            assert len(value) <= 63 and _LABEL_VALUE.match(value), (kind, key, value)
            assert _LABEL_KEY.match(key), (kind, key)
        assert object_path(obj).startswith(("/api/v1/", "/apis/"))


def _by(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def test_kube_dns_service_is_selectorless_at_10_96_0_10_with_our_slice() -> None:
    objs = addons.coredns_manifests(SPEC)
    svc = _by(objs, "Service", "kube-dns")
    assert svc["metadata"]["namespace"] == "kube-system"
    assert svc["spec"]["clusterIP"] == "10.96.0.10"
    assert "selector" not in svc["spec"]
    ports = {(p["name"], p["port"], p["protocol"]) for p in svc["spec"]["ports"]}
    assert ports == {("dns", 53, "UDP"), ("dns-tcp", 53, "TCP"), ("metrics", 9153, "TCP")}
    s = _by(objs, "EndpointSlice", "kube-dns-control-plane")
    labels = s["metadata"]["labels"]
    assert labels["kubernetes.io/service-name"] == "kube-dns"
    # Not the EndpointSlice controllers' own: they leave the slice alone.
    assert labels["endpointslice.kubernetes.io/managed-by"] not in (
        "endpointslice-controller.k8s.io",
        "endpointslicemirroring-controller.k8s.io",
    )
    assert s["addressType"] == "IPv4"
    assert s["endpoints"] == [
        {
            "addresses": [SPEC.api_address],
            "conditions": {"ready": True, "serving": True, "terminating": False},
        }
    ]
    # kube-proxy pairs Service and slice ports by name.
    assert {(p["name"], p["port"], p["protocol"]) for p in s["ports"]} == ports


def test_coredns_rbac_is_kubeadms_for_its_user() -> None:
    objs = addons.coredns_manifests(SPEC)
    role = _by(objs, "ClusterRole", "system:coredns")
    rules = {(g, r): tuple(rule["verbs"]) for rule in role["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}  # fmt: skip
    for resource in ("endpoints", "services", "pods", "namespaces"):
        assert rules[("", resource)] == ("list", "watch")
    assert rules[("discovery.k8s.io", "endpointslices")] == ("list", "watch")
    binding = _by(objs, "ClusterRoleBinding", "system:coredns")
    assert binding["roleRef"]["name"] == "system:coredns"
    assert binding["subjects"] == [
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:coredns"}
    ]


def test_metrics_server_objects_match_its_manifest() -> None:
    objs = addons.metrics_server_manifests(SPEC)
    reader = _by(objs, "ClusterRole", "system:aggregated-metrics-reader")
    for r in ("view", "edit", "admin"):
        assert reader["metadata"]["labels"][f"rbac.authorization.k8s.io/aggregate-to-{r}"] == "true"
    assert reader["rules"] == [
        {"apiGroups": ["metrics.k8s.io"], "resources": ["pods", "nodes"],
         "verbs": ["get", "list", "watch"]}
    ]  # fmt: skip
    role = _by(objs, "ClusterRole", "system:metrics-server")
    assert {"apiGroups": [""], "resources": ["nodes/metrics"], "verbs": ["get"]} in role["rules"]
    user = [
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:metrics-server"}
    ]
    delegator = _by(objs, "ClusterRoleBinding", "metrics-server:system:auth-delegator")
    assert delegator["roleRef"]["name"] == "system:auth-delegator"
    assert delegator["subjects"] == user
    assert _by(objs, "ClusterRoleBinding", "system:metrics-server")["subjects"] == user
    reader_binding = _by(objs, "RoleBinding", "metrics-server-auth-reader")
    assert reader_binding["metadata"]["namespace"] == "kube-system"
    assert reader_binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "extension-apiserver-authentication-reader",
    }
    svc = _by(objs, "Service", "metrics-server")
    assert "selector" not in svc["spec"]
    assert svc["spec"]["ports"] == [
        {"name": "https", "port": 443, "protocol": "TCP", "targetPort": 4443}
    ]
    s = _by(objs, "EndpointSlice", "metrics-server-control-plane")
    # The apiserver's endpoint resolver pairs the ports by name.
    assert s["ports"] == [{"name": "https", "port": 4443, "protocol": "TCP"}]
    assert s["endpoints"][0]["addresses"] == [SPEC.api_address]


def test_metrics_apiservice_verifies_with_the_cluster_ca() -> None:
    ca = pki.new_ca("k1 CA")
    obj = addons.metrics_apiservice(ca_pem=ca.cert)
    assert obj["metadata"]["name"] == "v1beta1.metrics.k8s.io"
    spec = obj["spec"]
    assert base64.b64decode(spec["caBundle"]) == ca.cert
    assert "insecureSkipTLSVerify" not in spec
    assert spec["service"] == {"name": "metrics-server", "namespace": "kube-system", "port": 443}
    assert (spec["group"], spec["version"]) == ("metrics.k8s.io", "v1beta1")


# --- the steps, on an in-memory control-plane node -------------------------------------------


class MemShell:
    """A NodeShell whose files live in a dict and whose daemons are names."""

    hostname = SPEC.api_hostname
    address = SPEC.api_address
    python = "python3"

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {"/etc/resolv.conf": b"# no DNS\n"}
        self.running: dict[str, list[str]] = {}
        self.starts: list[str] = []
        self.stops: list[str] = []

    async def run(
        self,
        argv: Sequence[str],
        *,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        timeout_s: float = 60.0,
        check: bool = True,
    ) -> CommandResult:
        return CommandResult(0, "", "")

    async def spawn(
        self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> None:
        if name not in self.running:
            self.running[name] = list(argv)
            self.starts.append(name)

    async def stop(self, name: str, *, timeout_s: float = 10.0) -> None:
        if self.running.pop(name, None) is not None:
            self.stops.append(name)

    async def is_running(self, name: str) -> bool:
        return name in self.running

    async def write_file(
        self, path: str, data: bytes, *, mode: int = 0o644, owner: str | None = None
    ) -> bool:
        if self.files.get(path) == data:
            return False
        self.files[path] = bytes(data)
        return True

    async def read_file(self, path: str) -> bytes | None:
        return self.files.get(path)

    def exec_argv(self, argv: Sequence[str], *, user: str | None = None) -> list[str]:
        return list(argv)


class RecordingAPI:
    def __init__(self, shell: MemShell) -> None:
        self.shell = shell
        self.applied: list[tuple[str, str, bool]] = []  # kind, name, metrics-server running

    async def apply(self, objs: list[dict[str, Any]]) -> None:
        running = addons.METRICS_SERVER in self.shell.running
        self.applied += [(o["kind"], o["metadata"]["name"], running) for o in objs]


def _cert(shell: MemShell, name: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(shell.files[cfg.pki_path(f"{name}.crt")])


def test_front_proxy_pki_is_made_once_and_reissued_by_the_same_rules() -> None:
    shell = MemShell()
    assert asyncio.run(stack.start_control_plane(shell, SPEC)) is True
    proxy_ca = _cert(shell, "front-proxy-ca")
    client = _cert(shell, "front-proxy-client")
    assert client.issuer == proxy_ca.subject
    assert pki.cert_subject(shell.files[cfg.pki_path("front-proxy-client.crt")]) == (
        "front-proxy-client",
        (),
    )
    cluster_ca = _cert(shell, "ca")
    assert proxy_ca.subject != cluster_ca.subject
    assert proxy_ca.public_key() != cluster_ca.public_key()
    assert shell.starts == [cfg.ETCD, cfg.APISERVER]

    # Again: nothing changes, nothing restarts.
    files = dict(shell.files)
    assert asyncio.run(stack.start_control_plane(shell, SPEC)) is False
    assert shell.files == files and shell.stops == []

    # A lost front-proxy CA key: a new CA, its client re-issued, the apiserver restarted.
    del shell.files[cfg.pki_path("front-proxy-ca.key")]
    assert asyncio.run(stack.start_control_plane(shell, SPEC)) is True
    assert _cert(shell, "front-proxy-ca").subject == proxy_ca.subject
    assert _cert(shell, "front-proxy-ca").public_key() != proxy_ca.public_key()
    assert _cert(shell, "front-proxy-client").issuer == proxy_ca.subject
    assert shell.stops == [cfg.APISERVER]
    # The cluster CA is untouched.
    assert _cert(shell, "ca").serial_number == cluster_ca.serial_number


def _prepare(shell: MemShell, **which: bool) -> stack.AddonPlan:
    ca = asyncio.run(stack.read_ca(shell))
    assert ca is not None
    args = {"coredns": True, "metrics_server": True, **which}
    return asyncio.run(stack.prepare_addons(shell, SPEC, ca, **args))


def test_addon_files_are_made_once_and_restart_only_on_change() -> None:
    shell = MemShell()
    asyncio.run(stack.start_control_plane(shell, SPEC))
    plan = _prepare(shell)
    assert plan == stack.AddonPlan(True, True, restart_coredns=True, restart_metrics_server=True)
    assert pki.cert_subject(shell.files[cfg.pki_path("coredns.crt")]) == ("system:coredns", ())
    assert pki.cert_subject(shell.files[cfg.pki_path("metrics-server.crt")]) == (
        "system:metrics-server",
        (),
    )
    serving = shell.files[cfg.pki_path("metrics-server-serving.crt")]
    assert "metrics-server.kube-system.svc" in pki.cert_sans(serving)
    assert SPEC.api_address in pki.cert_sans(serving)
    conf = json.loads(shell.files[addons.COREDNS_CONF])
    assert conf["users"][0]["name"] == "system:coredns"
    assert conf["clusters"][0]["cluster"]["server"] == SPEC.server
    assert "forward" not in shell.files[addons.COREFILE].decode()

    files = dict(shell.files)
    assert _prepare(shell) == stack.AddonPlan(True, True)
    assert shell.files == files

    # Resolvers appear on the node: the Corefile forwards, and CoreDNS's
    # reload plugin takes it up; no restart.
    shell.files["/etc/resolv.conf"] = b"nameserver 192.0.2.53\n"
    assert _prepare(shell) == stack.AddonPlan(True, True)
    assert "forward . /etc/resolv.conf" in shell.files[addons.COREFILE].decode()

    # An add-on not installed gets no files.
    fresh = MemShell()
    asyncio.run(stack.start_control_plane(fresh, SPEC))
    assert _prepare(fresh, coredns=False, metrics_server=False) == stack.AddonPlan(False, False)
    assert addons.COREFILE not in fresh.files
    assert cfg.pki_path("metrics-server.crt") not in fresh.files


def test_start_addons_registers_the_api_service_once_its_server_runs() -> None:
    shell = MemShell()
    asyncio.run(stack.start_control_plane(shell, SPEC))
    plan = _prepare(shell)
    api = RecordingAPI(shell)
    ca = shell.files[stack.CA_CERT]

    def start(plan: stack.AddonPlan, *, changed: bool = False) -> None:
        fake: Any = api  # only apply() is used
        asyncio.run(stack.start_addons(shell, fake, SPEC, BINS, plan, ca_pem=ca, changed=changed))

    start(plan)
    assert shell.running[addons.COREDNS] == addons.coredns_argv(BINS)
    assert shell.running[addons.METRICS_SERVER] == addons.metrics_server_argv(BINS, SPEC)
    kinds = [(k, running) for k, _, running in api.applied]
    # RBAC, Services and slices before the daemons; the APIService after.
    assert kinds[-1] == ("APIService", True)
    assert all(not running for _, running in kinds[:-1])
    assert {k for k, _ in kinds} == {
        "ClusterRole", "ClusterRoleBinding", "RoleBinding", "Service", "EndpointSlice",
        "APIService",
    }  # fmt: skip

    # Again with nothing changed: nothing restarts.
    start(stack.AddonPlan(True, True))
    assert shell.stops == []
    # The control plane's certificates changed (the front proxy's among
    # them): metrics-server, which reads them at start, restarts; CoreDNS not.
    start(stack.AddonPlan(True, True), changed=True)
    assert shell.stops == [addons.METRICS_SERVER]
    start(stack.AddonPlan(True, True, restart_coredns=True))
    assert shell.stops == [addons.METRICS_SERVER, addons.COREDNS]

    # Nothing installed: nothing applied, nothing started.
    api.applied.clear()
    start(stack.AddonPlan(False, False))
    assert api.applied == []
