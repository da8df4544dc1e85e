"""The node agent's Prometheus endpoint: dcgm-exporter's fields per GPU,
labelled with the Slurm job or the pod that holds the GPU, and the node's
own CPU, memory, /scratch and network."""

from __future__ import annotations

import json
import socket
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuclusters.agent.dcgm import FIELDS
from gpuclusters.agent.exporter import AgentCollector, serve_metrics
from gpuclusters.agent.gpus import SimulatedGpus
from gpuclusters.agent.nodestats import read_node_stats
from gpuclusters.agent.podresources import api_pb2, api_pb2_grpc
from gpuclusters.agent.workloads import slurm_gpu_jobs

NODE = {"name": "demo-standard-abcde", "cluster_name": "demo", "address": "127.0.0.1"}


def _gpus(tmp_path: Path, count: int = 8) -> SimulatedGpus:
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(count):
        (dev / f"nvidia{i}").touch()
    return SimulatedGpus(
        "H100", dev_dir=dev, count=count, node_id="n-1", faults_file=tmp_path / "faults.json"
    )


def _process(proc: Path, pid: int, env: dict[str, str]) -> None:
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")


def _scrape(collector: AgentCollector) -> dict[str, list[Any]]:
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _set(labels: dict[str, str]) -> dict[str, str]:
    """The labels a database keeps: an empty label is no label."""
    return {k: v for k, v in labels.items() if v}


def _by_gpu(samples: list[Any]) -> dict[str, Any]:
    return {s.labels["gpu"]: s for s in samples}


def test_slurm_jobs_are_found_from_their_processes(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _process(proc, 100, {"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "alice", "SLURM_JOB_GPUS": "0,1"})
    # a step of another job, whose step GPUs win over the job's
    _process(
        proc,
        101,
        {"SLURM_JOB_ID": "43", "SLURM_JOB_USER": "bob", "SLURM_STEP_GPUS": "5",
         "SLURM_JOB_GPUS": "4,5"},
    )  # fmt: skip
    _process(proc, 102, {"PATH": "/bin"})  # not a job
    _process(proc, 103, {"SLURM_JOB_ID": "44"})  # a job without GPUs
    (proc / "self").mkdir()  # not a pid
    jobs = slurm_gpu_jobs(proc)
    assert {i: (j.job_id, j.user) for i, j in jobs.items()} == {
        0: ("42", "alice"),
        1: ("42", "alice"),
        5: ("43", "bob"),
    }


class _Kubelet(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, pods: list[api_pb2.PodResources]) -> None:
        self.pods = pods

    def List(self, request: Any, context: Any) -> api_pb2.ListPodResourcesResponse:
        return api_pb2.ListPodResourcesResponse(pod_resources=self.pods)


@pytest.fixture
def kubelet_socket(tmp_path: Path) -> Any:
    """A pod-resources server on a unix socket, as kubelet serves it."""
    sock = tmp_path / "kubelet.sock"
    servers = []

    def start(pods: list[api_pb2.PodResources]) -> Path:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Kubelet(pods), server)
        server.add_insecure_port(f"unix://{sock}")
        server.start()
        servers.append(server)
        return sock

    yield start
    for s in servers:
        s.stop(None)


def test_gpu_series_carry_dcgm_names_and_their_workload(
    tmp_path: Path, kubelet_socket: Any
) -> None:
    gpus = _gpus(tmp_path)
    uuids = [g.uuid for g in gpus.inventory()]
    proc = tmp_path / "proc"
    _process(proc, 7, {"SLURM_JOB_ID": "42", "SLURM_JOB_USER": "alice", "SLURM_JOB_GPUS": "0,1"})
    pod = api_pb2.PodResources(
        name="train-0",
        namespace="team-a",
        containers=[
            api_pb2.ContainerResources(
                name="main",
                devices=[
                    api_pb2.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[uuids[3]]),
                    api_pb2.ContainerDevices(resource_name="example.com/other", device_ids=["x"]),
                ],
            )
        ],
    )
    sock = kubelet_socket([pod])
    (tmp_path / "faults.json").write_text(json.dumps({"gpus": {"5": {"xids": [48, 79]}}}))
    families = _scrape(AgentCollector(gpus, NODE, proc=proc, pod_resources=sock))

    for spec in FIELDS:
        assert len(families[spec.name]) == 8, spec.name
    util = _by_gpu(families["DCGM_FI_DEV_GPU_UTIL"])
    assert util["0"].labels["slurm_job"] == "42"
    assert util["0"].labels["slurm_user"] == "alice"
    assert util["1"].labels["slurm_job"] == "42"
    assert _set(util["3"].labels) == {
        "gpu": "3",
        "UUID": uuids[3],
        "device": "nvidia3",
        "modelName": "Simulated H100",
        "Hostname": "demo-standard-abcde",
        "cluster": "demo",
        "node": "demo-standard-abcde",
        "namespace": "team-a",
        "pod": "train-0",
        "container": "main",
    }
    assert not {"slurm_job", "slurm_user", "pod"} & set(_set(util["2"].labels)), (
        "a GPU nobody holds has no workload labels"
    )
    # the simulated load is the charts' telemetry
    by_index = {t.index: t for t in gpus.telemetry()}
    assert 0 <= util["4"].value <= 100
    assert abs(util["4"].value - by_index[4].utilization_pct) <= 10
    xid = _by_gpu(families["DCGM_FI_DEV_XID_ERRORS"])
    assert xid["5"].value == 79 and xid["4"].value == 0
    fb_used = _by_gpu(families["DCGM_FI_DEV_FB_USED"])
    fb_free = _by_gpu(families["DCGM_FI_DEV_FB_FREE"])
    assert fb_used["0"].value + fb_free["0"].value == pytest.approx(80 * 1024, abs=1)


def test_an_absent_gpu_and_no_kubelet_leave_series_out_not_zero(tmp_path: Path) -> None:
    gpus = _gpus(tmp_path)
    (tmp_path / "dev" / "nvidia6").unlink()
    families = _scrape(
        AgentCollector(gpus, NODE, proc=tmp_path / "none", pod_resources=tmp_path / "no.sock")
    )
    assert sorted(_by_gpu(families["DCGM_FI_DEV_GPU_UTIL"])) == ["0", "1", "2", "3", "4", "5", "7"]


def _cgroup_v1(tmp_path: Path) -> tuple[Path, Path]:
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "cgroup").write_text(
        "12:memory:/gpuclusters/n1\n4:cpu,cpuacct:/gpuclusters/n1\n1:name=systemd:/\n"
    )
    root = tmp_path / "cgroup"
    (root / "cpu,cpuacct" / "gpuclusters" / "n1").mkdir(parents=True)
    (root / "cpu,cpuacct" / "gpuclusters" / "n1" / "cpuacct.usage").write_text("2500000000\n")
    (root / "memory" / "gpuclusters" / "n1").mkdir(parents=True)
    (root / "memory" / "gpuclusters" / "n1" / "memory.usage_in_bytes").write_text("1048576\n")
    (proc / "net").mkdir()
    (proc / "net" / "dev").write_text(
        "Inter-|   Receive                            |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets\n"
        "    lo:     100       1    0    0    0     0          0         0      100       1"
        "    0    0    0     0       0          0\n"
        "  eth0:    5000      10    0    0    0     0          0         0     7000      12"
        "    0    0    0     0       0          0\n"
    )
    return proc, root


