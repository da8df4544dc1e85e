"""Control-plane throughput on the fake provider.

Starts the real server (subprocess, fresh home, SQLite or PostgreSQL via
``--database-url``) with a generated fleet, boot delay 0, then creates
``--clusters`` clusters of ``--nodes`` nodes each, concurrently, and prints:

* API latency of the create calls (p50 / p95 / max),
* time from the first create to every cluster ``ready``,
* the same for deleting them all.

The fake provider makes nodes instantly, so the figures are the control
plane's own cost: API, database, placement and reconcilers.

    .venv/bin/python bench/control_plane.py --clusters 20 --nodes 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_fleet(path: Path, hosts: int) -> None:
    lines = ["hosts:"]
    for i in range(hosts):
        island = f"ib-{i // 32}"
        lines.append(
            f"  - {{name: h{i:04d}, gpu_type: H100_SXM, region: local-1, ib_island: {island}}}"
        )
    path.write_text("\n".join(lines) + "\n")


async def run(args: argparse.Namespace) -> None:
    home = Path(tempfile.mkdtemp(prefix="gpuc-bench-"))
    fleet = home / "fleet.yaml"
    write_fleet(fleet, args.clusters * args.nodes)
    port = free_port()
    env = dict(
        os.environ,
        GPUCLUSTERS_HOME=str(home),
        GPUCLUSTERS_FLEET_FILE=str(fleet),
        GPUCLUSTERS_FAKE_BOOT_DELAY_S="0",
        GPUCLUSTERS_RECONCILE_INTERVAL_S="1",
    )
    if args.database_url:
        env["GPUCLUSTERS_DATABASE_URL"] = args.database_url
    exe = Path(sys.executable).parent / "gpuclusters"
    # Blocking calls before any timing starts: harmless in an async function.
    log = open(home / "server.log", "w")  # noqa: SIM115, ASYNC230 (closed below)
    proc = subprocess.Popen(  # noqa: ASYNC220
        [str(exe), "server", "--provider", "fake", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            for _ in range(300):
                try:
                    if (await c.get("/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
            key = tomllib.loads((home / "config.toml").read_text())["api_key"]
            c.headers["Authorization"] = f"Bearer {key}"
            p = "/v1/projects/default/clusters"
            names = [f"b{i:03d}" for i in range(args.clusters)]

            async def create(name: str) -> float:
                t = time.perf_counter()
                r = await c.post(
                    p, json={"name": name, "cluster_type": "slurm", "num_gpus": 8 * args.nodes}
                )
                r.raise_for_status()
                return time.perf_counter() - t

            async def wait_all(pred: str) -> None:
                while True:
                    listed = (await c.get(p)).json()
                    if (
                        pred == "ready"
                        and all(x["status"] == "ready" for x in listed)
                        and len(listed) == len(names)
                    ):
                        return
                    if pred == "gone" and not listed:
                        return
                    await asyncio.sleep(0.05)

            t0 = time.perf_counter()
            lat = sorted(await asyncio.gather(*(create(n) for n in names)))
            await wait_all("ready")
            t_ready = time.perf_counter() - t0

            t1 = time.perf_counter()
            await asyncio.gather(*(c.delete(f"{p}/{n}") for n in names))
            await wait_all("gone")
            t_gone = time.perf_counter() - t1

        db = "postgresql" if args.database_url else "sqlite"
        print(f"clusters={args.clusters} nodes_each={args.nodes} db={db}")
        print(
            f"create API latency: p50={statistics.median(lat) * 1000:.0f} ms "
            f"p95={lat[int(0.95 * (len(lat) - 1))] * 1000:.0f} ms max={lat[-1] * 1000:.0f} ms"
        )
        n_nodes = args.clusters * args.nodes
        print(f"all ready after {t_ready:.2f} s ({n_nodes / t_ready:.1f} nodes/s)")
        print(f"all deleted after {t_gone:.2f} s")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clusters", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--database-url", default=None)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
