"""Kubernetes clusters on the embedded fleet: create-to-Ready time against its floor.

For 1- and 2-node Kubernetes clusters (``--sizes``), ``--repeat`` times each,
one cluster at a time:

* **control plane**: the real server (``gpuclusters server --provider netns``,
  subprocess, fresh home under /tmp, default reconcile interval). POST a
  ``kubernetes`` cluster, poll GET every ``--poll-ms`` until ``ready``
  (every node Ready in Kubernetes with ``nvidia.com/gpu: 8`` allocatable);
  report POST -> ready. Then DELETE and poll until 404.
* **floor**: no server, no database, no reconcilers: the netns provider and
  the Kubernetes layer's own steps in this process, i.e. the same
  components (etcd, kube-apiserver, controller-manager, scheduler;
  containerd, kubelet, kube-proxy, device plugin per node) started
  directly: the GPU nodes' namespaces, then ``ensure_control_plane`` and
  ``join_node`` for every node at once, timed from the first namespace to
  the last node Ready. The breakdown gives namespaces, control plane
  (``/readyz``) and each node's join.

Prints one table (min / median over the repeats); the figures and their
reading are in docs/benchmarks.md. Needs root, containerd and the
Kubernetes binaries (scripts/setup). Everything made is deleted at the end.

    .venv/bin/python bench/k8s_provision.py               # ~2 min on 2 cores
    .venv/bin/python bench/k8s_provision.py --sizes 2 --repeat 5
    .venv/bin/python bench/k8s_provision.py --isolation-compare --sizes 1 2 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _server import BenchServer

from gpuclusters.layers.base import ClusterRef, NodeRef
from gpuclusters.layers.kubernetes.layer import KubernetesLayer
from gpuclusters.providers.base import NodeSpec
from gpuclusters.providers.registry import ProviderOptions, make_provider

HOSTS = ["h100-a-01", "h100-a-02", "h100-b-01", "h100-b-02"]
P = "/v1/projects/default"


def fmt(xs: list[float]) -> str:
    return f"{min(xs):6.2f} / {statistics.median(xs):6.2f}"


# --- through the control plane --------------------------------------------------------------


def control_plane_run(nodes: int, poll_s: float, isolated: bool | None = None) -> float:
    # Acceptance tests off, so the figure compares with the floor (which
    # runs none); docs/benchmarks.md records it so.
    settings = {"GPUCLUSTERS_ACCEPTANCE_CHECKS": "[]"}
    if isolated is not None:  # None: the server's defaults
        settings["GPUCLUSTERS_NODE_USERNS"] = "1" if isolated else "0"
        if not isolated:
            settings["GPUCLUSTERS_NODE_IMAGE"] = "none"
    server = BenchServer("gpc-k8s-bench-", settings=settings)
    try:
        t0 = time.monotonic()
        r = server.api.post(
            f"{P}/clusters",
            json={"name": "kb", "cluster_type": "kubernetes", "num_gpus": 8 * nodes},
        )
        r.raise_for_status()
        while True:
            status = server.get(f"{P}/clusters/kb")["status"]
            if status == "ready":
                return time.monotonic() - t0
            if status == "failed" or time.monotonic() - t0 > 300:
                raise RuntimeError(f"cluster ended {status}")
            time.sleep(poll_s)
    finally:
        server.close(f"{P}/clusters/kb")


# --- floor ------------------------------------------------------------------------------------


async def floor_run(nodes: int) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="gpc-k8s-floor-"))
    provider = make_provider("netns", ProviderOptions(home=home))
    layer = KubernetesLayer(provider)  # type: ignore[arg-type]
    cluster_id = uuid.uuid4().hex
    refs = tuple(
        NodeRef(node_id=uuid.uuid4().hex, name=f"kf-standard-{i}", host=HOSTS[i],
                compute_class="standard")
        for i in range(nodes)
    )  # fmt: skip
    cref = ClusterRef(
        cluster_id=cluster_id,
        name="kf",
        cluster_type="kubernetes",
        gpu_type="H100_SXM",
        volume_id=None,
        nodes=refs,
    )
    marks: dict[str, float] = {}
    try:
        t0 = time.monotonic()
        await asyncio.gather(
            *(
                provider.create(
                    NodeSpec(node_id=n.node_id, name=n.name, cluster_id=cluster_id,
                             cluster_name="kf", host=n.host, gpu_type="H100_SXM",
                             compute_class="standard")
                )
                for n in refs
            )
        )  # fmt: skip
        marks["namespaces"] = time.monotonic() - t0

        async def control_plane() -> None:
            await layer.ensure_control_plane(cref)
            marks["control plane ready"] = time.monotonic() - t0

        async def join(n: NodeRef) -> None:
            while not await layer.join_node(cref, n):  # noqa: ASYNC110 (a step polled until done)
                await asyncio.sleep(0.05)
            marks[f"{n.name} Ready"] = time.monotonic() - t0

        await asyncio.gather(control_plane(), *(join(n) for n in refs))
        marks["total"] = time.monotonic() - t0
        return marks
    finally:
        for n in refs:
            await provider.delete(n.node_id)
        await layer.delete(cref)
        await provider.close()
        shutil.rmtree(home, ignore_errors=True)


def isolation_compare(sizes: list[int], repeat: int, poll_s: float) -> None:
    """Create -> ready with the nodes as before issue 24 (the host's
    directories, no user namespace) and isolated (node image, user
    namespace), the order alternating each repeat."""
    print(
        "| nodes | before s (min / med) | isolated s (min / med) | ratio (med isolated / before) |"
    )
    print("|---|---|---|---|")
    for size in sizes:
        runs: dict[bool, list[float]] = {False: [], True: []}
        for i in range(repeat):
            for isolated in (False, True) if i % 2 == 0 else (True, False):
                runs[isolated].append(control_plane_run(size, poll_s, isolated=isolated))
        ratio = statistics.median(runs[True]) / statistics.median(runs[False])
        print(f"| {size} | {fmt(runs[False])} | {fmt(runs[True])} | {ratio:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--poll-ms", type=float, default=100.0)
    parser.add_argument(
        "--isolation-compare",
        action="store_true",
        help="instead: create -> ready through the server with nodes as before issue 24 and "
        "isolated (node image, user namespace), interleaved (no floor)",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    if args.isolation_compare:
        isolation_compare(args.sizes, args.repeat, args.poll_ms / 1000)
        return
    print(f"{'nodes':>5}  {'floor s (min / med)':>20}  {'control plane s (min / med)':>28}")
    breakdowns: dict[int, list[dict[str, float]]] = {}
    for size in args.sizes:
        floors = [asyncio.run(floor_run(size)) for _ in range(args.repeat)]
        breakdowns[size] = floors
        cps = [control_plane_run(size, args.poll_ms / 1000) for _ in range(args.repeat)]
        print(f"{size:>5}  {fmt([f['total'] for f in floors]):>20}  {fmt(cps):>28}")
    print("\nfloor breakdown (median s from the first namespace):")
    for size, runs in breakdowns.items():
        for key in runs[0]:
            print(f"  {size} node(s)  {key:<28} {statistics.median(r[key] for r in runs):6.2f}")


if __name__ == "__main__":
    main()
