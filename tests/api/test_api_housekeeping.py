"""Housekeeping: lost nodes degrade their cluster, old events expire,
orphaned provider instances are removed."""

from __future__ import annotations

import asyncio

from sqlalchemy import select

from gpuclusters.providers.base import NodeSpec
from gpuclusters.server.controllers.housekeeping import check_running_nodes, collect_orphans
from gpuclusters.server.db.models import Node
from support.api import ApiHarness

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
    events = (
        await api.client.get(f"{P}/events", params={"limit": 1000, "node": victim.name})
    ).json()
    assert "NodeFailed" in {e["reason"] for e in events}


async def test_unverified_lost_node_is_left_to_the_rebuild(api: ApiHarness) -> None:
    """Right after a restart no running node is verified yet: a missing
    instance then means "lost while we were down", which the node reconciler
    rebuilds; housekeeping must not race it and fail the node."""
    await ready_cluster(api)
    rt = api.runtime
    async with rt.sessionmaker() as s:
        victim = (await s.scalars(select(Node).where(Node.deleted_at.is_(None)))).first()
    assert victim is not None
    await rt.provider.delete(victim.id)
    rt.nodes_to_verify.add(victim.id)  # as if this process had just started
    assert await check_running_nodes(rt) == 0
    async with rt.sessionmaker() as s:
        assert (await s.get_one(Node, victim.id)).phase != "failed"
    # ...and the node reconciler, which has not verified it either, rebuilds it.
    for _ in range(400):
        async with rt.sessionmaker() as s:
            row = await s.get_one(Node, victim.id)
        state = (await rt.provider.status(victim.id)).state
        if row.phase == "running" and row.ready_at != victim.ready_at and state.value == "running":
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"node not rebuilt: phase {row.phase}, instance {state}")
    assert row.phase == "running"


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
