"""Clusters across hosts, with hosts made of namespaces on this machine
(``support.nshosts``): each runs its own ``gpuclusters host-agent`` that the
server reaches only over the underlay, with mutual TLS; nodes of one
cluster on different hosts share its network over VXLAN.

The server runs the ``hosts`` provider (no embedded fleet: every GPU node is
on a host with an agent) and keeps the service nodes (Slurm controller and
login, Kubernetes control plane) on its own machine, as in production.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpuclusters.linux.layout import NodeLayout
from support.nshosts import AGENT_PORT, NsHost, NsHosts
from support.processes import free_port

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

pytestmark = pytest.mark.slow

SUBNET = 41  # 10.232.41.0/24: this module's underlay
AGENT_TIMEOUT_S = 6


class Lab:
    def __init__(self, server: ServerHandle, hosts: NsHosts, shared: Path) -> None:
        self.server = server
        self.hosts = hosts
        self.shared = shared

    def admin(self, *args: str, timeout: float = 300) -> str:
        r = self.server.cli(*args, timeout=timeout)
        assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def create(self, *args: str) -> dict[str, Any]:
        r = self.server.cli("clusters", "create", *args, "--wait", "--output", "json", timeout=420)
        if r.returncode != 0:
            logs = "\n".join(self.hosts.node_logs(h) for h in self.hosts.hosts)
            pytest.fail(f"create {args} failed:\n{r.stdout}\n{r.stderr}\n{logs[-12000:]}")
        return dict(json.loads(r.stdout))

    def json(self, *args: str, timeout: float = 300) -> Any:
        return json.loads(self.admin(*args, "--output", "json", timeout=timeout))

    def host(self, name: str) -> dict[str, Any]:
        return dict(self.json("hosts", "get", name))

    def ssh(self, cluster: str, *cmd: str, node: str | None = None) -> str:
        args = ["clusters", "ssh", cluster]
        if node:
            args += ["--node", node]
        return self.admin(*args, "--", *cmd)

    def _record(self, node: dict[str, Any]) -> tuple[NsHost, dict[str, Any]]:
        """The node's record in its host agent's state (the host's truth)."""
        host = _host(self, node["host"])
        state = json.loads((host.home / "netns-provider.json").read_text())
        (rec,) = [r for r in state["nodes"].values() if r["name"] == node["name"]]
        return host, rec

    def in_node(self, node: dict[str, Any], *argv: str, check: bool = True) -> Any:
        """Run ``argv`` in the network namespace of ``node``, on its host
        (the operator's view; users go through ssh and srun)."""
        host, rec = self._record(node)
        netns = NodeLayout(rec["node_id"], host.ns_dir, host.home / "nodes").netns
        return host.run("ip", "netns", "exec", netns, *argv, check=check)

    def address(self, node: dict[str, Any]) -> str:
        return str(self._record(node)[1]["address"])

    def nodes(self, cluster: str) -> list[dict[str, Any]]:
        return list(self.json("nodes", "list", "--cluster", cluster))


@pytest.fixture(scope="module")
def lab(module_servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("hosts")
    shared = root / "shared"  # the operator's shared filesystem, "mounted" on every host
    shared.mkdir()
    server = module_servers(provider="hosts", start=False)
    gateway = server.env["GPUCLUSTERS_PUBLIC_HOST"]
    hosts = NsHosts(root / "hosts", subnet_index=SUBNET, route_to=[gateway])
    try:
        hosts.up()
        tls_port = free_port()
        server.env.update(
            GPUCLUSTERS_TLS="on",
            GPUCLUSTERS_TLS_PORT=str(tls_port),
            GPUCLUSTERS_UNDERLAY_ADDRESS=hosts.gateway,
            GPUCLUSTERS_VOLUMES_DIR=str(shared),
            GPUCLUSTERS_HOST_AGENT_TIMEOUT_S=str(AGENT_TIMEOUT_S),
            GPUCLUSTERS_ACCESS_SYNC_INTERVAL_S="5",
        )
        server.start()
        lab = Lab(server, hosts, shared)
        for name in ("gpu-a", "gpu-b", "gpu-c"):
            host = hosts.add(name)
            token = lab.json("hosts", "join-token", name, "--ib-island", "ib-1")
            assert token["server_url"] == f"https://{gateway}:{tls_port}"
            hosts.join(
                host,
                server_url=token["server_url"],
                token=token["token"],
                ca_file=server.home / "tls" / "ca.pem",
                volumes_dir=shared,
            )
            hosts.start_agent(host)
        yield lab
    finally:
        module_servers.close()
        hosts.close()


def _host(lab: Lab | Any, name: str) -> NsHost:
    return next(h for h in lab.hosts.hosts if h.name == name)


def test_hosts_join_and_report_inventory(lab: Lab) -> None:
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        lab.server.wait_for(
            f"{name} ready",
            lambda n=name: lab.host(n)["agent_status"] == "ready",
            timeout=60,
            describe=lambda n=name: _host(lab, n).log.read_text()[-2000:],
        )
    host = lab.host("gpu-a")
    assert host["address"] == _host(lab, "gpu-a").address
    inv = host["inventory"]
    assert inv["cpus"] >= 1 and inv["memory_gib"] > 0
    # No GPUs on this machine: the host offers simulated ones, and says so.
    assert inv["gpu_count"] == 0 and inv["simulated_gpu_type"] == "H100_SXM"
    assert host["gpu_type"] == "H100_SXM" and host["num_gpus"] == 8
    # A join token works once, and an agent without a valid client
    # certificate of the control CA gets nothing from another host's agent.
    reuse = _host(lab, "gpu-a").gpuclusters(
        "host-agent", "join", "--server", "https://10.232.41.1:1", "--token", "gpc_x",
        "--name", "gpu-a", "--address", "10.0.0.1", "--ca-file", "/nonexistent",
    )  # fmt: skip
    assert reuse.returncode != 0
    b = _host(lab, "gpu-b")
    probe = subprocess.run(
        [*_host(lab, "gpu-a").enter(), "python3", "-c",
         "import ssl,socket,sys; c=ssl.create_default_context(); c.check_hostname=False; "
         "c.verify_mode=ssl.CERT_NONE; s=c.wrap_socket(socket.create_connection("
         f"('{b.address}', 8471), 5)); s.sendall(b'GET /v1/nodes HTTP/1.0\\r\\n\\r\\n'); "
         "print(s.recv(100))"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    # The handshake fails without a client certificate: no HTTP answer.
    assert "HTTP/1" not in probe.stdout, probe.stdout


def test_slurm_cluster_spans_two_hosts(lab: Lab) -> None:
    lab.admin("hosts", "cordon", "gpu-c")  # keep x on gpu-a and gpu-b
    cluster = lab.create("x", "--type", "slurm", "--gpus", "16")
    assert cluster["status"] == "ready"
    lab.admin("hosts", "uncordon", "gpu-c")
    nodes = lab.nodes("x")
    assert sorted(n["host"] for n in nodes) == ["gpu-a", "gpu-b"]
    # Each host holds its node's namespaces, with the cluster's VXLAN device.
    for name in ("gpu-a", "gpu-b"):
        vx = _vxlans(_host(lab, name))
        assert len(vx) == 1 and vx[0]["mtu"] == 1450, vx
    out = lab.ssh("x", "sbatch", "--wait", "-N2", "-o", "/mnt/shared/x-%j.out", "--wrap",
                  "srun hostname")  # fmt: skip
    job = out.split()[-1]
    printed = lab.ssh("x", "cat", f"/mnt/shared/x-{job}.out").split()
    assert sorted(printed) == sorted(n["name"] for n in nodes)
    # Written by a job on one host, read by a job on the other.
    a, b = sorted(nodes, key=lambda n: n["host"])
    lab.ssh("x", "srun", "-N1", "-w", a["name"], "sh", "-c",
            "hostname > /mnt/shared/from-a.txt")  # fmt: skip
    read = lab.ssh("x", "srun", "-N1", "-w", b["name"], "cat", "/mnt/shared/from-a.txt")
    assert read.strip() == a["name"]


def _series(lab: Lab, expr: str) -> list[dict[str, str]]:
    out = json.loads(lab.admin("metrics", "query", expr, "--output", "json"))
    return [item["metric"] for item in out["data"]["result"]]


def test_metrics_of_nodes_on_hosts_come_through_their_agents(lab: Lab) -> None:
    """The server's machine does not route to a host's cluster bridge: the
    metrics database scrapes each node through its host agent (HTTPS, the
    control plane's client certificate), and a job's GPU series still carry
    its id and its nodes' labels."""
    nodes = {n["name"]: n for n in lab.nodes("x")}
    targets = [t for t in lab.json("metrics", "targets") if t["labels"]["cluster"] == "x"]
    assert sorted(t["labels"]["node"] for t in targets) == sorted(nodes)
    for t in targets:
        node = nodes[t["labels"]["node"]]
        agent = _host(lab, node["host"])
        assert t["targets"] == [f"{agent.address}:{AGENT_PORT}"], t
        assert t["labels"]["__scheme__"] == "https", t
        assert t["labels"]["instance"] == f"{lab.address(node)}:9400", t
    # The boundary the proxy goes around: the node's own address does not
    # answer from the server's machine.
    some = next(iter(nodes.values()))
    direct = subprocess.run(
        ["curl", "-sS", "-m", "3", f"http://{lab.address(some)}:9400/metrics"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert direct.returncode != 0, direct.stdout[:300]
    lab.server.wait_for(
        "x's nodes scraped through their host agents",
        lambda: sorted(s["node"] for s in _series(lab, 'up{cluster="x"} == 1')) == sorted(nodes),
        timeout=90,
        describe=lambda: json.dumps(_series(lab, 'up{cluster="x"}')),
    )
    out = lab.ssh("x", "sbatch", "--wait", "-N2", "--gres=gpu:8", "--wrap", "srun sleep 25")
    job = out.split()[-1]
    series = _series(lab, f'max_over_time(DCGM_FI_DEV_GPU_UTIL{{slurm_job="{job}"}}[5m])')
    assert len(series) == 16, series
    assert sorted({(s["node"], s["host"]) for s in series}) == sorted(
        (n["name"], n["host"]) for n in nodes.values()
    )
    assert {s["slurm_user"] for s in series} == {lab.ssh("x", "id", "-un").strip()}, series


def test_a_new_member_runs_a_job_across_hosts(lab: Lab) -> None:
    """Accounts made after the cluster was ready reach the nodes on every
    host (the access sync goes through the agents) and the controller
    (slurmctld resolves the job's user)."""
    key = lab.json("api-keys", "create", "--user", "dora", "--project", "default",
                   "--role", "editor")["key"]  # fmt: skip
    env = {"GPUCLUSTERS_API_KEY": key}
    deadline = time.monotonic() + 60
    while True:
        r = lab.server.cli("clusters", "ssh", "x", "--", "srun", "-N2", "id", "-un", env=env,
                           timeout=120)  # fmt: skip
        if r.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    if r.returncode != 0:
        diag = lab.server.cli("clusters", "ssh", "x", "--as-root", "--", "sh", "-c",
                              "squeue -a -o '%i %u %T %R'; scontrol show job | head -30",
                              timeout=60)  # fmt: skip
        state = json.loads((lab.server.home / "netns-provider.json").read_text())
        ctl = next(r for r in state["nodes"].values() if r.get("role") == "controller")
        logs = subprocess.run(
            ["nsenter", f"--mount={ctl['ns_dir']}/{ctl['node_id']}.mnt", "tail", "-n", "40",
             "/var/log/gpuclusters/slurmctld.log"],
            capture_output=True, text=True,
        ).stdout  # fmt: skip
        pytest.fail(f"{r.stdout}{r.stderr}\n{diag.stdout}{diag.stderr}\n{logs[-8000:]}")
    assert r.stdout.split() == ["dora", "dora"]


def test_kubernetes_job_runs_across_hosts(lab: Lab, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "x.kubeconfig"
    lab.admin("clusters", "credentials", "x", "--file", str(kubeconfig))
    job = textwrap.dedent(
        """\
        apiVersion: batch/v1
        kind: Job
        metadata: {name: across}
        spec:
          completions: 2
          parallelism: 2
          template:
            spec:
              restartPolicy: Never
              containers:
              - name: main
                image: localhost/gpuclusters-base:latest
                command: ["sh", "-c", "echo $NODE; cat /etc/hostname"]
                env:
                - {name: NODE, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}
                resources: {limits: {nvidia.com/gpu: 8}}
        """
    )
    kubectl = ["kubectl", "--kubeconfig", str(kubeconfig)]
    subprocess.run([*kubectl, "apply", "-f", "-"], input=job, text=True, check=True,
                   capture_output=True, timeout=60)  # fmt: skip
    wait = [*kubectl, "wait", "--for=condition=complete", "job/across", "--timeout=240s"]
    done = subprocess.run(wait, capture_output=True, text=True, timeout=260)
    listed = subprocess.run(
        [*kubectl, "get", "pods", "-o", "json"], capture_output=True, text=True, check=True
    )
    pods = json.loads(listed.stdout)
    assert done.returncode == 0, (
        done.stderr + json.dumps([p["status"] for p in pods["items"]], indent=1)[-3000:]
    )
    assert sorted(p["spec"]["nodeName"] for p in pods["items"]) == sorted(
        n["name"] for n in lab.nodes("x")
    )
    # A pod on one host reaches the node on the other host by address:
    # pod routes and the segment carry it.
    a, b = sorted(lab.nodes("x"), key=lambda n: n["host"])
    lab.in_node(a, "ping", "-c1", "-W2", lab.address(b))


def test_two_clusters_across_hosts_are_isolated(lab: Lab) -> None:
    y = lab.create("y", "--type", "kubernetes", "--gpus", "8")
    assert y["status"] == "ready"
    (ynode,) = lab.nodes("y")
    assert ynode["host"] == "gpu-c"
    y_addr = lab.address(ynode)
    for xnode in lab.nodes("x"):
        x_addr = lab.address(xnode)
        assert lab.in_node(xnode, "ping", "-c1", "-W1", y_addr, check=False).returncode != 0
        assert lab.in_node(ynode, "ping", "-c1", "-W1", x_addr, check=False).returncode != 0
    # Each VNI carries one cluster: gpu-c has y's device only.
    vx = _vxlans(_host(lab, "gpu-c"))
    xa = _vxlans(_host(lab, "gpu-a"))
    assert len(vx) == 1 and len(xa) == 1
    assert vx[0]["linkinfo"]["info_data"]["id"] != xa[0]["linkinfo"]["info_data"]["id"]


def _vxlans(host: NsHost) -> list[dict[str, Any]]:
    return list(json.loads(host.run("ip", "-d", "-j", "link", "show", "type", "vxlan").stdout))


def test_a_host_whose_agent_dies_becomes_unreachable_and_nothing_is_deleted(lab: Lab) -> None:
    c = _host(lab, "gpu-c")
    (before,) = lab.nodes("y")
    _, rec = lab._record(before)
    lab.hosts.kill_agent(c)
    lab.server.wait_for(
        "gpu-c unreachable",
        lambda: lab.host("gpu-c")["agent_status"] == "unreachable",
        timeout=AGENT_TIMEOUT_S + 30,
    )

    # Its node's agent falls silent with it (its heartbeats go through the
    # host agent): housekeeping opens a heartbeat_missed alert on the node,
    # and deletes nothing: the node is still the cluster's, still there.
    def missed() -> bool:
        alerts = lab.json("alerts", "list", "--cluster", "y")
        return any(a["kind"] == "heartbeat_missed" and a["node"] == before["name"] for a in alerts)

    lab.server.wait_for("y's node's heartbeat_missed alert", missed, timeout=90)
    (after,) = lab.nodes("y")
    assert after["name"] == before["name"] and after["phase"] not in ("deleted", "failed")
    state = json.loads((c.home / "netns-provider.json").read_text())
    assert rec["node_id"] in state["nodes"]
    assert c.run("ip", "netns", "list").stdout.count("gpc-") >= 1
    lab.hosts.start_agent(c)
    lab.server.wait_for("gpu-c ready again", lambda: lab.host("gpu-c")["agent_status"] == "ready",
             timeout=60)  # fmt: skip
    lab.server.wait_for(
        "y's node running", lambda: lab.nodes("y")[0]["phase"] == "running", timeout=120
    )


def test_delete_leaves_nothing_on_the_hosts(lab: Lab) -> None:
    lab.admin("clusters", "delete", "x", "--wait", timeout=600)
    lab.admin("clusters", "delete", "y", "--wait", timeout=600)
    for host in lab.hosts.hosts:
        assert lab.hosts.leftovers(host) == [], host.name
        state = json.loads((host.home / "netns-provider.json").read_text())
        assert state["nodes"] == {} and state["networks"] == {}, host.name
    # And the server's machine keeps no segment of them either.
    vx = json.loads(subprocess.run(["ip", "-j", "link", "show", "type", "vxlan"],
                                   capture_output=True, text=True).stdout or "[]")  # fmt: skip
    assert not [v for v in vx if str(v["ifname"]).startswith("gpcx")]
    # An empty host can be drained and removed; it then gets nothing.
    lab.admin("hosts", "drain", "gpu-c")
    removed = lab.json("hosts", "remove", "gpu-c")
    assert removed["agent_status"] == "removed"
    assert "gpu-c" not in [h["name"] for h in lab.json("hosts", "list")]
