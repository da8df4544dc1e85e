"""Metrics on the embedded fleet, as users get them (docs/metrics.md).

The server runs VictoriaMetrics, which scrapes every node agent it learns
of from the server's service discovery. The project editor works from the
laptop (own network namespace, non-root account, the CLI and kubectl): a
Slurm job's GPU series carry its job id and user, a pod's carry its
namespace and name; a member of another project querying the same series
gets none, where an operator's unconfined query shows them (so the test
fails if the confinement is absent); the history outlives a server
restart.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from netlab import Laptop

from gpuclusters.server.settings import Settings
from support.processes import free_port

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces need root"),
    pytest.mark.skipif(shutil.which("slurmctld") is None, reason="run scripts/setup first"),
    pytest.mark.skipif(
        not Settings().metrics_db_bin.is_file(), reason="run scripts/build-k8s-addons first"
    ),
]
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class World:
    def __init__(self, server: ServerHandle, laptop: Laptop) -> None:
        self.server = server
        self.laptop = laptop
        self.job_id = ""
        self.keys: dict[str, str] = {}

    def admin(self, *args: str, timeout: float = 240) -> str:
        r = self.server.cli(*args, timeout=timeout)
        assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def user(self, who: str, *args: str, timeout: float = 120) -> Any:
        """``gpuclusters`` on the laptop with ``who``'s configuration."""
        return self.laptop.run(
            "gpuclusters", *args, env={"GPUCLUSTERS_HOME": f"{self.laptop.home}/{who}"},
            timeout=timeout,
        )  # fmt: skip

    def ok(self, who: str, *args: str, timeout: float = 120) -> str:
        r = self.user(who, *args, timeout=timeout)
        assert r.returncode == 0, f"{who}: gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return str(r.stdout)

    def series(self, who: str, expr: str, *more: str) -> list[dict[str, str]]:
        out = self.ok(who, "metrics", "query", expr, "--output", "json", *more)
        return [item["metric"] for item in json.loads(out)["data"]["result"]]

    def kubectl(self, *args: str, stdin: str | None = None) -> Any:
        kc = f"{self.laptop.home}/kubeconfig"
        return self.laptop.run("kubectl", "--kubeconfig", kc, *args, stdin=stdin, timeout=120)


@pytest.fixture(scope="module")
def world(module_servers: Servers) -> Iterator[World]:
    laptop = Laptop(PROJECT_ROOT)
    try:
        laptop.up()
        server = module_servers(provider="netns", start=False, public_host=laptop.gateway)
        server.env["GPUCLUSTERS_TLS_PORT"] = str(free_port())
        server.env["GPUCLUSTERS_METRICS_SCRAPE_INTERVAL_S"] = "2"
        server.start()
        yield World(server, laptop)
    finally:
        module_servers.close()
        laptop.close()


def _login(world: World, who: str, user: str, project: str) -> None:
    created = world.admin("api-keys", "create", "--user", user, "--project", project,
                          "--role", "editor", "--output", "json")  # fmt: skip
    key = json.loads(created)["key"]
    world.keys[who] = key
    laptop = world.laptop
    (laptop.home / "ca.pem").write_bytes((world.server.home / "tls" / "ca.pem").read_bytes())
    url = f"https://{laptop.gateway}:{world.server.env['GPUCLUSTERS_TLS_PORT']}"
    world.laptop.run("mkdir", "-p", f"{laptop.home}/{who}", check=True)
    world.ok(who, "login", "--url", url, "--api-key", key, "--ca-file", f"{laptop.home}/ca.pem",
             "--project", project)  # fmt: skip


