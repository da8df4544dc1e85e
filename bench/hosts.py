"""Clusters across hosts: join time, create-to-ready and delete of a
16-GPU Slurm cluster with one node on each of two hosts.

Hosts are namespaces on this machine, each with its own
``gpuclusters host-agent`` that the server reaches only over an underlay
bridge with mutual TLS (``tests/support/nshosts.py``, as in
``tests/e2e/test_hosts_netns.py``); the server runs ``--provider hosts`` with
TLS on and the service nodes on its own machine; nodes of the cluster on the
two hosts share its network over VXLAN. The same cluster on the embedded
fleet (all on one machine) is ``bench/provision.py``'s figure.

Prints each figure per round and the median; recorded in docs/benchmarks.md.

    .venv/bin/python bench/hosts.py              # ~3 min on 2 cores
    .venv/bin/python bench/hosts.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _server import BenchServer, free_port, wait

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.nshosts import NsHosts

P = "/v1/projects/default"
SUBNET = 43


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpc-bench-hosts-"))
    shared = root / "shared"
    shared.mkdir()
    lab = NsHosts(root / "hosts", subnet_index=SUBNET, route_to=["10.230.0.1"])
    lab.up()
    server: BenchServer | None = None
    try:
        server = BenchServer(
            "gpc-bench-hosts-srv-",
            provider="hosts",
            settings={
                "GPUCLUSTERS_TLS": "on",
                "GPUCLUSTERS_TLS_PORT": str(free_port()),
                "GPUCLUSTERS_UNDERLAY_ADDRESS": lab.gateway,
                "GPUCLUSTERS_VOLUMES_DIR": str(shared),
            },
        )
        joins = []
        for name in ("bench-a", "bench-b"):
            host = lab.add(name)
            t0 = time.monotonic()
            token = json.loads(server.cli("hosts", "join-token", name, "--output", "json"))
            lab.join(
                host,
                server_url=token["server_url"],
                token=token["token"],
                ca_file=server.home / "tls" / "ca.pem",
                volumes_dir=shared,
            )
            lab.start_agent(host)

            def ready(n: str = name) -> bool:
                return any(
                    h["name"] == n and h["agent_status"] == "ready"
                    for h in server.get("/v1/hosts")  # type: ignore[union-attr]
                )

            wait(f"{name} ready", ready, timeout=120)
            joins.append(time.monotonic() - t0)
            print(f"join {name}: token -> join -> first heartbeat {joins[-1]:.2f} s", flush=True)
        creates, deletes = [], []
        for r in range(args.rounds):
            name = f"span{r}"
            t0 = time.monotonic()
            server.api.post(
                f"{P}/clusters", json={"name": name, "cluster_type": "slurm", "num_gpus": 16}
            ).raise_for_status()
            wait(
                f"{name} ready",
                lambda n=name: server.get(f"{P}/clusters/{n}")["status"] == "ready",  # type: ignore[union-attr]
                timeout=600,
                poll=0.2,
            )
            creates.append(time.monotonic() - t0)
            hosts = sorted(n["host"] for n in server.get(f"{P}/nodes?cluster={name}"))
            t1 = time.monotonic()
            server.api.delete(f"{P}/clusters/{name}", params={"delete_volume": True})
            wait(
                f"{name} deleted",
                lambda n=name: server.api.get(f"{P}/clusters/{n}").status_code == 404,  # type: ignore[union-attr]
                timeout=600,
                poll=0.2,
            )
            deletes.append(time.monotonic() - t1)
            print(
                f"round {r}: create->ready {creates[-1]:.1f} s on {hosts}, "
                f"delete {deletes[-1]:.1f} s",
                flush=True,
            )
        print(
            f"median: join {statistics.median(joins):.2f} s, create->ready "
            f"{statistics.median(creates):.1f} s, delete {statistics.median(deletes):.1f} s"
        )
    finally:
        if server is not None:
            server.close()
        lab.close()


if __name__ == "__main__":
    main()
