"""The node agent's Prometheus endpoint: its GPUs' fields under
dcgm-exporter's names (``agent.dcgm``), labelled with the workload that
holds each GPU (``agent.workloads``), and the node's own CPU, memory,
/scratch and network (``agent.nodestats``).

Everything is read when a scrape comes (a custom collector), not on a
timer: an idle node costs nothing between scrapes, and a scrape sees the
GPUs as they are. Labels on every series: ``cluster`` and ``node`` (from
node.json; the metrics database's service discovery sets the same ones,
and its own win, so a node cannot pass for another). On GPU series also
dcgm-exporter's ``gpu``, ``UUID``, ``device``, ``modelName`` and
``Hostname``, and the workload's: ``slurm_job`` and ``slurm_user`` for a
Slurm job, ``namespace``, ``pod`` and ``container`` for a pod (empty, so
absent, when nothing holds the GPU).

The endpoint listens on the node's own address (``GPUCLUSTERS_AGENT_METRICS_PORT``,
9400 by default, dcgm-exporter's port); only the server's metrics database
scrapes it (docs/metrics.md). Serving runs in prometheus_client's own
thread, so a slow scrape never delays a heartbeat.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from gpuclusters.agent.dcgm import FIELDS
from gpuclusters.agent.gpus import GpuBackend
from gpuclusters.agent.nodestats import read_node_stats
from gpuclusters.agent.workloads import (
    POD_RESOURCES_SOCKET,
    pod_gpu_containers,
    slurm_gpu_jobs,
)

log = logging.getLogger(__name__)

DEFAULT_PORT = 9400
GPU_LABELS = (
    "gpu",
    "UUID",
    "device",
    "modelName",
    "Hostname",
    "cluster",
    "node",
    "slurm_job",
    "slurm_user",
    "namespace",
    "pod",
    "container",
)
NODE_LABELS = ("cluster", "node")


class AgentCollector:
    """A prometheus_client collector over the node's GPUs and the node."""

    def __init__(
        self,
        gpus: GpuBackend,
        node: dict[str, Any],
        *,
        proc: Path = Path("/proc"),
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        scratch: Path = Path("/scratch"),
        pod_resources: Path = POD_RESOURCES_SOCKET,
    ) -> None:
        self.gpus = gpus
        self.cluster = str(node.get("cluster_name", ""))
        self.node = str(node.get("name", ""))
        self.proc = proc
        self.cgroup_root = cgroup_root
        self.scratch = scratch
        self.pod_resources = pod_resources

    def collect(self) -> Iterator[Metric]:
        yield from self._gpu_metrics()
        yield from self._node_metrics()

    def _gpu_metrics(self) -> Iterator[Metric]:
        try:
            fields = self.gpus.fields()
        except Exception:  # a broken backend must not break the node's series
            log.exception("GPU fields failed")
            fields = []
        jobs = slurm_gpu_jobs(self.proc)
        pods = pod_gpu_containers(self.pod_resources)
        rows = []
        for f in fields:
            job = jobs.get(f.index)
            pod = pods.get(f.uuid)
            labels = [
                str(f.index),
                f.uuid,
                f.device,
                f.model,
                self.node,
                self.cluster,
                self.node,
                job.job_id if job else "",
                job.user if job else "",
                pod.namespace if pod else "",
                pod.pod if pod else "",
                pod.container if pod else "",
            ]
            rows.append((f, labels))
        for spec in FIELDS:
            family = GaugeMetricFamily(spec.name, spec.help, labels=GPU_LABELS)
            for f, labels in rows:
                value = getattr(f, spec.attr)
                if value is not None:
                    family.add_metric(labels, float(value))
            yield family

    def _node_metrics(self) -> Iterator[Metric]:
        stats = read_node_stats(proc=self.proc, cgroup_root=self.cgroup_root, scratch=self.scratch)
        at = [self.cluster, self.node]
        single = (
            ("gpuclusters_node_memory_used_bytes", "Memory the node's cgroup uses.",
             stats.memory_used_bytes),
            ("gpuclusters_node_scratch_size_bytes", "Size of the node's /scratch.",
             stats.scratch_size_bytes),
            ("gpuclusters_node_scratch_free_bytes", "Free space on the node's /scratch.",
             stats.scratch_free_bytes),
        )  # fmt: skip
        if stats.cpu_seconds is not None:
            cpu = CounterMetricFamily(
                "gpuclusters_node_cpu_seconds",
                "CPU time the node's cgroup used.",
                labels=NODE_LABELS,
            )
            cpu.add_metric(at, stats.cpu_seconds)
            yield cpu
        for name, help_text, value in single:
            if value is not None:
                gauge = GaugeMetricFamily(name, help_text, labels=NODE_LABELS)
                gauge.add_metric(at, value)
                yield gauge
        received = CounterMetricFamily(
            "gpuclusters_node_network_receive_bytes",
            "Bytes the node received, by interface.",
            labels=(*NODE_LABELS, "interface"),
        )
        sent = CounterMetricFamily(
            "gpuclusters_node_network_transmit_bytes",
            "Bytes the node sent, by interface.",
            labels=(*NODE_LABELS, "interface"),
        )
        for interface, (rx, tx) in sorted(stats.network.items()):
            received.add_metric([*at, interface], rx)
            sent.add_metric([*at, interface], tx)
        yield received
        yield sent


def serve_metrics(collector: AgentCollector, address: str, port: int) -> Any:
    """Serve ``collector`` on ``address:port`` in a background thread; the
    returned server's ``shutdown()`` stops it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=address, registry=registry)
    log.info("metrics on http://%s:%d/metrics", address, port)
    return server