def test_a_slurm_jobs_gpu_series_carry_its_job_and_user(world: World) -> None:
    """The issue's acceptance: a two-node job's 16 GPUs, by its job id."""
    laptop = world.laptop
    world.admin("projects", "create", "other")
    _login(world, "alice", laptop.user, "default")
    _login(world, "bob", "bob", "other")
    world.admin("clusters", "create", "met", "--type", "slurm", "--gpus", "16", "--wait",
                timeout=300)  # fmt: skip
    # The agents are scraped (every 5 s here) before the job starts.
    world.server.wait_for(
        "both nodes' GPU series",
        lambda: len(world.series("alice", 'DCGM_FI_DEV_GPU_UTIL{cluster="met"}')) == 16,
        timeout=120,
        interval=2,
        describe=lambda: world.admin("metrics", "targets"),
    )
    # the operator's view of what is scraped: both nodes, with their labels
    targets = json.loads(world.admin("metrics", "targets", "--output", "json"))
    assert sorted(t["labels"]["cluster"] for t in targets) == ["met", "met"], targets
    assert all(t["targets"][0].endswith(":9400") for t in targets), targets
    assert world.user("alice", "metrics", "targets").returncode != 0, "operators only"
    out = world.ok("alice", "clusters", "ssh", "met", "--", "sbatch", "--wait", "-N2",
                   "--gres=gpu:8", "--wrap", "srun sleep 30", timeout=240)  # fmt: skip
    found_id = re.search(r"Submitted batch job (\d+)", out)
    assert found_id, out
    world.job_id = found_id[1]
    expr = f'avg_over_time(DCGM_FI_DEV_GPU_UTIL{{slurm_job="{world.job_id}"}}[5m])'
    found = world.series("alice", expr)
    assert len(found) == 16, found
    assert len({(s["node"], s["gpu"]) for s in found}) == 16
    assert {s["slurm_user"] for s in found} == {laptop.user}
    assert {s["project"] for s in found} == {"default"}
    assert all(s["UUID"].startswith("GPU-") for s in found)
    # the node's own series too
    rx = world.series("alice", 'gpuclusters_node_network_receive_bytes_total{cluster="met"}')
    assert {s["interface"] for s in rx} >= {"eth0"}

    # Another project's member: nothing of it, however asked. An operator's
    # unconfined query shows the series are there to be had.
    assert world.series("bob", expr) == []
    assert world.series("bob", '{__name__=~"DCGM_.+"}') == []
    assert world.series("bob", f'{{slurm_job="{world.job_id}"}}') == []
    admin = json.loads(world.admin("metrics", "query", expr, "--output", "json"))
    assert len(admin["data"]["result"]) == 16
    refused = world.user("bob", "metrics", "query", expr, "--project", "default")
    assert refused.returncode != 0 and "not found" in refused.stdout + refused.stderr

    # The console's job view: exactly those 16 GPUs, for alice; not for bob.
    with httpx.Client(base_url=world.server.url, timeout=30) as browser:
        assert browser.post("/login", data={"api_key": world.keys["alice"]}).status_code == 303
        view = browser.get("/projects/default/clusters/met/workloads", params={"job": world.job_id})
        assert view.status_code == 200 and f"Slurm job {world.job_id}" in view.text
        chart = browser.get("/projects/default/clusters/met/workloads/telemetry",
                            params={"job": world.job_id}).json()  # fmt: skip
        assert len(chart["gpus"]) == 16 and chart["t"], chart
    with httpx.Client(base_url=world.server.url, timeout=30) as browser:
        assert browser.post("/login", data={"api_key": world.keys["bob"]}).status_code == 303
        r = browser.get("/projects/default/clusters/met/workloads/telemetry",
                        params={"job": world.job_id})  # fmt: skip
        assert r.status_code == 404


def test_a_pods_gpu_series_carry_its_namespace_and_name(world: World) -> None:
    assert world.job_id, "needs the cluster of the test before"
    world.ok("alice", "clusters", "credentials", "met", "--file",
             f"{world.laptop.home}/kubeconfig")  # fmt: skip
    pod = """apiVersion: v1
kind: Pod
metadata: {name: gpu-user}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: localhost/gpuclusters-base:latest
    command: ["sleep", "300"]
    resources: {limits: {nvidia.com/gpu: 1}}
"""
    applied = world.kubectl("apply", "-f", "-", stdin=pod)
    assert applied.returncode == 0, applied.stderr
    world.server.wait_for(
        "the pod to run",
        lambda: world.kubectl("get", "pod", "gpu-user", "-o", "jsonpath={.status.phase}")
        .stdout.strip() == "Running",
        timeout=120,
        interval=1,
    )  # fmt: skip
    found = world.server.wait_for(
        "the pod's GPU series",
        lambda: world.series("alice", 'DCGM_FI_DEV_GPU_UTIL{cluster="met",pod="gpu-user"}'),
        timeout=60,
        interval=2,
    )
    assert [(s["namespace"], s["pod"], s["container"]) for s in found] == [
        ("default", "gpu-user", "main")
    ]
    world.kubectl("delete", "pod", "gpu-user", "--now")


