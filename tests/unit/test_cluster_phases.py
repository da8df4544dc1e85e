"""The cluster reconciler, one handler at a time (``controllers/testing.py``):
every status's way forward and its failure outcomes, deadlines, and
deletes that always finish."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import select

from gpuclusters.layers.base import LayerError, PermanentLayerError
from gpuclusters.server.controllers.outcomes import StepFailed
from gpuclusters.server.controllers.testing import ControllerHarness
from gpuclusters.server.db.models import Cluster, ClusterPhase, Node, utcnow


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[ControllerHarness]:
    async with ControllerHarness.open(tmp_path) as harness:
        yield harness


async def history(h: ControllerHarness, cluster_id: str) -> list[tuple[str, str]]:
    async with h.rt.sessionmaker() as session:
        rows = await session.scalars(
            select(ClusterPhase)
            .where(ClusterPhase.cluster_id == cluster_id)
            .order_by(ClusterPhase.seq)
        )
        return [(p.phase, p.message) for p in rows]


async def test_queued_places_its_nodes_on_free_hosts(h: ControllerHarness) -> None:
    await h.rows.host("h1")
    cluster = await h.rows.cluster(status="queued", nodes_placed=False)
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"
    row = await h.cluster(cluster.id)
    assert row.status == "waiting_for_control_plane" and row.nodes_placed
    assert row.phase_deadline_at is not None
    async with h.rt.sessionmaker() as session:
        hosts = list(await session.scalars(select(Node.host_id).where(Node.cluster_id == row.id)))
    assert len(hosts) == 1 and hosts[0] is not None


async def test_queued_without_capacity_waits_and_says_why(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(status="queued", nodes_placed=False)
    assert (await h.step(h.clusters, cluster.id)).kind == "wait"
    row = await h.cluster(cluster.id)
    assert row.status == "queued" and "waiting for capacity" in row.status_message
    assert row.phase_deadline_at is None  # a queued cluster waits as long as asked


async def test_waiting_for_build_and_back(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(status="waiting_for_control_plane")
    h.layer.builds_message = "waiting for coredns to be built"
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"
    assert (await h.cluster(cluster.id)).status == "waiting_for_build"
    assert (await h.step(h.clusters, cluster.id)).kind == "wait"
    assert h.layer.calls_to("ensure_control_plane") == []  # nothing starts meanwhile
    h.layer.builds_message = None
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"
    assert (await h.cluster(cluster.id)).status == "waiting_for_control_plane"


async def test_control_plane_up_records_when(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(status="waiting_for_control_plane")
    h.layer.script("ensure_control_plane", False)
    assert (await h.step(h.clusters, cluster.id)).kind == "wait"
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"
    row = await h.cluster(cluster.id)
    assert row.status == "waiting_for_volume" and row.control_plane_ready_at is not None


async def test_control_plane_temporary_error_is_recorded(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(status="waiting_for_control_plane")
    h.layer.script("ensure_control_plane", LayerError("slurmctld did not start"))
    assert await h.clusters.work_on(cluster.id)
    row = await h.cluster(cluster.id)
    assert (row.status, row.retries, row.last_error) == (
        "waiting_for_control_plane",
        1,
        "slurmctld did not start",
    )
    assert row.next_attempt_at is not None


async def test_control_plane_permanent_error_fails_the_cluster(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(status="waiting_for_control_plane")
    h.layer.script("ensure_control_plane", PermanentLayerError("account barslap exists"))
    assert await h.clusters.work_on(cluster.id)
    row = await h.cluster(cluster.id)
    assert (row.status, row.status_message) == ("failed", "account barslap exists")


async def test_control_plane_past_its_deadline_fails_with_the_last_error(
    h: ControllerHarness,
) -> None:
    cluster = await h.rows.cluster(status="queued", nodes_placed=True)
    await h.step(h.clusters, cluster.id)  # -> waiting_for_control_plane, with a deadline
    h.layer.always("ensure_control_plane", LayerError("kube-apiserver: connection refused"))
    assert await h.clusters.work_on(cluster.id)
    await h.age(Cluster, cluster.id, 901)
    await h.skip_backoff(Cluster, cluster.id)
    assert await h.clusters.work_on(cluster.id)
    row = await h.cluster(cluster.id)
    assert row.status == "failed"
    assert row.status_message == (
        "still waiting_for_control_plane after its deadline (900 s); "
        "last error: kube-apiserver: connection refused"
    )


async def test_waiting_for_volume_without_one_waits_for_nodes(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(status="waiting_for_volume")
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"
    assert (await h.cluster(cluster.id)).status == "waiting_for_nodes"


async def test_waiting_for_nodes_counts_running_nodes(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(status="waiting_for_nodes", num_gpus=16)
    a = await h.rows.node(cluster, phase="running")
    b = await h.rows.node(cluster, phase="booting")
    await h.step(h.clusters, cluster.id)
    assert (await h.cluster(cluster.id)).status_message == "1/2 nodes running"
    async with h.rt.sessionmaker() as session:
        (await session.get_one(Node, b.id)).phase = "running"
        await session.commit()
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"
    assert (await h.cluster(cluster.id)).status == "running_acceptance_tests"
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"
    assert (await h.cluster(cluster.id)).status == "ready"
    del a


async def test_a_failed_node_fails_a_new_cluster(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(status="waiting_for_nodes")
    await h.rows.node(cluster, phase="failed", message="kernel panic")
    await h.step(h.clusters, cluster.id)
    row = await h.cluster(cluster.id)
    assert row.status == "failed" and "kernel panic" in row.status_message


async def test_ready_degrades_when_a_node_fails_and_applies_config(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(status="ready", config_generation=2, applied_config_generation=1)
    node = await h.rows.node(cluster, phase="running")
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"  # config applied
    assert (await h.cluster(cluster.id)).applied_config_generation == 2
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"  # "1/1 nodes running"
    async with h.rt.sessionmaker() as session:
        (await session.get_one(Node, node.id)).phase = "failed"
        await session.commit()
    await h.step(h.clusters, cluster.id)
    assert (await h.cluster(cluster.id)).status == "degraded"


async def test_deleting_waits_for_nodes_then_deletes(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(status="deleting", control_plane_ready_at=utcnow())
    node = await h.rows.node(cluster, phase="releasing", to_delete=True)
    assert (await h.step(h.clusters, cluster.id)).kind == "wait"
    async with h.rt.sessionmaker() as session:
        (await session.get_one(Node, node.id)).deleted_at = utcnow()
        await session.commit()
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"
    row = await h.cluster(cluster.id)
    assert row.deleted_at is not None and row.status == "deleted"
    assert h.layer.calls_to("delete") == [cluster.name]


async def test_deleting_retries_a_failing_layer_then_skips_it_at_the_deadline(
    h: ControllerHarness,
) -> None:
    cluster = await h.rows.cluster(status="ready", control_plane_ready_at=utcnow())
    async with h.rt.sessionmaker() as session:
        from gpuclusters.server.db.records import set_cluster_status

        row = await session.get_one(Cluster, cluster.id)
        await set_cluster_status(session, row, "deleting", "delete requested")
        await session.commit()
    h.layer.always("delete", LayerError("service node: no such namespace"))
    with pytest.raises(StepFailed):
        await h.step(h.clusters, cluster.id)
    assert (await h.cluster(cluster.id)).deleted_at is None
    await h.age(Cluster, cluster.id, 1801)
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"
    row = await h.cluster(cluster.id)
    assert row.deleted_at is not None
    assert "stopping the control plane skipped (deleting passed its deadline)" in (
        row.status_message
    )
    assert (await history(h, cluster.id))[-1][0] == "deleted"


async def test_forced_delete_skips_a_failing_layer_at_once(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(
        status="deleting", force_delete_reason="by admin: the controller's disk is gone"
    )
    h.layer.always("delete", LayerError("no route"))
    assert (await h.step(h.clusters, cluster.id)).kind == "moved"
    row = await h.cluster(cluster.id)
    assert row.deleted_at is not None
    assert "delete forced: by admin: the controller's disk is gone" in row.status_message


async def test_a_step_whose_lease_is_taken_is_cancelled_and_writes_nothing(
    tmp_path: Path,
) -> None:
    from sqlalchemy import update

    async with ControllerHarness.open(tmp_path, lease_ttl_s=0.6) as h:
        cluster = await h.rows.cluster(status="waiting_for_control_plane")
        cancelled = asyncio.Event()

        async def blocks() -> bool:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return True

        h.layer.script("ensure_control_plane", blocks)
        work = asyncio.create_task(h.clusters.work_on(cluster.id))
        for _ in range(100):
            if h.layer.calls_to("ensure_control_plane"):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # a heartbeat renewed it: still ours
        assert (await h.cluster(cluster.id)).lock_owner == "harness"
        assert not cancelled.is_set()
        async with h.rt.sessionmaker() as session:  # another replica takes it
            await session.execute(
                update(Cluster)
                .where(Cluster.id == cluster.id)
                .values(lock_owner="other", lock_token="theirs")
            )
            await session.commit()
        assert await asyncio.wait_for(work, 5) is True
        assert cancelled.is_set()  # the next heartbeat found it gone
        row = await h.cluster(cluster.id)
        assert (row.lock_owner, row.lock_token) == ("other", "theirs")  # not released by us
        assert row.status == "waiting_for_control_plane" and row.retries == 0


async def test_full_passes_leave_clusters_waiting_for_nodes_to_their_hints(
    h: ControllerHarness,
) -> None:
    """A cluster that only waits for its nodes is stepped when a node hints
    it, at a full pass asked for by a hint, and at the periodic sweep, not
    at every full pass due by the poll interval."""
    waiting = await h.rows.cluster(status="waiting_for_nodes")
    await h.rows.node(waiting, phase="bootstrapping")
    deleting = await h.rows.cluster(status="deleting")
    await h.rows.node(deleting, phase="draining", to_delete=True)
    emptied = await h.rows.cluster(status="deleting")  # no node left: its own work
    control = await h.rows.cluster(status="waiting_for_control_plane")
    everything = {waiting.id, deleting.id, emptied.id, control.id}
    own_work = {emptied.id, control.id}
    c = h.clusters

    async def candidates(*, asked: bool = False) -> set[str]:
        c.full_pass_asked = asked
        async with h.rt.sessionmaker() as session:
            return set(await c.candidates(session))

    assert await candidates() == everything  # a process's first pass sweeps
    assert await candidates() == own_work
    assert await candidates(asked=True) == everything
    assert await candidates() == own_work
    c._last_sweep -= c.sweep_s  # the sweep is due
    assert await candidates() == everything
    # A node's hint names its cluster: a targeted pass takes it.
    async with h.rt.sessionmaker() as session:
        assert set(await c.candidates_among(session, {waiting.id})) == {waiting.id}
    # Configuration to apply is a ready cluster's own work.
    async with h.rt.sessionmaker() as session:
        row = await session.get_one(Cluster, waiting.id)
        row.status, row.config_generation, row.applied_config_generation = "ready", 2, 1
        await session.commit()
    assert await candidates() == {*own_work, waiting.id}
