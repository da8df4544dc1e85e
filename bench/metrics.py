"""What metrics cost: a node agent's export, and the database's disk per
node per day (docs/metrics.md; figures in docs/benchmarks.md).

1. **agent**: the node agent's collector (``agent/exporter.py``) with 8
   simulated GPUs, reading this machine's real ``/proc`` for Slurm jobs
   (every process's environment, as on a node; this machine has more
   processes than a node) and its own cgroup, scraped ``--scrapes`` times
   through its real HTTP endpoint. Prints the CPU one scrape costs (the
   process' own CPU time, so other load on the machine does not count) and
   what that is per node at a 15 s scrape interval, and the answer's size.
   A node with Kubernetes also asks kubelet's pod-resources API once per
   scrape (a unix-socket gRPC call), which this does not include.
2. **disk**: a real VictoriaMetrics (the server's, from
   ``scripts/build-k8s-addons``) fed ``--hours`` hours of ``--nodes`` nodes'
   series at a 15 s interval, exactly the series an agent exports (every
   dcgm field of 8 simulated GPUs, whose values move as the simulated load
   does, plus the node's), with the labels the service discovery adds; then
   flushed and merged, and its data directory measured. Prints bytes per
   sample and per node per day.

    .venv/bin/python bench/metrics.py
    .venv/bin/python bench/metrics.py --scrapes 200 --nodes 4 --hours 6
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gpuclusters.agent.dcgm import FIELDS
from gpuclusters.agent.exporter import AgentCollector, serve_metrics
from gpuclusters.agent.gpus import SimulatedGpus
from gpuclusters.server.settings import Settings

INTERVAL_S = 15


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def simulated(tmp: Path, node: str) -> SimulatedGpus:
    dev = tmp / node / "dev"
    dev.mkdir(parents=True)
    for i in range(8):
        (dev / f"nvidia{i}").touch()
    return SimulatedGpus("H100_SXM", dev_dir=dev, node_id=node, faults_file=tmp / "none.json")


def agent(scrapes: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gpuc-bench-") as tmp:
        gpus = simulated(Path(tmp), "bench-node")
        node = {"name": "bench-node", "cluster_name": "bench"}
        port = free_port()
        server = serve_metrics(AgentCollector(gpus, node), "127.0.0.1", port)
        processes = sum(1 for p in os.listdir("/proc") if p.isdigit())
        try:
            with httpx.Client(timeout=10) as http:
                http.get(f"http://127.0.0.1:{port}/metrics")  # warm up
                cpu0, t0 = time.process_time(), time.perf_counter()
                size = 0
                for _ in range(scrapes):
                    size = len(http.get(f"http://127.0.0.1:{port}/metrics").content)
                cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        finally:
            server.shutdown()
            server.server_close()
    # The client's share of the CPU (httpx) is in the same process: counted
    # too, so the figure is an upper bound on the agent's.
    per = cpu / scrapes
    print(
        f"agent export: {1000 * per:.2f} ms CPU per scrape (client included), "
        f"{1000 * wall / scrapes:.2f} ms wall, {size / 1024:.1f} KiB, "
        f"/proc with {processes} processes read each scrape; "
        f"at a {INTERVAL_S} s scrape: {100 * per / INTERVAL_S:.3f}% of a core per node"
    )


def series_lines(gpus: SimulatedGpus, node: str, at: float) -> list[str]:
    base = (
        f'job="gpuclusters-nodes",instance="10.231.0.{10 + int(node[-1])}:9400",'
        f'project_id="0123456789abcdef0123456789abcdef",project="bench",'
        f'cluster_id="fedcba9876543210fedcba9876543210",cluster="bench",'
        f'node_id="{node}000000000000000000000000",node="{node}",host="h-{node}",'
        f'compute_class="standard",gpu_type="H100_SXM"'
    )
    ms = int(at * 1000)
    out = []
    for f in gpus.fields(now=at):
        labels = (f'{base},gpu="{f.index}",UUID="{f.uuid}",device="{f.device}",'
                  f'modelName="{f.model}",Hostname="{node}"')  # fmt: skip
        for spec in FIELDS:
            value = getattr(f, spec.attr)
            if value is not None:
                out.append(f"{spec.name}{{{labels}}} {value} {ms}")
    # the node's own series: CPU and network counters grow, memory moves
    tick = at - 1_700_000_000
    out += [
        f"gpuclusters_node_cpu_seconds_total{{{base}}} {tick * 1.3:.2f} {ms}",
        f"gpuclusters_node_memory_used_bytes{{{base}}} {2e9 + (tick % 600) * 1e6:.0f} {ms}",
        f"gpuclusters_node_scratch_size_bytes{{{base}}} 3.84e12 {ms}",
        f"gpuclusters_node_scratch_free_bytes{{{base}}} {3.8e12 - tick * 10:.0f} {ms}",
        f'gpuclusters_node_network_receive_bytes_total{{{base},interface="eth0"}} '
        f"{tick * 5e5:.0f} {ms}",
        f'gpuclusters_node_network_transmit_bytes_total{{{base},interface="eth0"}} '
        f"{tick * 4e5:.0f} {ms}",
        f"up{{{base}}} 1 {ms}",
        f"scrape_duration_seconds{{{base}}} 0.01 {ms}",
    ]
    return out


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def disk(nodes: int, hours: float) -> None:
    binary = Settings().metrics_db_bin
    if not binary.is_file():
        sys.exit(f"{binary} is missing: run scripts/build-k8s-addons")
    with tempfile.TemporaryDirectory(prefix="gpuc-bench-") as tmp:
        data = Path(tmp) / "data"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [str(binary), f"-storageDataPath={data}", f"-httpListenAddr=127.0.0.1:{port}",
             "-retentionPeriod=1y", "-loggerLevel=ERROR"],
        )  # fmt: skip
        try:
            with httpx.Client(timeout=60) as http:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if http.get(f"{url}/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        sys.exit("VictoriaMetrics did not start")
                    time.sleep(0.1)
                gpus = {f"n{i}": simulated(Path(tmp), f"n{i}") for i in range(nodes)}
                end = time.time() - 60
                start = end - hours * 3600
                samples = 0
                t0 = time.perf_counter()
                at = start
                batch: list[str] = []
                while at <= end:
                    for node, g in gpus.items():
                        batch += series_lines(g, node, at)
                    if len(batch) > 200_000:
                        samples += len(batch)
                        http.post(f"{url}/api/v1/import/prometheus",
                                  content="\n".join(batch)).raise_for_status()  # fmt: skip
                        batch = []
                    at += INTERVAL_S
                if batch:
                    samples += len(batch)
                    http.post(f"{url}/api/v1/import/prometheus",
                              content="\n".join(batch)).raise_for_status()  # fmt: skip
                fed = time.perf_counter() - t0
                http.get(f"{url}/internal/force_flush").raise_for_status()
                # merges run in the background; force one and let it finish
                http.get(f"{url}/internal/force_merge").raise_for_status()
                time.sleep(10)
                size = du(data)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    per_node_day = size / nodes * (24 / hours)
    print(
        f"database disk: {samples} samples ({samples / nodes / (hours * 3600 / INTERVAL_S):.0f} "
        f"series per node) fed in {fed:.1f} s; {size / 1e6:.1f} MB on disk, "
        f"{size / samples:.2f} bytes per sample, {per_node_day / 1e6:.2f} MB per node per day "
        f"at a {INTERVAL_S} s scrape ({per_node_day * 30 / 1e9:.2f} GB per node for the "
        "default 30 days)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapes", type=int, default=200)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--hours", type=float, default=6)
    ap.add_argument("--only", choices=["agent", "disk"], default=None)
    args = ap.parse_args()
    if args.only in (None, "agent"):
        agent(args.scrapes)
    if args.only in (None, "disk"):
        disk(args.nodes, args.hours)


if __name__ == "__main__":
    main()
