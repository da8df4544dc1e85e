"""Real machines: two fresh Debian 12 hosts (``support.debian_hosts``: their
own root filesystem, systemd, sshd the only way in) added with
``gpuclusters hosts add root@HOST`` exactly as an operator would, then the
issue's acceptance: both ``ready`` with their inventory, a 16-GPU Slurm
cluster with one node on each, ``sbatch -N2`` printing both hostnames, a
file written by a job on one host and read by a job on the other through
the shared volume, and a delete that leaves nothing on either host.

The shared volume is the "operator mount" backend: a directory of this
machine bind-mounted into both hosts at the same path (this kernel has no
NFS client, docs/hosts.md), which the server uses as its volumes_dir.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from support.debian_hosts import DebianHost, DebianHosts
from support.processes import free_port

if TYPE_CHECKING:
    from conftest import ServerHandle, Servers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="booting hosts needs root"),
    pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs Debian (apt, mmdebstrap)"),
]

SUBNET = "10.232.42.0/24"
BRIDGE = "gpcul42"
SHARED_MOUNT = "/mnt/gpc-shared"
AGENT_HOME = "/var/lib/gpuclusters-host"


class Lab:
    def __init__(self, server: ServerHandle, debs: DebianHosts, hosts: list[DebianHost]) -> None:
        self.server = server
        self.debs = debs
        self.hosts = hosts

    def admin(self, *args: str, timeout: float = 300) -> str:
        r = self.server.cli(*args, timeout=timeout)
        assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def json(self, *args: str, timeout: float = 300) -> Any:
        return json.loads(self.admin(*args, "--output", "json", timeout=timeout))

    def host_logs(self) -> str:
        out = []
        for h in self.hosts:
            r = h.run(
                "journalctl -u gpuclusters-host-agent -n 60 --no-pager; "
                f"tail -n 30 {AGENT_HOME}/nodes/*/upper/var/log/gpuclusters/*.log 2>&1 || true"
            )
            out.append(f"=== {h.name}\n{r.stdout}{r.stderr}")
        return "\n".join(out)[-15000:]


@pytest.fixture(scope="module")
def lab(module_servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("debian-hosts")
    shared = root / "shared"
    server = module_servers(provider="hosts", start=False)
    gateway = server.env["GPUCLUSTERS_PUBLIC_HOST"]
    with DebianHosts(
        root / "lab",
        subnet=SUBNET,
        bridge=BRIDGE,
        shared_dir=shared,
        shared_mount=SHARED_MOUNT,
        # Where the agent makes nodes' overlays: a real filesystem, as the
        # operator's NVMe would be (overlayfs cannot sit on the host's
        # overlay root).
        real_fs_dirs=("/var/lib/containerd", AGENT_HOME),
        routes=[f"{gateway}/32"],
        # kubelet reads the kernel log (its OOM watcher); a real host has it.
        extra_nspawn_args=["--bind-ro=/dev/kmsg"],
    ) as debs:
        server.env.update(
            GPUCLUSTERS_TLS="on",
            GPUCLUSTERS_TLS_PORT=str(free_port()),
            GPUCLUSTERS_UNDERLAY_ADDRESS=debs.gateway,
            GPUCLUSTERS_VOLUMES_DIR=str(shared),
            GPUCLUSTERS_ACCESS_SYNC_INTERVAL_S="5",
        )
        server.start()
        hosts = debs.boot(["gpu-1", "gpu-2"])
        try:
            yield Lab(server, debs, hosts)
        finally:
            module_servers.close()


def test_hosts_add_bootstraps_fresh_debian_machines(lab: Lab) -> None:
    started = time.monotonic()
    for h in lab.hosts:
        r = lab.server.cli(
            "hosts", "add", f"root@{h.address}", "--ssh-key", str(lab.debs.key),
            "--known-hosts", str(lab.debs.known_hosts), "--volumes-dir", SHARED_MOUNT,
            "--ib-island", "ib-1", "--output", "json",
            timeout=1200,
        )  # fmt: skip
        assert r.returncode == 0, f"hosts add {h.name}\n{r.stdout}\n{r.stderr}"
        added = json.loads(r.stdout)
        assert added["name"] == h.name and added["agent_status"] == "ready"
    print(f"hosts add x2: {time.monotonic() - started:.1f}s")
    listed = {h["name"]: h for h in lab.json("hosts", "list")}
    for h in lab.hosts:
        got = listed[h.name]
        assert got["agent_status"] == "ready" and got["address"] == h.address
        assert got["inventory"]["os"].startswith("Debian GNU/Linux 12")
        assert got["inventory"]["cpus"] >= 1
    # The agent runs as a systemd service on each host.
    for h in lab.hosts:
        assert h.run("systemctl is-active gpuclusters-host-agent").stdout.strip() == "active"


def test_slurm_cluster_with_a_node_on_each_host(lab: Lab) -> None:
    r = lab.server.cli("clusters", "create", "x", "--type", "slurm", "--gpus", "16", "--wait",
                       "--output", "json", timeout=900)  # fmt: skip
    if r.returncode != 0:
        pytest.fail(f"create failed\n{r.stdout}\n{r.stderr}\n{lab.host_logs()}")
    nodes = lab.json("nodes", "list", "--cluster", "x")
    assert sorted(n["host"] for n in nodes) == ["gpu-1", "gpu-2"]
    out = lab.admin("clusters", "ssh", "x", "--", "sbatch", "--wait", "-N2", "-o",
                    "/mnt/shared/hn-%j.out", "--wrap", "srun hostname")  # fmt: skip
    job = out.split()[-1]
    printed = lab.admin("clusters", "ssh", "x", "--", "cat", f"/mnt/shared/hn-{job}.out").split()
    assert sorted(printed) == sorted(n["name"] for n in nodes)
    one, two = sorted(nodes, key=lambda n: n["host"])
    lab.admin("clusters", "ssh", "x", "--", "srun", "-N1", "-w", one["name"], "sh", "-c",
              "echo written-on-gpu-1 > /mnt/shared/across.txt")  # fmt: skip
    read = lab.admin("clusters", "ssh", "x", "--", "srun", "-N1", "-w", two["name"],
                     "cat", "/mnt/shared/across.txt")  # fmt: skip
    assert read.strip() == "written-on-gpu-1"


def test_delete_leaves_nothing_on_either_host_and_hosts_are_removed(lab: Lab) -> None:
    lab.admin("clusters", "delete", "x", "--wait", timeout=600)
    for h in lab.hosts:
        netns = h.run("ip netns list").stdout.strip()
        links = h.run("ip -o link show | grep -E 'gpc[bvx]' || true").stdout.strip()
        procs = h.run(
            "ps -eo comm | grep -E '^(slurmd|kubelet|containerd|munged|sshd|kube-proxy)$' "
            "| grep -v '^sshd$' || true"
        ).stdout.strip()
        assert (netns, links, procs) == ("", "", ""), h.name
    for h in lab.hosts:
        lab.admin("hosts", "drain", h.name)
        assert lab.json("hosts", "remove", h.name)["agent_status"] == "removed"
    assert lab.json("hosts", "list") == []
