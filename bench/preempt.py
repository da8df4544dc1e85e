"""Preemption on the embedded fleet: the control plane's overhead, and time to a replacement.

One Slurm cluster (8 standard + 8 preemptible GPUs) on the real server
(``gpuclusters server --provider netns``, fresh home under /tmp, a fleet of
exactly two hosts so a reclaimed host is the only spare one, default
settings: 300 s grace, 2 s reconcile poll). Each round (``--repeat``):

1. A batch job runs on the preemptible node. It traps SIGTERM, notes the
   time, spends ``--exit-s`` seconds "checkpointing" (sleep), notes the
   time again and exits.
2. ``POST /v1/hosts/{host}/reclaim`` at T0 (the admin's reclaim: the full
   preemption protocol). Poll until the ``Preempted`` event appears; its
   timestamp is the release (the node leaves ``draining``, billing stops).
3. Reported: **signal** = SIGTERM seen by the job - T0; **release** =
   release - T0; **overhead** = release - the job's own exit (the control
   plane's share: noticing the job left, requeueing it, releasing).
4. ``POST /v1/hosts/{host}/uncordon`` at T1 (the host is spare again); poll
   the cluster until ``allocated_preemptible_gpus`` is back to 8:
   **replacement** = that moment - T1 (place, boot the node namespace,
   join Slurm and Kubernetes).

All times come from this machine's clock (server, nodes and bench share
it). Prints min / median per figure; recorded in docs/benchmarks.md.

    .venv/bin/python bench/preempt.py                 # ~4 min on 2 cores
    .venv/bin/python bench/preempt.py --repeat 5 --exit-s 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime
from typing import Any

from _server import BenchServer, wait

P = "/v1/projects/default"
FLEET = (
    "hosts:\n"
    "  - {name: h100-a-01, gpu_type: H100_SXM, region: local-1, ib_island: ib-a}\n"
    "  - {name: h100-a-02, gpu_type: H100_SXM, region: local-1, ib_island: ib-a}\n"
)
JOB = """#!/bin/bash
#SBATCH --constraint=preemptible
#SBATCH --gres=gpu:8
#SBATCH --output=/dev/null
out=$HOME/bench-$SLURM_JOB_ID
on_term() {{ date +%s.%N > "$out.term"; sleep {exit_s}; date +%s.%N > "$out.exit"; exit 0; }}
trap on_term TERM
date +%s.%N > "$out.start"
while true; do sleep 1 & wait $!; done
"""


def fmt(xs: list[float]) -> str:
    return f"{min(xs):7.2f} / {statistics.median(xs):7.2f}"


class Bench(BenchServer):
    def __init__(self, exit_s: float) -> None:
        super().__init__("gpc-preempt-bench-", fleet=FLEET)
        self.exit_s = exit_s

    def ssh(self, *cmd: str) -> str:
        return self.cli("clusters", "ssh", "pb", "--", *cmd)

    def cluster(self) -> dict[str, Any]:
        r = self.api.get(f"{P}/clusters/pb")
        r.raise_for_status()
        return dict(r.json())

    def events(self, reason: str) -> list[dict[str, Any]]:
        r = self.api.get(f"{P}/events", params={"limit": 1000, "cluster": "pb"})
        return [e for e in r.json() if e["reason"] == reason]

    def setup(self) -> None:
        r = self.api.post(
            f"{P}/clusters",
            json={"name": "pb", "cluster_type": "slurm", "num_gpus": 8, "num_preemptible_gpus": 8},
        )
        r.raise_for_status()
        wait("the cluster", lambda: self.cluster()["allocated_preemptible_gpus"] == 8)
        home = next((self.home / "volumes").glob("*/data")) / "home" / "admin"
        wait("the home directory", home.exists)
        script = home / "bench.sbatch"
        script.write_text(JOB.format(exit_s=self.exit_s))
        os.chown(script, 10000, 10000)
        self.user_home = home

    def round(self) -> dict[str, float]:
        c = self.cluster()
        node = next(n for n in c["nodes"] if n["compute_class"] == "preemptible")
        wait(
            "Slurm to list the node idle",
            lambda: node["name"] in self.ssh("sinfo", "-h", "-N", "-t", "idle", "-o", "%N"),
            timeout=120,
            poll=0.5,
        )
        job = self.ssh("sbatch", "--parsable", "/home/admin/bench.sbatch").strip()
        wait("the job to start", (self.user_home / f"bench-{job}.start").exists, timeout=60)
        seen = {e["node"] for e in self.events("Preempted")}
        t0 = time.time()
        self.api.post(f"/v1/hosts/{node['host']}/reclaim").raise_for_status()
        event = wait(
            "the Preempted event",
            lambda: next((e for e in self.events("Preempted") if e["node"] not in seen), None),
            timeout=400,
            poll=0.1,
        )
        released = datetime.fromisoformat(event["timestamp"]).timestamp()
        term = float((self.user_home / f"bench-{job}.term").read_text())
        exited = float((self.user_home / f"bench-{job}.exit").read_text())
        self.ssh("scancel", job)  # it was requeued; this round is over
        t1 = time.time()
        self.api.post(f"/v1/hosts/{node['host']}/uncordon").raise_for_status()
        wait(
            "a replacement",
            lambda: self.cluster()["allocated_preemptible_gpus"] == 8,
            timeout=300,
            poll=0.1,
        )
        replaced = time.time()
        return {
            "signal": term - t0,
            "job exit": exited - t0,
            "release": released - t0,
            "overhead": released - exited,
            "replacement": replaced - t1,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--exit-s", type=float, default=2.0, help="the job's checkpoint time")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    bench = Bench(args.exit_s)
    rounds = []
    try:
        bench.setup()
        for i in range(args.repeat):
            rounds.append(bench.round())
            print(f"round {i + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in rounds[-1].items()))
    finally:
        bench.close(f"{P}/clusters/pb")
    print(f"\n{'seconds':<14} {'min / median':>17}   (job checkpoint time {args.exit_s:g} s)")
    for key in rounds[0]:
        print(f"{key:<14} {fmt([r[key] for r in rounds]):>17}")


if __name__ == "__main__":
    main()
