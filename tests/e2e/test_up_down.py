"""``gpuclusters up --detach`` and ``gpuclusters down [--purge]``, as an
operator runs them: the server in the background, returning once it
answers; both idempotent; ``down --purge`` deletes the clusters and volumes
and leaves no namespace, mount, process or iptables chain of the service
behind (checked here against what the cluster had made, so the checks can
fail).

Needs root and Debian's Slurm (scripts/setup).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gpuclusters.cli.lifecycle import process_running
from gpuclusters.core.serverpids import servers_dir
from gpuclusters.linux import firewall
from gpuclusters.providers.netns.state import ProviderState
from support.processes import console_script

if TYPE_CHECKING:
    from support.servers import Servers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the embedded fleet needs root"),
    pytest.mark.skipif(shutil.which("slurmctld") is None, reason="run scripts/setup first"),
]


def iptables_chains() -> set[str]:
    out = ""
    for table in ("filter", "nat"):
        out += subprocess.run(
            ["iptables-save", "-t", table], capture_output=True, text=True, check=True
        ).stdout
    return {line.split()[0][1:] for line in out.splitlines() if line.startswith(":GPC")}


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_up_detach_then_down_purge_leaves_nothing(server_factory: Servers) -> None:
    handle = server_factory(provider="netns", start=False)
    env = dict(handle.env)
    home = handle.home

    def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*console_script(), *args], env=env, capture_output=True, text=True, timeout=timeout
        )

    # Nothing runs: `down` says so and succeeds (idempotent).
    r = cli("down")
    assert r.returncode == 0 and "no server runs" in r.stderr, r.stderr

    r = cli("up", "--detach", "--port", str(handle.port))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "is up" in r.stdout and str(home / "server.log") in r.stdout
    (pid,) = [int(p.name) for p in servers_dir(home).iterdir()]
    assert process_running(pid)
    # A second start changes nothing.
    again = cli("up", "--detach", "--port", str(handle.port))
    assert again.returncode == 0 and f"already runs for {home} (pid {pid})" in again.stdout
    assert [int(p.name) for p in servers_dir(home).iterdir()] == [pid]

    r = cli("clusters", "create", "ud", "--type", "slurm", "--gpus", "8", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    state = ProviderState.load(home / "netns-provider.json")
    ours = {rec.layout.netns for rec in state.nodes.values()}
    cluster_chains = {c for c in iptables_chains() if c[:4] in ("GPCF", "GPCN", "GPCP")}
    # What the checks below look for is there now.
    assert ours and ours <= netns_names()
    assert cluster_chains and "GPC-INPUT" in iptables_chains()
    volumes = json.loads(cli("volumes", "list", "--output", "json").stdout)
    assert [v["name"] for v in volumes] == ["ud-shared"]

    r = cli("down", "--purge")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "deleted 1 cluster(s) and 1 volume(s)" in r.stderr, r.stderr
    assert not process_running(pid)  # `down` returns once it has exited
    assert not list(servers_dir(home).iterdir())
    assert not ours & netns_names()
    assert not iptables_chains(), iptables_chains()
    assert not Path(firewall.FORWARD_BEFORE).exists()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(home) not in mounts
    leftover = subprocess.run(["pgrep", "-f", str(home)], capture_output=True, text=True)
    assert leftover.stdout == "", leftover.stdout
    # Stopped and purged: a second `down` changes nothing.
    assert cli("down").returncode == 0
