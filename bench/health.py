"""Health and repair on the embedded fleet: fault injection to alert, and
approval to the node running again.

The real server (``gpuclusters server --provider netns``, fresh home under
/tmp, default settings: 5 s agent heartbeat, 2 s reconcile poll, acceptance
tests on at every join) with one 2-node Slurm cluster. Per round
(``--repeat`` of each kind):

* **reboot**: ``POST .../nodes/N/faults {ecc-dbe}`` at T0; poll alerts every
  50 ms -> **alert** (T0 -> the critical alert listed) and **recommended**
  (T0 -> the pending_approval repair listed); approve at T1 -> **repaired**
  (T1 -> the repair reads succeeded: cordon, drain, reboot, rejoin Slurm and
  Kubernetes, acceptance tests).
* **migrate**: the same with an Xid 79; the repair builds the node on a
  free host (the old one is uncordoned after the round, for the next).

Prints min / median per figure; recorded in docs/benchmarks.md.

    .venv/bin/python bench/health.py              # ~3 min on 2 cores
    .venv/bin/python bench/health.py --repeat 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from _server import BenchServer, wait

P = "/v1/projects/default"


def fmt(xs: list[float]) -> str:
    return f"{min(xs):7.2f} / {statistics.median(xs):7.2f}"


class Bench(BenchServer):
    def __init__(self) -> None:
        super().__init__("gpc-health-bench-")

    def setup(self) -> list[str]:
        r = self.api.post(
            f"{P}/clusters",
            json={
                "name": "hb",
                "cluster_type": "slurm",
                "num_gpus": 16,
                "repair": {"max_wait_s": 0},
            },
        )
        r.raise_for_status()
        wait(
            "the cluster",
            lambda: self.get(f"{P}/clusters/hb")["status"] == "ready",
            timeout=300,
            poll=0.5,
        )
        return sorted(n["name"] for n in self.get(f"{P}/clusters/hb")["nodes"])

    def round(self, node: str, fault: dict[str, Any]) -> dict[str, float]:
        seen = {r["id"] for r in self.get(f"{P}/repairs")}
        t0 = time.monotonic()
        self.api.post(f"{P}/nodes/{node}/faults", json=fault).raise_for_status()
        marks: dict[str, float] = {}

        def recommended() -> dict[str, Any] | None:
            if "alert" not in marks and any(
                a["node"] == node and a["severity"] == "critical" for a in self.get(f"{P}/alerts")
            ):
                marks["alert"] = time.monotonic() - t0
            new = [r for r in self.get(f"{P}/repairs") if r["id"] not in seen]
            return new[0] if new else None

        rem = wait("a recommendation", recommended, timeout=60)
        marks["recommended"] = time.monotonic() - t0
        marks.setdefault("alert", marks["recommended"])
        old_host = self.get(f"{P}/nodes/{node}")["host"]
        t1 = time.monotonic()
        self.api.post(f"{P}/repairs/{rem['id']}/approve").raise_for_status()

        def done() -> bool:
            state = self.get(f"{P}/repairs/{rem['id']}")["state"]
            if state in ("failed", "cancelled"):
                raise RuntimeError(f"repair {state}")
            return state == "succeeded"

        wait("the repair", done, timeout=300, poll=0.1)
        marks["repaired"] = time.monotonic() - t1
        marks["action"] = 0.0 if rem["action"] == "reboot" else 1.0
        if rem["action"] == "migrate":
            self.api.post(f"/v1/hosts/{old_host}/uncordon").raise_for_status()
        return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespaces)")
    bench = Bench()
    results: dict[str, list[dict[str, float]]] = {"reboot": [], "migrate": []}
    try:
        nodes = bench.setup()
        for i in range(args.repeat):
            node = nodes[i % len(nodes)]
            for kind, fault in (
                ("reboot", {"kind": "ecc-dbe", "gpu": 1}),
                ("migrate", {"kind": "xid", "code": 79, "gpu": 3}),
            ):
                marks = bench.round(node, fault)
                results[kind].append(marks)
                print(
                    f"{kind} round {i + 1}: alert {marks['alert']:.2f}s, "
                    f"recommended {marks['recommended']:.2f}s, repaired {marks['repaired']:.2f}s"
                )
    finally:
        bench.close(f"{P}/clusters/hb")
    print(f"\n{'seconds (min / median)':<24} {'alert':>17} {'recommended':>17} {'repaired':>17}")
    for kind, rounds in results.items():
        if rounds:
            cols = [fmt([r[k] for r in rounds]) for k in ("alert", "recommended", "repaired")]
            print(f"{kind:<24} {cols[0]:>17} {cols[1]:>17} {cols[2]:>17}")


if __name__ == "__main__":
    main()
