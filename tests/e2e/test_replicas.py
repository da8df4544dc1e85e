"""Two server replicas on one PostgreSQL database and one home (docs/ha.md).

Both serve the API and share the controllers' work through leases. A burst
of creates and deletes goes to both in turn, one replica is killed with
SIGKILL in the middle of it, and the survivor must finish everything: each
cluster converges, no node is duplicated or orphaned, no host holds two
nodes, and the fake provider (``fake-provider.sqlite`` in the shared home,
like real VMs) holds exactly one instance per live node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from support.postgres import PostgresServer

if TYPE_CHECKING:  # fixtures' types; the classes live in this directory's conftest
    from support.servers import ServerHandle, Servers

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

PROJECT = "/v1/projects/default"
LEASE_TTL_S = 4.0


@pytest.fixture
def database_url(postgres_server: PostgresServer) -> Iterator[str]:
    with postgres_server.temporary_database("replicas") as url:
        yield url


def fleet(path: Path, hosts: int) -> Path:
    path.write_text(
        "hosts:\n"
        + "".join(
            f"  - {{name: h{i:02d}, gpu_type: H100_SXM, region: local-1, ib_island: ib-{i // 4}}}\n"
            for i in range(hosts)
        )
    )
    return path


def query(url: str, sql: str) -> list[tuple[Any, ...]]:
    async def run() -> list[tuple[Any, ...]]:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                return [tuple(r) for r in await conn.execute(text(sql))]
        finally:
            await engine.dispose()

    return asyncio.run(run())


def start_pair(
    servers: Servers, tmp_path: Path, database_url: str, *, b_env: dict[str, str] | None = None
) -> list[ServerHandle]:
    """Replicas A and B on one database and home; ``b_env`` adds settings to B."""
    home = tmp_path / "shared-home"
    env = {
        "GPUCLUSTERS_DATABASE_URL": database_url,
        "GPUCLUSTERS_FLEET_FILE": str(fleet(tmp_path / "fleet.yaml", 16)),
        "GPUCLUSTERS_LEASE_TTL_S": str(LEASE_TTL_S),
    }
    a = servers(boot_delay_s=0.3, home=home, env=env)
    b = servers(boot_delay_s=0.3, home=home, env=env | (b_env or {}))
    return [a, b]


def test_two_replicas_serve_the_same_state(
    database_url: str, server_factory: Servers, tmp_path: Path
) -> None:
    a, b = start_pair(server_factory, tmp_path, database_url)
    key = a.api_key
    assert b.api_key == key  # the second replica kept the first one's admin key
    with a.client(key) as api_a, b.client(key) as api_b:
        r = api_a.post(
            f"{PROJECT}/clusters",
            json={"name": "shared", "cluster_type": "kubernetes", "num_gpus": 8},
        )
        assert r.status_code == 201, r.text
        # Made on one, seen and refused as a duplicate on the other.
        listed = b.wait_for(
            "the other replica to list it",
            lambda: [c["name"] for c in api_b.get(f"{PROJECT}/clusters").json()],
            timeout=10,
        )
        assert listed == ["shared"]
        r = api_b.post(
            f"{PROJECT}/clusters",
            json={"name": "shared", "cluster_type": "kubernetes", "num_gpus": 8},
        )
        assert r.status_code == 409 and r.json()["code"] == "already_exists", r.text
    # One admin, one project: the replicas did not each bootstrap their own.
    assert query(database_url, "SELECT count(*) FROM users") == [(1,)]
    assert query(database_url, "SELECT count(*) FROM projects") == [(1,)]


def test_survivor_finishes_the_work_of_a_replica_killed_mid_burst(
    database_url: str, server_factory: Servers, tmp_path: Path
) -> None:
    # B's provider takes 3 s per create (a slow cloud API), so a node B
    # claims to provision stays leased by B for 3 s: long enough to be seen
    # and to be killed in the middle of it. (With instant creates B's leases
    # last milliseconds and the poll below could miss every one.)
    a, b = start_pair(
        server_factory, tmp_path, database_url, b_env={"GPUCLUSTERS_FAKE_CREATE_DELAY_S": "3"}
    )
    key = a.api_key
    keep = [f"k{i}" for i in range(5)]
    drop = [f"d{i}" for i in range(2)]
    with a.client(key) as api_a, b.client(key) as api_b:
        apis = [api_a, api_b]
        for i, name in enumerate(keep + drop):
            r = apis[i % 2].post(
                f"{PROJECT}/clusters",
                json={"name": name, "cluster_type": "slurm", "num_gpus": 16},
            )
            assert r.status_code == 201, r.text
        for i, name in enumerate(drop):
            r = apis[i % 2].delete(f"{PROJECT}/clusters/{name}")
            assert r.status_code == 202, r.text

        # Kill B while it holds leases in the middle of the work (inside a
        # create call, or another step).
        assert b.proc is not None
        b_owner = f"%:{b.proc.pid}:%"

        def b_holds_leases() -> bool:
            held = query(
                database_url,
                "SELECT (SELECT count(*) FROM nodes WHERE lock_token IS NOT NULL "
                f"AND lock_owner LIKE '{b_owner}') + (SELECT count(*) FROM clusters "
                f"WHERE lock_token IS NOT NULL AND lock_owner LIKE '{b_owner}')",
            )
            return bool(held[0][0])

        a.wait_for("replica B to hold leases", b_holds_leases, timeout=20, interval=0.02)
        b.kill9()

        # The survivor finishes: every kept cluster ready, the dropped gone.
        def converged() -> bool:
            listed = {c["name"]: c["status"] for c in api_a.get(f"{PROJECT}/clusters").json()}
            return listed == dict.fromkeys(keep, "ready")

        a.wait_for(
            "the survivor to finish the burst",
            converged,
            timeout=60 + LEASE_TTL_S,
            interval=0.2,
            describe=lambda: api_a.get(f"{PROJECT}/clusters").text,
        )
        live = _all_nodes(api_a)

    assert len(live) == 2 * len(keep), live
    assert all(n["phase"] == "running" for n in live), live
    assert sorted({n["name"].split("-")[0] for n in live}) == keep
    # No host holds two nodes, and no node row was made twice.
    hosts = [n["host"] for n in live]
    assert None not in hosts and len(set(hosts)) == len(hosts), hosts
    assert (
        query(
            database_url,
            "SELECT host_id FROM nodes WHERE deleted_at IS NULL "
            "GROUP BY host_id HAVING count(*) > 1",
        )
        == []
    )
    per_cluster = query(
        database_url,
        "SELECT c.name, count(n.id) FROM clusters c JOIN nodes n ON n.cluster_id = c.id "
        "GROUP BY c.name ORDER BY c.name",
    )
    assert dict(per_cluster) == {name: 2 for name in keep + drop}, per_cluster
    # The provider holds exactly the live nodes, on the same hosts: nothing
    # orphaned by the dead replica, nothing made twice.
    instances = a.instances()
    assert sorted(r["name"] for r in instances.values()) == sorted(n["name"] for n in live)
    assert {r["name"]: r["host"] for r in instances.values()} == {
        n["name"]: n["host"] for n in live
    }
    assert all(r["provisions"] == 1 for r in instances.values()), instances


def _all_nodes(api: httpx.Client) -> list[dict[str, Any]]:
    r = api.get(f"{PROJECT}/nodes", params={"limit": 1000})
    r.raise_for_status()
    assert "X-Next-Cursor" not in r.headers
    return list(r.json())