def test_an_injected_fault_fires_its_alert_as_an_event(world: World) -> None:
    assert world.job_id, "needs the cluster of the tests before"
    nodes = json.loads(world.ok("alice", "nodes", "list", "--cluster", "met", "-o", "json"))
    node = nodes[0]["name"]
    # Xid 13 (an application's fault): the health checks warn, nothing repairs.
    world.admin("nodes", "inject-fault", node, "--kind", "xid", "--code", "13", "--gpu", "3")
    try:
        xid = world.server.wait_for(
            "the Xid in the metrics",
            lambda: world.series("alice", f'DCGM_FI_DEV_XID_ERRORS{{node="{node}",gpu="3"}} > 0'),
            timeout=60,
            interval=2,
        )
        assert len(xid) == 1

        def fired() -> list[dict[str, Any]]:
            listed = json.loads(world.ok("alice", "events", "-o", "json"))
            return [e for e in listed if e["reason"] == "GpuXidError" and e["node"] == node]

        [event] = world.server.wait_for("the GpuXidError event", fired, timeout=90, interval=2)
        assert "reported Xid 13" in event["message"], event
        # the alert is a series of the project's too (vmalert writes it to
        # the database in batches, flushed every few seconds)
        alerts = world.server.wait_for(
            "the ALERTS series",
            lambda: world.series("alice", 'ALERTS{alertname="GpuXidError",alertstate="firing"}'),
            timeout=60,
            interval=2,
        )
        assert {a["node"] for a in alerts} == {node}
        assert world.series("bob", 'ALERTS{alertname="GpuXidError"}') == []
    finally:
        world.admin("nodes", "inject-fault", node, "--kind", "clear")


PROBE = """gw=$(ip route | awk '/default/ {print $3; exit}')
for p in %s; do
  if timeout 3 bash -c "exec 3<>/dev/tcp/$gw/$p" 2>/dev/null
  then echo "$p open"; else echo "$p closed"; fi
done"""


def test_nodes_cannot_reach_the_metrics_database(world: World) -> None:
    """A node (as its root) reaches the server's machine on the registry's
    port, which shows the probe finds an open port, and not on the metrics
    database's or the rule engine's; the server's machine itself does."""
    assert world.job_id, "needs the cluster of the tests before"
    env = world.server.env
    ports = [env["GPUCLUSTERS_REGISTRY_PORT"], env["GPUCLUSTERS_METRICS_DB_PORT"],
             env["GPUCLUSTERS_METRICS_ALERT_PORT"]]  # fmt: skip
    out = world.admin("clusters", "ssh", "met", "--as-root", "--", "bash", "-c",
                      PROBE % " ".join(ports))  # fmt: skip
    assert f"{ports[0]} open" in out, out
    assert f"{ports[1]} closed" in out and f"{ports[2]} closed" in out, out
    with socket.create_connection(("127.0.0.1", int(ports[1])), timeout=3):
        pass  # the database does listen, on the server's loopback


def test_metrics_need_a_key_and_the_history_outlives_a_restart(world: World) -> None:
    assert world.job_id, "needs the cluster of the tests before"
    laptop = world.laptop
    url = f"https://{laptop.gateway}:{world.server.env['GPUCLUSTERS_TLS_PORT']}"
    anonymous = laptop.run("curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert",
                           f"{laptop.home}/ca.pem", f"{url}/metrics")  # fmt: skip
    assert anonymous.stdout.strip() == "401", anonymous.stdout + anonymous.stderr

    expr = f'DCGM_FI_DEV_GPU_UTIL{{slurm_job="{world.job_id}"}}'
    before = time.time()
    world.server.stop()
    world.server.start()
    since = str(int(before - 3600))
    ranged = world.ok(
        "alice", "metrics", "query", expr, "--start", since, "--step", "2s", "-o", "json"
    )
    answer = json.loads(ranged)
    firsts = [float(r["values"][0][0]) for r in answer["data"]["result"]]
    assert len(firsts) == 16 and all(t < before for t in firsts), answer
