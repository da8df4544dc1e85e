"""Crash safety of the control plane against a real server process.

The fake provider keeps its instances in ``fake-provider.sqlite``, so they
survive ``kill -9`` of the server like real VMs: these tests kill the server
in the middle of work, start it again on the same home, and check that the
cluster converges with no duplicate or orphaned nodes.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
import uuid
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from support.fleets import four_hosts

if TYPE_CHECKING:  # fixtures' types; the classes live in this directory's conftest
    from support.servers import ServerHandle, Servers

pytestmark = pytest.mark.slow

PROJECT = "/v1/projects/default"


def cluster_status(api: httpx.Client, name: str) -> str | None:
    r = api.get(f"{PROJECT}/clusters/{name}")
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return str(r.json()["status"])


def nodes_of(
    api: httpx.Client, name: str, *, include_deleted: bool = False
) -> list[dict[str, Any]]:
    r = api.get(
        f"{PROJECT}/nodes",
        params={"cluster": name, "include_deleted": str(include_deleted).lower()},
    )
    r.raise_for_status()
    return list(r.json())


def hosts_in_use(api: httpx.Client) -> dict[str, dict[str, Any]]:
    r = api.get("/v1/hosts", params={"limit": 1000})
    r.raise_for_status()
    return {h["name"]: h for h in r.json() if h["node"] is not None}


def rewind_to_scheduling(server: ServerHandle, node_ids: list[str]) -> str:
    """Put one booting node's row back to ``scheduling`` in the (stopped)
    server's database: the state a crash leaves when it strikes between the
    provider's create and the row recording it. Returns that node's id."""
    assert not server.running
    with contextlib.closing(sqlite3.connect(server.home / "gpuclusters.db")) as db:
        for node_id in node_ids:
            cur = db.execute(
                "UPDATE nodes SET phase = 'scheduling' WHERE id = ? AND phase = 'booting'",
                (node_id,),
            )
            if cur.rowcount == 1:
                db.commit()
                return node_id
    raise AssertionError(f"no booting node row among {node_ids}")


def create_cluster(api: httpx.Client, name: str, num_gpus: int) -> None:
    r = api.post(
        f"{PROJECT}/clusters",
        json={"name": name, "cluster_type": "slurm", "num_gpus": num_gpus},
    )
    assert r.status_code == 201, r.text


def wait_ready(server: ServerHandle, api: httpx.Client, name: str, timeout: float) -> None:
    def ready() -> bool:
        status = cluster_status(api, name)
        if status == "failed":
            r = api.get(f"{PROJECT}/clusters/{name}")
            pytest.fail(f"cluster {name} failed instead of becoming ready: {r.text}")
        return status == "ready"

    server.wait_for(
        f"cluster {name} to be ready",
        ready,
        timeout=timeout,
        interval=0.2,
        describe=lambda: api.get(f"{PROJECT}/clusters/{name}").text,
    )


def wait_gone(server: ServerHandle, api: httpx.Client, name: str, timeout: float) -> None:
    server.wait_for(
        f"cluster {name} to be deleted",
        lambda: cluster_status(api, name) is None,
        timeout=timeout,
        interval=0.2,
        describe=lambda: api.get(f"{PROJECT}/clusters/{name}").text,
    )


def test_kill9_during_create_converges_without_duplicates(server_factory: Servers) -> None:
    server = server_factory(boot_delay_s=3.0)
    with server.client() as api:
        create_cluster(api, "crash", 32)

        # Wait until the provider has been asked for at least one node, but
        # the cluster is not ready yet: the middle of the create.
        def mid_create() -> bool:
            phases = [n["phase"] for n in nodes_of(api, "crash")]
            return "booting" in phases and cluster_status(api, "crash") != "ready"

        server.wait_for("a node to be booting", mid_create, timeout=15, interval=0.05)

    server.kill9()

    # The crash left real (fake) VMs behind: the restart must adopt them.
    before = server.instances()
    assert 1 <= len(before) <= 4, before
    assert {r["cluster_id"] for r in before.values()} == {next(iter(before.values()))["cluster_id"]}
    assert len({r["host"] for r in before.values()}) == len(before)
    assert all(r["boots"] == 1 and r["provisions"] == 1 for r in before.values())
    # Widen the crash to its worst moment for one node: the provider made the
    # instance, but the control plane never recorded that it asked.
    rewound = rewind_to_scheduling(server, sorted(before))

    server.restart()
    with server.client() as api:
        wait_ready(server, api, "crash", timeout=60)

        live = nodes_of(api, "crash")
        assert len(live) == 4, live
        assert all(n["phase"] == "running" for n in live), live
        node_hosts = {n["name"]: n["host"] for n in live}
        assert None not in node_hosts.values()
        assert len(set(node_hosts.values())) == 4, node_hosts
        # No node row was replaced by a second one: the create made 4, ever.
        assert len(nodes_of(api, "crash", include_deleted=True)) == 4

        after = server.instances()
        assert len(after) == 4, after
        assert {r["name"]: r["host"] for r in after.values()} == node_hosts
        # The instances that existed at the crash were adopted, not recreated.
        for node_id, rec in before.items():
            assert node_id in after, f"instance {rec['name']} was replaced"
            assert after[node_id]["booted_at"] == rec["booted_at"]
            assert after[node_id]["boots"] == 1
            assert after[node_id]["host"] == rec["host"]
        assert after[rewound]["booted_at"] == before[rewound]["booted_at"]

        used = hosts_in_use(api)
        assert set(used) == set(node_hosts.values())
        assert {h["node"] for h in used.values()} == set(node_hosts)
        assert {h["cluster"] for h in used.values()} == {"crash"}

        r = api.delete(f"{PROJECT}/clusters/crash")
        assert r.status_code == 202, r.text
        wait_gone(server, api, "crash", timeout=30)
        assert server.instances() == {}
        assert hosts_in_use(api) == {}


def test_kill9_during_delete_finishes_the_delete(server_factory: Servers) -> None:
    server = server_factory(boot_delay_s=0.2)
    with server.client() as api:
        create_cluster(api, "doomed", 32)
        wait_ready(server, api, "doomed", timeout=30)
        assert len(server.instances()) == 4

        r = api.delete(f"{PROJECT}/clusters/doomed")
        assert r.status_code == 202, r.text
        server.kill9()  # at once: the reconcilers have barely started releasing
    assert r.json()["status"] == "deleting"

    left = server.instances()
    assert left, "the delete had already finished before the kill; the test proves nothing"

    server.restart()
    with server.client() as api:
        # Well under the 30 s lease TTL: the dead process's leases must be freed at start.
        wait_gone(server, api, "doomed", timeout=15)
        assert server.instances() == {}
        assert hosts_in_use(api) == {}
        # (?cluster= names only live clusters, so filter the project's nodes here.)
        r = api.get(f"{PROJECT}/nodes", params={"include_deleted": "true"})
        r.raise_for_status()
        gone = [n for n in r.json() if n["cluster"] == "doomed"]
        assert len(gone) == 4, gone
        assert all(n["phase"] == "deleted" and n["deleted_at"] for n in gone), gone

        # The cluster's volume outlives it (deleted only with delete_volume).
        r = api.get(f"{PROJECT}/volumes")
        r.raise_for_status()
        volumes = {v["name"]: v for v in r.json()}
        assert "doomed-shared" in volumes, volumes
        assert volumes["doomed-shared"]["status"] == "available"
        assert volumes["doomed-shared"]["cluster"] is None

        # The name is free again, and the kept volume can be attached to it.
        r = api.post(
            f"{PROJECT}/clusters",
            json={
                "name": "doomed",
                "cluster_type": "slurm",
                "num_gpus": 8,
                "volume": "doomed-shared",
            },
        )
        assert r.status_code == 201, r.text
        assert r.json()["volume"] == "doomed-shared"


def test_orphaned_instance_is_collected_at_start(server_factory: Servers) -> None:
    server = server_factory(boot_delay_s=0.0)
    with server.client() as api:
        create_cluster(api, "keep", 16)
        wait_ready(server, api, "keep", timeout=30)
        r = api.get("/v1/hosts", params={"limit": 1000})
        r.raise_for_status()
        free = [h["name"] for h in r.json() if h["node"] is None and h["gpu_type"] == "H100_SXM"]
    assert free
    assert server.stop() == 0

    legit = server.instances()
    assert len(legit) == 2
    orphan_id = uuid.uuid4().hex
    orphan = {
        "name": "ghost-0",
        "cluster_id": uuid.uuid4().hex,
        "host": free[0],
        "compute_class": "standard",
        "booted_at": time.time() - 60,
        "boots": 1,
        "provisions": 1,
    }
    server.write_instances({**legit, orphan_id: orphan})

    server.start()
    server.wait_for(
        "the orphaned instance to be deleted",
        lambda: orphan_id not in server.instances(),
        timeout=5,
    )
    assert server.instances() == legit  # the cluster's own nodes are untouched
    assert orphan_id in server.log
    with server.client() as api:
        assert cluster_status(api, "keep") == "ready"
        assert {n["phase"] for n in nodes_of(api, "keep")} == {"running"}
        assert free[0] not in hosts_in_use(api)


def test_sigint_stops_cleanly_and_leaves_nodes_running(server_factory: Servers) -> None:
    server = server_factory(boot_delay_s=5.0)
    with server.client() as api:
        create_cluster(api, "live", 16)
        server.wait_for(
            "the nodes to be booting",
            lambda: {n["phase"] for n in nodes_of(api, "live")} == {"booting"},
            timeout=15,
            interval=0.05,
        )
    started = time.monotonic()
    rc = server.stop(timeout=30)
    elapsed = time.monotonic() - started
    assert rc == 0, server.log
    assert elapsed < 30
    log = server.log
    assert "Application shutdown complete" in log
    assert "Traceback" not in log, log
    # Stopping the control plane does not stop the nodes.
    assert len(server.instances()) == 2


def test_kill9_during_a_reclaim_converges(server_factory: Servers) -> None:
    """A crash right after a create reclaimed a preemptible host: after the
    restart the preemption finishes, the new node takes the host, the pool
    keeps what fits, and no host or node is doubled."""
    server = server_factory(boot_delay_s=1.0, start=False)
    fleet = four_hosts(server.home.parent / "fleet4.yaml")
    server.env["GPUCLUSTERS_FLEET_FILE"] = str(fleet)
    server.start()
    with server.client() as api:
        r = api.post(
            f"{PROJECT}/clusters",
            json={"name": "p1", "cluster_type": "slurm", "num_gpus": 8,
                  "num_preemptible_gpus": 16},
        )  # fmt: skip
        assert r.status_code == 201, r.text
        server.wait_for(
            "the preemptible pool to fill",
            lambda: api.get(f"{PROJECT}/clusters/p1").json()["allocated_preemptible_gpus"] == 16,
            timeout=30,
            interval=0.1,
        )
        create_cluster(api, "s2", 16)
    server.kill9()

    server.restart()
    with server.client() as api:
        wait_ready(server, api, "s2", timeout=60)
        server.wait_for(
            "p1 to settle at one preemptible node",
            lambda: (
                [n["phase"] for n in nodes_of(api, "p1") if n["compute_class"] == "preemptible"]
                == ["running"]
            ),
            timeout=30,
            interval=0.2,
        )
        events = api.get(f"{PROJECT}/events", params={"limit": 1000, "cluster": "p1"}).json()
        preempted = [e for e in events if e["reason"] == "Preempted"]
        assert len(preempted) == 1 and preempted[0]["count"] == 1, events
        assert len(nodes_of(api, "s2", include_deleted=True)) == 2  # made once
        used = hosts_in_use(api)
        assert len(used) == 4 and len({h["node"] for h in used.values()}) == 4
        assert len(server.instances()) == 4
        assert {r["host"] for r in server.instances().values()} == set(used)
