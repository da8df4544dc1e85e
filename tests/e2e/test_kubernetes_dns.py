"""Cluster DNS, the control plane reaching pods, and metrics-server, end to
end on the embedded fleet (netns provider), through the real server:

* CoreDNS on the control-plane node answers pods at ``10.96.0.10`` (kube-proxy
  DNATs it across the cluster bridge): Services, headless Services (pod
  IPs), pod names by IP, and the cluster's node names (the control-plane
  node's /etc/hosts, which lists every member);
* the apiserver reaches pods and kubelets: ``kubectl logs``/``exec``, the
  pod proxy, and the control-plane node's own route to a pod;
* metrics-server, an aggregated API served from the control-plane node
  (``--enable-aggregator-routing``, front-proxy authentication):
  ``kubectl top nodes`` and ``kubectl top pods`` answer;
* a node that joins later resolves by name within seconds;
* a server restart re-runs the control-plane step and restarts nothing.

One cluster with two GPU nodes serves every test of the module. Needs root,
containerd and the binaries of ``scripts/build-k8s`` and
``scripts/build-k8s-addons`` (coredns, metrics-server).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpuclusters.layers.kubernetes import addons
from gpuclusters.layers.kubernetes.config import DEFAULT_BIN_DIR
from gpuclusters.linux.layout import NodeLayout
from support.servers import wait_for

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

KUBECTL = DEFAULT_BIN_DIR / "kubectl"
ADDONS = addons.DEFAULT_BIN_DIR
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the embedded fleet needs root"),
    pytest.mark.skipif(
        not KUBECTL.exists() or shutil.which("containerd") is None,
        reason="run scripts/setup first (Kubernetes binaries, containerd)",
    ),
    pytest.mark.skipif(
        not (ADDONS / "coredns").exists() or not (ADDONS / "metrics-server").exists(),
        reason="run scripts/build-k8s-addons first (coredns, metrics-server)",
    ),
]

CLUSTER = "dns1"

# A web server behind a ClusterIP Service and a headless one, on the first node.
WEB = """\
apiVersion: v1
kind: Pod
metadata: {name: web, labels: {app: web}}
spec:
  nodeName: {node}
  terminationGracePeriodSeconds: 0
  containers:
  - name: web
    image: localhost/gpuclusters-base:latest
    command: ["sh", "-c", "mkdir -p /www && echo hello-from-web > /www/index.html && \
exec httpd -f -p 8080 -h /www"]
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  selector: {app: web}
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: web-headless}
spec:
  clusterIP: None
  selector: {app: web}
  ports: [{port: 8080}]
"""

# Runs on the other node: every lookup a pod makes. busybox's nslookup asks
# the nameserver directly; libc's resolver (search domains, ndots, as
# applications resolve) is the host's getent with the host's glibc, mounted
# read-only: the base image's static busybox cannot resolve through libc.
PROBE = """\
apiVersion: v1
kind: Pod
metadata: {name: probe}
spec:
  nodeName: {node}
  restartPolicy: Never
  containers:
  - name: main
    image: localhost/gpuclusters-base:latest
    command: ["sh", "-c", {script}]
    volumeMounts:
    - {name: lib, mountPath: /hostlib, readOnly: true}
    - {name: getent, mountPath: /getent, readOnly: true}
  volumes:
  - name: lib
    hostPath: {path: {libdir}, type: Directory}
  - name: getent
    hostPath: {path: /usr/bin/getent, type: File}
