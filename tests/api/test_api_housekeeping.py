"""Housekeeping: lost nodes degrade their cluster, old events expire,
orphaned provider instances are removed."""

from __future__ import annotations

from sqlalchemy import select

from conftest import ApiHarness
from gpuclusters.providers.base import NodeSpec
from gpuclusters.server.controllers.housekeeping import collect_orphans
from gpuclusters.server.db.models import Node

P = "/v1/projects/default"


async def ready_cluster(api: ApiHarness) -> dict[str, object]:
    r = await api.client.post(
        f"{P}/clusters", json={"name": "demo", "cluster_type": "slurm", "num_gpus": 16}
    )
    assert r.status_code == 201
    return await api.wait_cluster("demo", {"ready"})


async def test_vanished_node_degrades_cluster(api: ApiHarness) -> None:
    await ready_cluster(api)
    rt = api.runtime
    async with rt.sessionmaker() as s:
        victim = (await s.scalars(select(Node).where(Node.deleted_at.is_(None)))).first()
    assert victim is not None
    await rt.provider.delete(victim.id)  # the VM disappears behind our back
    degraded = await api.wait_cluster("demo", {"degraded"})
    phases = {n["name"]: n["phase"] for n in degraded["nodes"]}  # type: ignore[union-attr]
    assert phases[victim.name] == "failed"
    assert "1/2" in str(degraded["status_message"])
    events = (await api.client.get(f"{P}/events", params={"node": victim.name})).json()
    assert "NodeFailed" in {e["reason"] for e in events}


async def test_orphans_are_collected_and_live_nodes_kept(api: ApiHarness) -> None:
    ready = await ready_cluster(api)
    rt = api.runtime
    await rt.provider.create(
        NodeSpec("deadbeef", "ghost", "c", "c", "h100-b-08", "H100_SXM", "standard")
    )
    assert await collect_orphans(rt) == ["deadbeef"]
    left = {i.node_id for i in await rt.provider.list_instances()}
    async with rt.sessionmaker() as s:
        live = set(await s.scalars(select(Node.id).where(Node.deleted_at.is_(None))))
    assert left == live and len(live) == len(ready["nodes"])  # type: ignore[arg-type]
