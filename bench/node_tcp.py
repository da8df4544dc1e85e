"""Node-to-node TCP throughput on the embedded fleet (no server).

Two GPU nodes of one cluster (the netns provider in this process, as the
tests make them); a receiver in one node, a sender in the other pushing
``--mib`` MiB through one TCP connection over the cluster bridge, with the
nodes' python3. Prints MiB/s per repeat and the median.
Used to compare node isolation designs side by side (bench/node_boundary.sh).
Needs root. Everything made is deleted at the end.

    .venv/bin/python bench/node_tcp.py --repeat 5 --mib 2048
    .venv/bin/python bench/node_tcp.py --repeat 5 --mib 2048 --isolated
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import uuid
from pathlib import Path

from gpuclusters.core import idblocks
from gpuclusters.core.idblocks import IdBlock
from gpuclusters.linux import nodeimage
from gpuclusters.providers.base import NodeSpec
from gpuclusters.providers.fleet import load_fleet
from gpuclusters.providers.netns.config import NetnsProviderConfig
from gpuclusters.providers.netns.provider import NetnsNodeProvider
from gpuclusters.providers.registry import DEFAULT_NETNS_FLEET

PORT = 7100
RECEIVER = f"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", {PORT})); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); n = 0
while (b := c.recv(1 << 20)):
    n += len(b)
print(n)
"""
SENDER = """
import socket, sys, time
host, mib = sys.argv[1], int(sys.argv[2]); buf = b"x" * (1 << 20)
for _ in range(100):
    try:
        c = socket.create_connection((host, {port})); break
    except OSError:
        time.sleep(0.05)
t = time.monotonic()
for _ in range(mib):
    c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
print(time.monotonic() - t)
"""


def spec(cluster: str, name: str, host: str, host_ids: IdBlock | None) -> NodeSpec:
    return NodeSpec(
        node_id=uuid.uuid4().hex, name=name, cluster_id=cluster, cluster_name="tcp",
        host=host, gpu_type="H100_SXM", compute_class="standard", host_ids=host_ids,
    )  # fmt: skip


async def main(repeat: int, mib: int, isolated: bool) -> None:
    home = Path(tempfile.mkdtemp(prefix="gpc-bench-tcp-"))
    fleet = load_fleet(DEFAULT_NETNS_FLEET)
    image = nodeimage.newest_built() if isolated else None
    if isolated and image is None:
        raise SystemExit("no node image built: run scripts/build-node-image")
    p = NetnsNodeProvider(
        NetnsProviderConfig(fleet=fleet, home=home, spawn_agent=False, userns=isolated, image=image)
    )
    cluster = uuid.uuid4().hex
    ids = idblocks.block(0) if isolated else None
    a, b = spec(cluster, "tcp-a", "h100-a-01", ids), spec(cluster, "tcp-b", "h100-a-02", ids)
    rates = []
    try:
        for s in (a, b):
            await p.create(s)
        sa, sb = await p.shell(a.node_id), await p.shell(b.node_id)
        for i in range(repeat):
            recv = asyncio.create_task(sb.run(["python3", "-c", RECEIVER], timeout_s=300))
            sent = await sa.run(
                ["python3", "-c", SENDER.format(port=PORT), sb.address, str(mib)], timeout_s=300
            )
            got = await recv
            assert int(got.stdout.split()[-1]) == mib << 20, got
            rate = mib / float(sent.stdout.strip())
            rates.append(rate)
            print(f"run {i + 1}: {rate:8.0f} MiB/s")
        print(f"median: {statistics.median(rates):8.0f} MiB/s over {repeat} runs of {mib} MiB")
    finally:
        for s in (a, b):
            await p.delete(s.node_id)
        await p.close()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument(
        "--isolated", action="store_true", help="both nodes in user namespaces, from the node image"
    )
    args = ap.parse_args()
    asyncio.run(main(args.repeat, args.mib, args.isolated))
