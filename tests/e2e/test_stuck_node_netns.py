"""A node whose boot keeps failing, on the embedded fleet, seen as a user
sees it (issue 26's acceptance): ``nodes get`` shows its retries, last error
and next attempt while the provider keeps failing; past the phase's
deadline the node is failed with that reason; ``clusters delete --wait``
then finishes, and nothing of the cluster is left (namespaces, processes,
mounts).

The failure is a storage outage after the cluster came up: the shared
volume's data directory is moved away (and put back afterwards, nothing in
it touched), so every attempt to make the node a scale-up adds fails with
``volume ... has no data directory``.

Needs root and the embedded fleet's tools (scripts/setup installs them).
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

from gpuclusters.providers.netns.state import ProviderState

if TYPE_CHECKING:
    from support.servers import ServerHandle, Servers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="the embedded fleet needs root"),
    pytest.mark.skipif(shutil.which("slurmctld") is None, reason="run scripts/setup first"),
]

SCHEDULING_DEADLINE_S = 30


def ok(server: ServerHandle, *args: str, timeout: float = 300) -> str:
    r = server.cli(*args, timeout=timeout)
    assert r.returncode == 0, f"gpuclusters {' '.join(args)}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def get_json(server: ServerHandle, *args: str) -> dict[str, Any]:
    return dict(json.loads(ok(server, *args, "--output", "json")))


def until(what: str, check: Any, *, timeout: float, describe: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {describe() if describe else ''}")
        time.sleep(0.5)


def of_cluster(home: Path, cluster_id: str) -> dict[str, set[str]]:
    """What of the cluster is on this machine now: the network namespaces
    of its nodes (GPU and service nodes, as the provider recorded them),
    the processes inside those, and the mounts of this machine's mount
    namespace that name one of its nodes (pinned namespaces, disks)."""
    state = ProviderState.load(home / "netns-provider.json")
    recs = [r for r in state.nodes.values() if r.cluster_id == cluster_id]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    present = {line.split()[0] for line in listed.splitlines() if line.strip()}
    netns = {r.layout.netns for r in recs} & present
    inodes = {os.stat(f"/run/netns/{n}").st_ino for n in netns}
    procs = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino in inodes:
                procs.add(_process(pid))
        except OSError:
            continue
    dirs = [r.node_id for r in recs]
    mounts = {
        line
        for line in Path("/proc/mounts").read_text().splitlines()
        if any(d in line for d in dirs)
    }
    return {"netns": netns, "processes": procs, "mounts": mounts, "dirs": set(dirs)}


def _process(pid: str) -> str:
    """A process's identity: its pid and start time (a pid alone may be
    given to a new process once the old one is gone)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    return f"{pid}:{stat.rsplit(')', 1)[1].split()[19]}:{cmd}"


def _alive(identity: str) -> bool:
    """Still running: the same process, and not a zombie (one that exited
    and waits for its parent, the server, to reap it, as a node's kept
    shell helper does for a moment after the node is powered off)."""
    pid = identity.split(":", 1)[0]
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" and _process(pid) == identity
    except OSError:
        return False


def still_there(before: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which of what was there before is there still."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    present = {line.split()[0] for line in listed.splitlines() if line.strip()}
    mounts = Path("/proc/mounts").read_text()
    return {
        "netns": before["netns"] & present,
        "processes": {p for p in before["processes"] if _alive(p)},
        "mounts": {d for d in before["dirs"] if d in mounts},
    }


def test_a_node_that_keeps_failing_shows_why_fails_at_its_deadline_and_is_deleted(
    server_factory: Servers,
) -> None:
    server = server_factory(
        provider="netns",
        env={
            "GPUCLUSTERS_NODE_PHASE_DEADLINES_S": json.dumps({"scheduling": SCHEDULING_DEADLINE_S}),
            "GPUCLUSTERS_RETRY_BACKOFF_CAP_S": "4",
        },
    )
    ok(server, "volumes", "create", "data")
    until(
        "the volume",
        lambda: get_json(server, "volumes", "get", "data")["status"] == "available",
        timeout=60,
    )
    (data,) = (server.home / "volumes").glob("*/data")
    (data / "kept.txt").write_text("written before the outage\n")
    away = data.with_name("data.away")
    ok(server, "clusters", "create", "stuck", "--type", "kubernetes", "--gpus", "8",
       "--volume", "data", "--wait")  # fmt: skip
    (first,) = [n["name"] for n in get_json(server, "clusters", "get", "stuck")["nodes"]]
    data.rename(away)  # the outage
    try:
        ok(server, "clusters", "scale", "stuck", "--gpus", "16")
        (node_name,) = [
            n["name"] for n in get_json(server, "clusters", "get", "stuck")["nodes"]
            if n["name"] != first
        ]  # fmt: skip

        def failing() -> dict[str, Any] | None:
            node = get_json(server, "nodes", "get", node_name)
            return node if node["retries"] >= 2 else None

        node = until(
            "the node's failed attempts",
            failing,
            timeout=60,
            describe=lambda: ok(server, "nodes", "get", node_name),
        )
        assert node["phase"] == "scheduling"
        assert "has no data directory" in node["last_error"], node
        assert node["next_attempt_at"] is not None and node["phase_deadline_at"] is not None
        shown = ok(server, "nodes", "get", node_name)
        for row in ("retries", "last error", "next attempt", "deadline", "no data directory"):
            assert row in shown, shown

        node = until(
            "the deadline to fail the node",
            lambda: (n := get_json(server, "nodes", "get", node_name))["phase"] == "failed" and n,
            timeout=SCHEDULING_DEADLINE_S + 60,
            describe=lambda: ok(server, "nodes", "get", node_name),
        )
        assert node["message"].startswith(
            f"still scheduling after its deadline ({SCHEDULING_DEADLINE_S} s); last error: "
            "placing node"
        ) or node["message"].startswith(
            f"still scheduling after its deadline ({SCHEDULING_DEADLINE_S} s); last error: volume"
        ), node
        assert "has no data directory" in node["message"]
        events = json.loads(ok(server, "events", "--output", "json"))
        assert any(e["reason"] == "NodeFailed" and e["node"] == node_name for e in events), events
        # The cluster was ready before: the failed scale-up degrades it.
        until(
            "the cluster to degrade",
            lambda: get_json(server, "clusters", "get", "stuck")["status"] == "degraded",
            timeout=30,
        )
        before = of_cluster(server.home, _cluster_id(server))
        # The control plane's node runs: the checks after the delete can fail.
        assert before["netns"] and before["processes"] and before["mounts"], before
    finally:
        away.rename(data)  # the storage is back; nothing in it was touched
    assert (data / "kept.txt").read_text() == "written before the outage\n"

    ok(server, "clusters", "delete", "stuck", "--wait", timeout=600)
    r = server.cli("clusters", "get", "stuck")
    assert r.returncode != 0 and "not found" in (r.stdout + r.stderr).lower()
    assert still_there(before) == {"netns": set(), "processes": set(), "mounts": set()}
    assert (data / "kept.txt").exists()  # the volume outlives the cluster


def _cluster_id(server: ServerHandle) -> str:
    """The id of the server's one cluster, as its provider knows it."""
    state = ProviderState.load(server.home / "netns-provider.json")
    ids = {r.cluster_id for r in state.nodes.values()}
    assert len(ids) == 1, ids
    return next(iter(ids))