def test_node_stats_from_cgroup_v1_and_v2(tmp_path: Path) -> None:
    proc, root = _cgroup_v1(tmp_path)
    stats = read_node_stats(proc=proc, cgroup_root=root, scratch=tmp_path)
    assert stats.cpu_seconds == 2.5
    assert stats.memory_used_bytes == 1048576
    assert stats.network == {"eth0": (5000.0, 7000.0)}
    assert stats.scratch_size_bytes and stats.scratch_free_bytes is not None

    v2 = tmp_path / "v2"
    (v2 / "proc" / "1").mkdir(parents=True)
    (v2 / "proc" / "1" / "cgroup").write_text("0::/nodes/n2\n")
    (v2 / "cg" / "nodes" / "n2").mkdir(parents=True)
    (v2 / "cg" / "nodes" / "n2" / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1\n")
    (v2 / "cg" / "nodes" / "n2" / "memory.current").write_text("4096\n")
    stats = read_node_stats(proc=v2 / "proc", cgroup_root=v2 / "cg", scratch=v2 / "missing")
    assert (stats.cpu_seconds, stats.memory_used_bytes) == (1.5, 4096)
    assert stats.scratch_size_bytes is None, "no /scratch: left out, not 0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_served_over_http_with_node_series(tmp_path: Path) -> None:
    proc, root = _cgroup_v1(tmp_path)
    collector = AgentCollector(_gpus(tmp_path), NODE, proc=proc, cgroup_root=root, scratch=tmp_path)
    port = _free_port()
    server = serve_metrics(collector, "127.0.0.1", port)
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert r.status_code == 200
    families = {f.name: f.samples for f in text_string_to_metric_families(r.text)}
    assert families["gpuclusters_node_cpu_seconds"][0].value == 2.5
    assert families["gpuclusters_node_cpu_seconds"][0].name == "gpuclusters_node_cpu_seconds_total"
    rx = families["gpuclusters_node_network_receive_bytes"]
    assert [(s.labels["interface"], s.value) for s in rx] == [("eth0", 5000.0)]
    assert families["gpuclusters_node_memory_used_bytes"][0].labels == {
        "cluster": "demo",
        "node": "demo-standard-abcde",
    }
    assert len(families["DCGM_FI_DEV_POWER_USAGE"]) == 8