"""
LD_SO = Path("/lib64/ld-linux-x86-64.so.2")


def probe_script(names: list[str], pod_dashed: str) -> str:
    # Each check prints "<name>=<answers>".
    lines = [
        "echo RESOLV; cat /etc/resolv.conf; echo END",
        # The first lookups may race kube-proxy's rules on a fresh node.
        "for i in $(seq 1 30); do nslookup kubernetes.default.svc.cluster.local "
        ">/dev/null 2>&1 && break; sleep 1; done",
    ]

    def lookup(key: str, name: str) -> None:
        lines.append(
            f'echo "{key}=$(nslookup {name} 2>/dev/null | '
            "sed -n '/^Name:/,$ s/^Address:* *//p' | sort | tr '\\n' ' ')\""
        )

    def getent(key: str, name: str) -> None:
        lines.append(
            f'echo "{key}=$(/hostlib/{LD_SO.name} --library-path /hostlib /getent ahostsv4 '
            f"{name} | awk '{{print $1}}' | sort -u | tr '\\n' ' ')\""
        )

    lookup("kubernetes", "kubernetes.default.svc.cluster.local")
    lookup("web", "web.default.svc.cluster.local")
    lookup("headless", "web-headless.default.svc.cluster.local")
    lookup("pod", f"{pod_dashed}.default.pod.cluster.local")
    # A trailing dot: busybox's nslookup tries only the search domains
    # for a name with fewer dots than ndots, never the name itself.
    for i, n in enumerate(names):
        lookup(f"node{i}", f"{n}.")
    lookup("missing", "no-such-service.default.svc.cluster.local")
    getent("libc_web", "web")
    getent("libc_headless", "web-headless")
    getent("libc_kubernetes", "kubernetes.default")
    getent("libc_node", names[0])
    getent("libc_outside", "no-such-name.example")
    return json.dumps("\n".join(lines))


@dataclass
class Cluster:
    server: ServerHandle
    kubeconfig: Path
    nodes: dict[str, str]  # name -> address
    cp: NodeLayout
    cp_address: str
    cp_hostname: str
    cluster_id: str


def cli_ok(server: ServerHandle, *args: str) -> str:
    r = server.cli(*args, timeout=300)
    assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def kubectl(
    kubeconfig: Path, *args: str, stdin: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(
        [str(KUBECTL), f"--kubeconfig={kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if check:
        assert r.returncode == 0, f"kubectl {' '.join(args)}\n{r.stdout}\n{r.stderr}"
    return r


def kjson(kubeconfig: Path, *args: str) -> Any:
    return json.loads(kubectl(kubeconfig, *args, "-o", "json").stdout)


def run_to_completion(cluster: Cluster, pod: str, manifest: str) -> str:
    """Apply a one-shot pod's manifest; its logs once it has finished."""
    kubectl(cluster.kubeconfig, "apply", "-f", "-", stdin=manifest)
    wait_for(
        f"pod {pod} to finish",
        lambda: (
            kjson(cluster.kubeconfig, "get", "pod", pod)["status"]["phase"]
            in ("Succeeded", "Failed")
        ),
        timeout=120,
        interval=0.5,
    )
    return kubectl(cluster.kubeconfig, "logs", pod).stdout


