"""What the README promises on the embedded fleet: after the machine reboots
(every node's processes, namespaces, links and bridges gone; its disks, the
volumes and the server's home kept), the next server start rebuilds the
nodes that vanished, in place, and the data on the cluster's shared volume
is intact. The reboot is made by hand with the server stopped: each node
powered off (its processes killed, its namespaces unpinned) and every
cluster bridge deleted, as a reboot leaves them.

Needs root, Debian's Slurm/munge/MariaDB (scripts/setup installs them).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpuclusters.linux import layout, machine, network
from gpuclusters.providers.netns.state import ProviderState

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the embedded fleet needs root"),
    pytest.mark.skipif(shutil.which("slurmctld") is None, reason="run scripts/setup first"),
]


def ok(server: ServerHandle, *args: str, timeout: float = 300) -> str:
    r = server.cli(*args, timeout=timeout)
    assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def cluster(server: ServerHandle, name: str) -> dict[str, Any]:
    return dict(json.loads(ok(server, "clusters", "get", name, "--output", "json")))


def netns_of(home: Path) -> set[str]:
    """The network namespaces of the nodes the server's provider recorded."""
    state = ProviderState.load(home / "netns-provider.json")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    present = {line.split()[0] for line in listed.splitlines() if line.strip()}
    return {rec.layout.netns for rec in state.nodes.values()} & present


async def reboot(home: Path) -> int:
    """What a reboot does to the embedded fleet of the server at ``home``;
    returns how many nodes it took down."""
    state = ProviderState.load(home / "netns-provider.json")
    for rec in state.nodes.values():
        await machine.power_off(rec.layout)
        await network.delete_node_link(rec.layout)
    for cluster_id in state.networks:
        await network.delete_bridge(cluster_id)
    return len(state.nodes)


def test_a_reboot_rebuilds_the_nodes_and_keeps_the_volume(server_factory: Servers) -> None:
    server = server_factory(provider="netns")
    ok(server, "clusters", "create", "rb", "--type", "slurm", "--gpus", "8", "--wait")
    ok(server, "clusters", "ssh", "rb", "--", "srun", "-N1", "sh", "-c",
       "echo written-before-the-reboot > /mnt/shared/kept.txt")  # fmt: skip
    before = cluster(server, "rb")
    (gpu,) = before["nodes"]
    assert netns_of(server.home)  # the nodes are up: the check below can fail

    assert server.stop() == 0
    assert asyncio.run(reboot(server.home)) >= 3  # the GPU node, controller, login
    assert netns_of(server.home) == set()
    bridges = {layout.bridge_name(c) for c in ProviderState.load(
        server.home / "netns-provider.json").networks}  # fmt: skip
    assert not any(network.link_exists(b) for b in bridges)

    server.start()

    def rebuilt() -> dict[str, Any] | None:
        c = cluster(server, "rb")
        node = {n["name"]: n for n in c["nodes"]}.get(gpu["name"])
        fresh = node is not None and node["ready_at"] != gpu["ready_at"]
        return c if c["status"] == "ready" and fresh else None

    after = server.wait_for("the cluster rebuilt and ready", rebuilt, timeout=300)
    # The same node, on the same host, not a replacement.
    assert [(n["name"], n["host"]) for n in after["nodes"]] == [(gpu["name"], gpu["host"])]
    # The volume's data, and Slurm working across the rebuilt nodes.
    kept = ok(server, "clusters", "ssh", "rb", "--", "cat", "/mnt/shared/kept.txt")
    assert kept.strip() == "written-before-the-reboot"
    ran = ok(server, "clusters", "ssh", "rb", "--", "srun", "-N1", "hostname")
    assert ran.strip() == gpu["name"]
    ok(server, "clusters", "delete", "rb", "--wait")
