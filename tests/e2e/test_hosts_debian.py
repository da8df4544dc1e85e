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
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from netlab import Laptop

from gpuclusters.linux import nodeimage
from support.debian_hosts import DebianHost, DebianHosts
from support.processes import free_port

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="booting hosts needs root"),
    pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs Debian (apt, mmdebstrap)"),
]

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SUBNET = "10.232.42.0/24"
BRIDGE = "gpcul42"
SHARED_MOUNT = "/mnt/gpc-shared"
AGENT_HOME = "/var/lib/gpuclusters-host"


class Lab:
    def __init__(
        self, server: ServerHandle, debs: DebianHosts, hosts: list[DebianHost], laptop: Laptop
    ) -> None:
        self.server = server
        self.debs = debs
        self.hosts = hosts
        self.laptop = laptop

    def user(self, *args: str, timeout: float = 300) -> str:
        """The CLI on the laptop, as its non-root user."""
        env = {"GPUCLUSTERS_HOME": f"{self.laptop.home}/.gpuclusters"}
        r = self.laptop.run("gpuclusters", *args, env=env, timeout=timeout)
        assert r.returncode == 0, f"laptop: gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
        return str(r.stdout)

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
    laptop = Laptop(PROJECT_ROOT)
    try:
        laptop.up()
        # Users (and the hosts) reach this machine where the laptop does.
        gateway = laptop.gateway
        server = module_servers(provider="hosts", start=False, public_host=gateway)
        with DebianHosts(
            root / "lab",
            subnet=SUBNET,
            bridge=BRIDGE,
            shared_dir=shared,
            shared_mount=SHARED_MOUNT,
            # Where the agent makes nodes' overlays: a real file system, as
            # the operator's NVMe would be (overlayfs cannot sit on the
            # host's overlay root).
            real_fs_dirs=("/var/lib/containerd", AGENT_HOME),
            # A root of their own on this machine's disk, as a real host's
            # is: nodes in user namespaces idmap what they share of it, which
            # an overlayfs root refuses (docs/security.md).
            root_mode="copy",
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
                yield Lab(server, debs, hosts, laptop)
            finally:
                module_servers.close()
    finally:
        laptop.close()


def test_hosts_add_bootstraps_fresh_debian_machines(lab: Lab) -> None:
    image = nodeimage.newest_built()  # scripts/setup builds it
    assert image is not None
    started = time.monotonic()
    for h in lab.hosts:
        r = lab.server.cli(
            "hosts", "add", f"root@{h.address}", "--ssh-key", str(lab.debs.key),
            "--known-hosts", str(lab.debs.known_hosts), "--volumes-dir", SHARED_MOUNT,
            "--ib-island", "ib-1", "--output", "json",
            timeout=1200,
        )  # fmt: skip
        assert r.returncode == 0, f"hosts add {h.name}\n{r.stdout}\n{r.stderr}"
        # The node image went with it (nodes never boot from the host's own /usr).
        assert f"[5/7] node image {image.parent.name}" in r.stderr
        stamp = f"{image.parent}/.complete"
        assert h.run(f"test -e {stamp} && echo ok").stdout.strip() == "ok"
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
    # A user on their laptop: login over TLS, register a key, plain ssh to
    # the login node through the gateway, and Slurm across the two hosts.
    laptop = lab.laptop
    key = json.loads(lab.admin("api-keys", "create", "--user", "alice", "--project", "default",
                               "--role", "admin", "--output", "json"))["key"]  # fmt: skip
    (laptop.home / "ca.pem").write_bytes((lab.server.home / "tls" / "ca.pem").read_bytes())
    url = f"https://{laptop.gateway}:{lab.server.env['GPUCLUSTERS_TLS_PORT']}"
    lab.user("login", "--url", url, "--api-key", key, "--ca-file", f"{laptop.home}/ca.pem")
    laptop.run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
               f"{laptop.home}/.ssh/id_ed25519", check=True)  # fmt: skip
    lab.user("ssh-keys", "add", f"{laptop.home}/.ssh/id_ed25519.pub")
    endpoint = json.loads(lab.user("clusters", "get", "x", "--output", "json"))["ssh_endpoint"]

    def ssh(command: str) -> str:
        argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-p", str(endpoint["port"]), f"alice@{endpoint['host']}", command]  # fmt: skip
        deadline = time.monotonic() + 60
        while True:  # alice's account reaches the nodes with the next access sync
            try:
                r = laptop.run(*argv, timeout=180)
            except subprocess.TimeoutExpired:
                jobs = lab.server.cli("clusters", "ssh", "x", "--as-root", "--", "sh", "-c",
                                      "squeue -a -o '%i %u %T %R'; scontrol show job; "
                                      "tail -20 /var/log/gpuclusters/slurmctld.log")  # fmt: skip
                pytest.fail(f"ssh {command} hung:\n{jobs.stdout}{jobs.stderr}\n{lab.host_logs()}")
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert r.returncode == 0, f"laptop: ssh {command}\n{r.stdout}\n{r.stderr}"
        return str(r.stdout)

    # The nodes boot from the node image hosts add shipped, not the host's /usr.
    assert "slurmd" in ssh("cat /etc/gpuclusters-node-packages").split()
    # hosts add left its wheels in the host's /opt: not the node's /opt.
    assert lab.hosts[0].run("ls /opt/gpuclusters/wheels | wc -l").stdout.strip() != "0"
    assert ssh("test -e /opt/gpuclusters/wheels || echo absent").strip() == "absent"
    out = ssh("sbatch --wait -N2 -o hn-%j.out --wrap 'srun hostname'")
    job = out.split()[-1]
    printed = ssh(f"cat hn-{job}.out").split()
    assert sorted(printed) == sorted(n["name"] for n in nodes)
    one, two = sorted(nodes, key=lambda n: n["host"])
    ssh(f"srun -N1 -w {one['name']} sh -c 'echo written-on-gpu-1 > /mnt/shared/across.txt'")
    read = ssh(f"srun -N1 -w {two['name']} cat /mnt/shared/across.txt")
    assert read.strip() == "written-on-gpu-1"
    # The nodes ran in user namespaces on the hosts: the job's file belongs,
    # on the operator's file system, to alice's uid in the project's block.
    uid = int(ssh("id -u"))
    projects = lab.json("projects", "list")
    first = next(p["host_ids"]["first"] for p in projects if p["name"] == "default")
    volumes = Path(lab.server.env["GPUCLUSTERS_VOLUMES_DIR"])
    written = next(volumes.glob("*/data/across.txt"))
    assert written.stat().st_uid == first + uid


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