def in_node(node: NodeLayout, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nsenter", *node.nsenter_args(), "--", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def daemon_pids(node: NodeLayout) -> dict[str, int]:
    """The control-plane node's daemons by program name (its netns's processes)."""
    pids = subprocess.run(
        ["ip", "netns", "pids", node.netns], capture_output=True, text=True, check=True
    ).stdout.split()
    out = {}
    for pid in pids:
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        out[Path(argv0).name] = int(pid)
    return out


@pytest.fixture(scope="module")
def cluster(module_servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    server = module_servers(provider="netns")
    start = time.monotonic()
    created = json.loads(
        cli_ok(server, "clusters", "create", CLUSTER, "--type", "kubernetes", "--gpus", "16",
               "--wait", "--output", "json")
    )  # fmt: skip
    print(f"cluster {CLUSTER} ready in {time.monotonic() - start:.1f}s")
    assert created["status"] == "ready" and len(created["nodes"]) == 2
    kubeconfig = tmp_path_factory.mktemp("kube") / "admin.kubeconfig"
    cli_ok(server, "clusters", "credentials", CLUSTER, "--file", str(kubeconfig))
    state = json.loads((server.home / "netns-provider.json").read_text())["nodes"]
    cp_rec = next(r for r in state.values() if r.get("role") == "control-plane")
    nodes = {r["hostname"]: r["address"] for r in state.values() if r["kind"] == "gpu"}
    assert sorted(nodes) == sorted(n["name"] for n in created["nodes"])
    yield Cluster(
        server=server,
        kubeconfig=kubeconfig,
        nodes=nodes,
        cp=NodeLayout(cp_rec["node_id"], Path(cp_rec["ns_dir"]), Path(cp_rec["nodes_dir"])),
        cp_address=cp_rec["address"],
        cp_hostname=cp_rec["hostname"],
        cluster_id=cp_rec["cluster_id"],
    )
    cli_ok(server, "clusters", "delete", CLUSTER, "--wait")


@pytest.fixture(scope="module")
def web(cluster: Cluster) -> dict[str, Any]:
    """The web pod, Running, on the first node."""
    first = sorted(cluster.nodes)[0]
    kubectl(cluster.kubeconfig, "apply", "-f", "-", stdin=WEB.replace("{node}", first))

    def running() -> dict[str, Any] | None:
        pod: dict[str, Any] = kjson(cluster.kubeconfig, "get", "pod", "web")
        return pod if pod["status"].get("phase") == "Running" else None

    pod: dict[str, Any] = wait_for("web running", running, timeout=90, interval=0.5)
    return pod


def test_control_plane_node_serves_dns_and_metrics(cluster: Cluster) -> None:
    # The control-plane node's /etc/hosts names every member of the cluster.
    hosts = in_node(cluster.cp, "cat", "/etc/hosts").stdout
    entries = {ln.split()[1]: ln.split()[0] for ln in hosts.splitlines() if ln.strip()}
    for name, address in {**cluster.nodes, cluster.cp_hostname: cluster.cp_address}.items():
        assert entries.get(name) == address, hosts
    # The node has no resolvers, so CoreDNS forwards nowhere.
    assert "nameserver" not in in_node(cluster.cp, "cat", "/etc/resolv.conf").stdout
    corefile = in_node(cluster.cp, "cat", addons.COREFILE).stdout
    assert "kubernetes cluster.local in-addr.arpa ip6.arpa" in corefile
    assert "forward" not in corefile
    # Health and readiness on the node's loopback.
    for url in (f"http://{addons.COREDNS_HEALTH}/health", f"http://{addons.COREDNS_READY}/ready"):
        r = in_node(cluster.cp, "curl", "-fsS", "--max-time", "5", url)
        assert r.returncode == 0 and r.stdout.strip() == "OK", (url, r.stderr)
    pids = daemon_pids(cluster.cp)
    assert {"coredns", "metrics-server", "kube-apiserver", "etcd"} <= set(pids)

    # kube-dns: the well-known ClusterIP, no selector, our EndpointSlice.
    svc = kjson(cluster.kubeconfig, "-n", "kube-system", "get", "service", "kube-dns")
    assert svc["spec"]["clusterIP"] == "10.96.0.10"
    assert "selector" not in svc["spec"]
    assert {(p["port"], p["protocol"]) for p in svc["spec"]["ports"]} == {
        (53, "UDP"),
        (53, "TCP"),
        (9153, "TCP"),
    }
    slices = kjson(cluster.kubeconfig, "-n", "kube-system", "get", "endpointslices", "-l",
                   "kubernetes.io/service-name=kube-dns")["items"]  # fmt: skip
    assert [e["addresses"] for s in slices for e in s["endpoints"]] == [[cluster.cp_address]]

    # The metrics API is registered with a CA bundle and available.
    api = kjson(cluster.kubeconfig, "get", "apiservice", addons.METRICS_API)
    assert api["spec"]["caBundle"] and not api["spec"].get("insecureSkipTLSVerify")

    def available() -> bool:
        obj = kjson(cluster.kubeconfig, "get", "apiservice", addons.METRICS_API)
        conds = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}
        return conds.get("Available") == "True"

    wait_for("the metrics APIService available", available, timeout=60, interval=0.5)


def test_pods_resolve_services_pods_and_nodes(cluster: Cluster, web: dict[str, Any]) -> None:
    names = sorted(cluster.nodes)
    pod_ip = web["status"]["podIP"]
    web_ip = kjson(cluster.kubeconfig, "get", "service", "web")["spec"]["clusterIP"]
    script = probe_script(names, pod_ip.replace(".", "-"))
    manifest = (
        PROBE.replace("{node}", names[1])
        .replace("{script}", script)
        .replace("{libdir}", str(LD_SO.resolve().parent))
    )
    out = run_to_completion(cluster, "probe", manifest)
    resolv = out.split("RESOLV\n", 1)[1].split("END\n", 1)[0]
    answers = dict(
        line.split("=", 1) for line in out.split("END\n", 1)[1].splitlines() if "=" in line
    )
    answers = {k: v.strip() for k, v in answers.items()}
    print(out)
    # kubelet gave the pod the cluster's nameserver and search domains.
    assert "nameserver 10.96.0.10" in resolv
    assert "search default.svc.cluster.local svc.cluster.local cluster.local" in resolv
    assert answers["kubernetes"] == "10.96.0.1"
    assert answers["web"] == web_ip
    assert answers["headless"] == pod_ip  # a headless Service names its pods
    assert answers["pod"] == pod_ip
    for i, n in enumerate(names):
        assert answers[f"node{i}"] == cluster.nodes[n], n
    assert answers["missing"] == ""
    # libc's resolver: short names through the search domains, node names.
    assert answers["libc_web"] == web_ip
    assert answers["libc_headless"] == pod_ip
    assert answers["libc_kubernetes"] == "10.96.0.1"
    assert answers["libc_node"] == cluster.nodes[names[0]]
    assert answers["libc_outside"] == ""  # no upstream resolvers: not found, at once


def test_control_plane_reaches_pods_and_kubelets(cluster: Cluster, web: dict[str, Any]) -> None:
    pod_ip = web["status"]["podIP"]
    # The control-plane node routes the pod CIDR to the node.
    r = in_node(cluster.cp, "curl", "-fsS", "--max-time", "5", f"http://{pod_ip}:8080/")
    assert r.returncode == 0 and r.stdout.strip() == "hello-from-web", r.stderr
    # apiserver -> pod IP (the pod proxy), apiserver -> kubelet (exec, logs).
    raw = kubectl(
        cluster.kubeconfig, "get", "--raw", "/api/v1/namespaces/default/pods/web:8080/proxy/"
    )
    assert raw.stdout.strip() == "hello-from-web"
    svc = kubectl(
        cluster.kubeconfig, "get", "--raw", "/api/v1/namespaces/default/services/web:80/proxy/"
    )
    assert svc.stdout.strip() == "hello-from-web"
    assert (
        kubectl(cluster.kubeconfig, "exec", "web", "--", "cat", "/www/index.html").stdout.strip()
        == "hello-from-web"
    )
    kubectl(cluster.kubeconfig, "logs", "web")


REFUSED_PROBE = """\
apiVersion: v1
kind: Pod
metadata: {name: refused}
spec:
  nodeName: {node}
  restartPolicy: Never
  containers:
  - name: main
    image: localhost/gpuclusters-base:latest
    command: ["sh", "-c", {script}]
"""


def test_service_addresses_without_a_rule_are_refused(
    cluster: Cluster, web: dict[str, Any]
) -> None:
    """A port the Service does not have, and an address no Service holds,
    are refused on the node (TCP reset), never sent out of the cluster,
    while the Service's own port works (conformance: a removed Service
    port must stop answering)."""
    web_ip = kjson(cluster.kubeconfig, "get", "service", "web")["spec"]["clusterIP"]
    script = (
        f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 10 {web_ip} 80; echo served=$?; "
        f"nc -w 10 {web_ip} 81 </dev/null; echo other_port=$?; "
        "nc -w 10 10.96.255.254 80 </dev/null; echo no_service=$?"
    )
    manifest = REFUSED_PROBE.replace("{node}", sorted(cluster.nodes)[1]).replace(
        "{script}", json.dumps(script)
    )
    out = run_to_completion(cluster, "refused", manifest)
    print(out)
    assert "hello-from-web" in out and "served=0" in out
    # busybox nc says why: a reset is "refused" (a timeout or an answer
    # from beyond the node would read otherwise).
    assert "other_port=1" in out and "no_service=1" in out
    assert out.count("Connection refused") == 2, out


def test_kubectl_top(cluster: Cluster, web: dict[str, Any]) -> None:
    def top_nodes() -> dict[str, list[str]] | None:
        r = kubectl(cluster.kubeconfig, "top", "nodes", "--no-headers", check=False)
        rows = {ln.split()[0]: ln.split()[1:] for ln in r.stdout.splitlines() if ln.strip()}
        # kubectl lists every node, with "<unknown>" for one metrics-server
        # has not scraped yet (it scrapes each node every 15 s): wait for
        # figures on all of them.
        scraped = all("<unknown>" not in values for values in rows.values())
        return rows if set(rows) == set(cluster.nodes) and scraped else None

    start = time.monotonic()
    rows = wait_for("kubectl top nodes", top_nodes, timeout=120, interval=0.5)
    print(f"top nodes after {time.monotonic() - start:.1f}s: {rows}")
    for cpu, _, memory, _ in rows.values():
        assert cpu.endswith("m") and memory.endswith("Mi"), rows

    def top_pods() -> list[str] | None:
        r = kubectl(cluster.kubeconfig, "top", "pods", "--no-headers", check=False)
        names = [ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()]
        return names if "web" in names else None

    wait_for("kubectl top pods", top_pods, timeout=120, interval=0.5)
    # metrics.k8s.io through the aggregation layer, as any client sees it.
    raw = kubectl(cluster.kubeconfig, "get", "--raw", "/apis/metrics.k8s.io/v1beta1/nodes")
    metrics = json.loads(raw.stdout)
    assert {i["metadata"]["name"] for i in metrics["items"]} == set(cluster.nodes)


def test_a_joining_node_is_resolvable(cluster: Cluster, web: dict[str, Any]) -> None:
    """The provider adds a joining node to the cluster's /etc/hosts (the
    control-plane node's too, by bind mount); CoreDNS re-reads it."""
    cli_ok(cluster.server, "clusters", "scale", CLUSTER, "--gpus", "24")

    def third() -> tuple[str, str] | None:
        state = json.loads((cluster.server.home / "netns-provider.json").read_text())["nodes"]
        new = {r["hostname"]: r["address"] for r in state.values() if r["kind"] == "gpu"}
        added = sorted(set(new) - set(cluster.nodes))
        return (added[0], new[added[0]]) if added else None

    name, address = cluster.server.wait_for("a third node", third, timeout=120)
    start = time.monotonic()

    def resolved() -> bool:
        r = kubectl(cluster.kubeconfig, "exec", "web", "--", "nslookup", f"{name}.", check=False)
        return f"Address: {address}" in r.stdout

    wait_for(f"{name} in DNS", resolved, timeout=60, interval=0.5)
    print(f"{name} resolvable {time.monotonic() - start:.1f}s after its record")

    # And it joins: the cluster is ready again with three nodes.
    def ready_with_three() -> bool:
        got = json.loads(cli_ok(cluster.server, "clusters", "get", CLUSTER, "-o", "json"))
        return got["status"] == "ready" and len(got["nodes"]) == 3

    cluster.server.wait_for("the cluster ready with 3 nodes", ready_with_three, timeout=180)


def test_server_restart_restarts_nothing(cluster: Cluster) -> None:
    """The first look at a ready cluster after a crash (kill -9) re-runs
    the control-plane step: every file is already right, so no daemon
    restarts."""
    before = daemon_pids(cluster.cp)
    marker = f"Kubernetes control plane of {CLUSTER} up"
    seen = cluster.server.log.count(marker)
    cluster.server.kill9()
    cluster.server.start()
    cluster.server.wait_for(
        "the control-plane step after the restart",
        lambda: cluster.server.log.count(marker) > seen,
        timeout=120,
    )
    after = daemon_pids(cluster.cp)
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                 "coredns", "metrics-server"):  # fmt: skip
        assert after[name] == before[name], name
