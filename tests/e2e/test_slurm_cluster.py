"""Real Slurm clusters on the embedded fleet (netns provider), end to end,
through the real server and CLI: the issue's acceptance steps, scaling with a
user-drained node, isolation between two clusters, delete keeping the
volume, and kill -9 during a create.

Needs root, Debian's Slurm/munge/MariaDB (scripts/setup installs them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpuclusters.layers.kubernetes.config import DEFAULT_BIN_DIR

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the embedded fleet needs root"),
    pytest.mark.skipif(shutil.which("slurmctld") is None, reason="run scripts/setup first"),
]
P = "/v1/projects/default"
KUBECTL = DEFAULT_BIN_DIR / "kubectl"


def ok(server: ServerHandle, *args: str, timeout: float = 120) -> str:
    r = server.cli(*args, timeout=timeout)
    assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def ssh(server: ServerHandle, cluster: str, *cmd: str, node: str | None = None) -> str:
    extra = ["--node", node] if node else []
    return ok(server, "clusters", "ssh", cluster, *extra, "--", *cmd)


def cluster(server: ServerHandle, name: str) -> dict[str, Any]:
    return json.loads(ok(server, "clusters", "get", name, "--output", "json"))


def sinfo(server: ServerHandle, name: str) -> list[list[str]]:
    out = ssh(server, name, "sinfo", "-N", "-h", "-o", "%N %T %G")
    return sorted(line.split() for line in out.splitlines() if line.strip())


def k8s_nodes(kubeconfig: Path) -> list[tuple[str, str]]:
    """(name, allocatable GPUs) of the Ready nodes Kubernetes lists."""
    out = subprocess.run(
        [str(KUBECTL), f"--kubeconfig={kubeconfig}", "get", "nodes", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return sorted(
        (n["metadata"]["name"], n["status"]["allocatable"].get("nvidia.com/gpu", "0"))
        for n in json.loads(out)["items"]
        if {c["type"]: c["status"] for c in n["status"]["conditions"]}.get("Ready") == "True"
    )


def our_namespaces(server: ServerHandle) -> set[str]:
    state = server.home / "netns-provider.json"
    if not state.exists():
        return set()
    ids = json.loads(state.read_text())["nodes"]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    present = {line.split()[0] for line in listed.splitlines() if line.strip()}
    return {f"gpc-{i[:12]}" for i in ids} & present


def wait_nodes(server: ServerHandle, name: str, count: int) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        c = cluster(server, name)
        ok_ = c["status"] == "ready" and len(c["nodes"]) == count
        return c if ok_ and len(sinfo(server, name)) == count else None

    result: dict[str, Any] = server.wait_for(f"{name} at {count} nodes", done, timeout=90)
    return result


def test_slurm_cluster_end_to_end(server_factory: Servers) -> None:
    server = server_factory(provider="netns")
    created = json.loads(
        ok(
            server,
            "clusters",
            "create",
            "demo",
            "--type",
            "slurm",
            "--gpus",
            "16",
            "--wait",
            "--output",
            "json",
        )
    )
    assert created["status"] == "ready" and len(created["nodes"]) == 2
    assert sinfo(server, "demo") == sorted([n["name"], "idle", "gpu:8"] for n in created["nodes"])
    # Slurm clusters run Kubernetes too: every compute node is registered in both.
    kubeconfig = server.home.parent / "demo.kubeconfig"
    ok(server, "clusters", "credentials", "demo", "--file", str(kubeconfig))
    assert k8s_nodes(kubeconfig) == sorted((n["name"], "8") for n in created["nodes"])
    # Jobs run as the member's own account (uid 10000), not root.
    assert ssh(server, "demo", "id", "-un").strip() == "admin"
    ssh(
        server,
        "demo",
        "sbatch",
        "--wait",
        "-N2",
        "--gres=gpu:8",
        "-o",
        "/mnt/shared/out.txt",
        "--wrap",
        "srun hostname",
    )
    out = ssh(server, "demo", "cat", "/mnt/shared/out.txt").split()
    assert sorted(out) == sorted(n["name"] for n in created["nodes"])
    server.wait_for(
        "job accounted",
        lambda: (
            ssh(server, "demo", "sacct", "-n", "-X", "-o", "State").split()[:1] == ["COMPLETED"]
        ),
        timeout=30,
    )
    env_out = ssh(server, "demo", "srun", "--gres=gpu:8", "printenv", "CUDA_VISIBLE_DEVICES")
    assert env_out.strip() == "0,1,2,3,4,5,6,7"

    # A prolog saved through the API is applied live (scontrol reconfigure).
    prolog = server.home.parent / "prolog.sh"
    prolog.write_text('#!/bin/sh\ntouch "/mnt/shared/prolog-ran-$SLURM_JOB_ID"\n')
    ok(server, "clusters", "configure", "demo", "--prolog", str(prolog))
    server.wait_for(
        "prolog configured",
        lambda: "/etc/slurm/prolog.sh" in ssh(server, "demo", "scontrol", "show", "config"),
        timeout=30,
    )
    job = ssh(server, "demo", "sbatch", "--parsable", "--wait", "-N1", "--wrap", "true").strip()
    assert ssh(server, "demo", "ls", f"/mnt/shared/prolog-ran-{job}").strip()

    # Scale 2 -> 3 -> 1; a node the user drained goes first.
    ok(server, "clusters", "scale", "demo", "--gpus", "24")
    three = wait_nodes(server, "demo", 3)
    newest = max(three["nodes"], key=lambda n: n["created_at"])["name"]
    drained = sorted(n["name"] for n in three["nodes"] if n["name"] != newest)[0]
    ssh(
        server,
        "demo",
        "scontrol",
        "update",
        f"nodename={drained}",
        "state=drain",
        "reason=user maintenance",
    )
    # A job running on a node that goes is requeued, not lost.
    job = ssh(server, "demo", "sbatch", "--parsable", "-w", newest, "--wrap", "sleep 600").strip()
    server.wait_for(
        "job running",
        lambda: ssh(server, "demo", "squeue", "-h", "-j", job, "-o", "%T").strip() == "RUNNING",
        timeout=30,
    )
    ok(server, "clusters", "scale", "demo", "--gpus", "8")
    one = wait_nodes(server, "demo", 1)
    assert drained not in {n["name"] for n in one["nodes"]}
    assert newest not in {n["name"] for n in one["nodes"]}
    assert "Restarts=1" in ssh(server, "demo", "scontrol", "show", "job", job)
    assert k8s_nodes(kubeconfig) == [(one["nodes"][0]["name"], "8")]
    ssh(server, "demo", "scancel", job)

    # Ctrl-C and start again: the cluster is re-adopted as it was.
    assert server.stop() == 0
    server.start()
    assert wait_nodes(server, "demo", 1)["nodes"][0]["name"] == one["nodes"][0]["name"]
    events = json.loads(ok(server, "events", "--cluster", "demo", "--output", "json"))
    assert sum(e["reason"] == "ScaledDown" for e in events) == 2

    # A second cluster: no route between them, and munge keys differ.
    ok(server, "clusters", "create", "other", "--type", "slurm", "--gpus", "8", "--wait")
    other_ctl = ssh(server, "other", "getent", "hosts", "other-controller").split()[0]
    demo_ctl = ssh(server, "demo", "getent", "hosts", "demo-controller").split()[0]
    probe = "timeout 3 bash -c 'echo > /dev/tcp/{}/6817' && echo open || echo closed"
    assert ssh(server, "demo", "bash", "-c", probe.format(demo_ctl)).strip() == "open"
    assert ssh(server, "demo", "bash", "-c", probe.format(other_ctl)).strip() == "closed"
    cred = ssh(server, "demo", "munge", "-n").strip()
    refused = server.cli("clusters", "ssh", "other", "--", "bash", "-c", f"echo '{cred}' | unmunge")
    assert refused.returncode != 0
    accepted = server.cli("clusters", "ssh", "demo", "--", "bash", "-c", f"echo '{cred}' | unmunge")
    assert accepted.returncode == 0

    # Delete: every daemon and namespace goes; the volume and its data stay.
    assert our_namespaces(server)
    ok(server, "clusters", "delete", "demo", "--wait")
    ok(server, "clusters", "delete", "other", "--wait", "--delete-volume")
    assert our_namespaces(server) == set()
    volumes = json.loads(ok(server, "volumes", "list", "--output", "json"))
    assert [(v["name"], v["status"]) for v in volumes] == [("demo-shared", "available")]
    data = next((server.home / "volumes").glob("*/data"))
    assert (data / "out.txt").read_text().split() == out
    # Written by uid 10000 in a node whose user namespace maps the project's
    # block: on the host, the block's first id + 10000 (docs/security.md).
    projects = json.loads(ok(server, "projects", "list", "--output", "json"))
    first = next(p["host_ids"]["first"] for p in projects if p["name"] == "default")
    assert (data / "out.txt").stat().st_uid == first + 10000
    leftovers = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(server.home) not in leftovers.replace(f"--port {server.port}", "")


HOST_FILES = ("/etc/passwd", "/etc/group", "/etc/munge/munge.key", "/etc/slurm", "/var/spool")


def host_snapshot() -> dict[str, object]:
    """What a node must never change on the host (nodes see the host's /etc
    and /var only through their own overlays)."""
    snap: dict[str, object] = {}
    for name in HOST_FILES:
        path = Path(name)
        if path.is_dir():
            snap[name] = sorted(p.name for p in path.iterdir())
        elif path.exists():
            snap[name] = path.stat().st_mtime_ns
    return snap


def test_kill9_during_slurm_create_converges(server_factory: Servers) -> None:
    before = host_snapshot()
    server = server_factory(provider="netns")
    with server.client() as api:
        r = api.post(
            f"{P}/clusters", json={"name": "crash", "cluster_type": "slurm", "num_gpus": 16}
        )
        assert r.status_code == 201
        server.wait_for(
            "control plane starting",
            lambda: api.get(f"{P}/clusters/crash").json()["status"] != "queued",
            timeout=30,
            interval=0.02,
        )
    server.kill9()
    time.sleep(0.2)
    server.start()
    with server.client() as api:
        server.wait_for(
            "ready after restart",
            lambda: api.get(f"{P}/clusters/crash").json()["status"] == "ready",
            timeout=120,
        )
        nodes = api.get(f"{P}/clusters/crash").json()["nodes"]
    assert len(nodes) == 2 and len({n["host"] for n in nodes}) == 2
    assert sinfo(server, "crash") == sorted([n["name"], "idle", "gpu:8"] for n in nodes)
    state = json.loads((server.home / "netns-provider.json").read_text())["nodes"]
    gpu_nodes = [r for r in state.values() if r["kind"] == "gpu"]
    services = sorted(r["role"] for r in state.values() if r["kind"] != "gpu")
    assert sorted(r["name"] for r in gpu_nodes) == sorted(n["name"] for n in nodes)
    assert services == ["control-plane", "controller", "login"]
    ok(server, "clusters", "delete", "crash", "--wait")
    assert our_namespaces(server) == set()
    assert host_snapshot() == before
