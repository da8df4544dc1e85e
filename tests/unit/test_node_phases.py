"""The node reconciler, one handler at a time (``controllers/testing.py``):
every phase's way forward and each of its failure outcomes, the outcome
record on the row (retries, last error, next attempt), phase deadlines, and
releases that always finish."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from gpuclusters.core.enums import HostAgentStatus, HostState
from gpuclusters.layers.base import LayerError, PermanentLayerError
from gpuclusters.providers.base import (
    Instance,
    InstanceState,
    PermanentProviderError,
    ProviderError,
)
from gpuclusters.server.controllers import leases
from gpuclusters.server.controllers.outcomes import StepFailed
from gpuclusters.server.controllers.testing import ControllerHarness
from gpuclusters.server.db.allocation import allocate_nodes
from gpuclusters.server.db.models import Cluster, HealthRun, Host, Node, NodeEvent, utcnow


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[ControllerHarness]:
    async with ControllerHarness.open(tmp_path, retry_backoff_base_s=2.0) as harness:
        yield harness


async def events(h: ControllerHarness, node_id: str) -> dict[str, str]:
    async with h.rt.sessionmaker() as session:
        rows = await session.scalars(select(NodeEvent).where(NodeEvent.node_id == node_id))
        return {e.reason: e.message for e in rows}


async def ready_cluster(h: ControllerHarness) -> Cluster:
    return await h.rows.cluster(status="ready", control_plane_ready_at=utcnow())


# -- the way up ---------------------------------------------------------------


async def test_pending_moves_to_scheduling_with_a_deadline(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h))
    outcome = await h.step(h.nodes, node.id)
    assert outcome.moved == ("pending", "scheduling")
    row = await h.node(node.id)
    assert row.phase == "scheduling" and row.message.startswith("placed on h")
    assert row.phase_deadline_at is not None
    limit = h.rt.settings.node_phase_deadlines_s["scheduling"]
    assert abs((row.phase_deadline_at - row.phase_changed_at).total_seconds() - limit) < 1


async def test_placed_nodes_show_the_pending_deadline_from_settings(tmp_path: Path) -> None:
    # Nodes are made pending by placement (services and the pool filler), not
    # by a step: their deadline is shown from the start, not only once they
    # move, and it is the one the settings give.
    async with ControllerHarness.open(tmp_path, node_phase_deadlines_s={"pending": 120.0}) as h:
        cluster = await ready_cluster(h)
        for _ in range(2):
            await h.rows.host()
        async with h.rt.sessionmaker() as session:
            row = await session.get_one(Cluster, cluster.id)
            placed = await allocate_nodes(
                session,
                cluster=row,
                count=2,
                compute_class="standard",
                deadlines=h.rt.settings.node_phase_deadlines_s,
            )
            await session.commit()
        for node in placed:
            stored = await h.node(node.id)
            assert stored.phase == "pending" and stored.phase_deadline_at is not None
            waited = stored.phase_deadline_at - stored.phase_changed_at
            assert abs(waited.total_seconds() - 120.0) < 1


async def test_a_pass_moves_placed_pending_nodes_in_one_statement(h: ControllerHarness) -> None:
    # pending -> scheduling has no side effect: a pass makes it for every
    # placed node at once, but never for a node someone holds, one awaiting
    # a host, or one being deleted (those take their steps).
    cluster = await ready_cluster(h)
    host = await h.rows.host()
    placed = await h.rows.node(cluster, host)
    other = await h.rows.node(cluster)
    waiter = await h.rows.node(cluster, host_id=None, awaited_host_id=(await h.rows.host()).id)
    soon = utcnow() + timedelta(minutes=1)
    leased = await h.rows.node(
        cluster, lock_owner="elsewhere", lock_token="t", lock_expires_at=soon
    )
    deleting = await h.rows.node(cluster, to_delete=True)
    backing_off = await h.rows.node(cluster, next_attempt_at=soon)
    async with h.rt.sessionmaker() as session:
        await h.nodes.batch_moves(session, {placed.id, waiter.id, leased.id, deleting.id})
    row = await h.node(placed.id)
    assert (row.phase, row.message) == ("scheduling", f"placed on {host.name}")
    limit = h.rt.settings.node_phase_deadlines_s["scheduling"]
    assert row.phase_deadline_at is not None
    assert abs((row.phase_deadline_at - row.phase_changed_at).total_seconds() - limit) < 1
    for untouched in (other, waiter, leased, deleting, backing_off):  # other: not named
        assert (await h.node(untouched.id)).phase == "pending"
    async with h.rt.sessionmaker() as session:
        await h.nodes.batch_moves(session, None)  # a full pass: every placed one
    assert (await h.node(other.id)).phase == "scheduling"
    for untouched in (waiter, leased, deleting, backing_off):
        assert (await h.node(untouched.id)).phase == "pending"


async def test_pending_awaiting_a_held_host_waits_then_takes_it(h: ControllerHarness) -> None:
    cluster = await ready_cluster(h)
    host = await h.rows.host()
    holder = await h.rows.node(cluster, host, phase="running")
    waiter = await h.rows.node(cluster, host_id=None, awaited_host_id=host.id)
    assert (await h.step(h.nodes, waiter.id)).kind == "wait"
    async with h.rt.sessionmaker() as session:
        (await session.get_one(Node, holder.id)).deleted_at = utcnow()
        await session.commit()
    assert (await h.step(h.nodes, waiter.id)).moved == ("pending", "scheduling")
    assert (await h.node(waiter.id)).host_id == host.id


async def test_scheduling_creates_the_instance(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="scheduling")
    assert (await h.step(h.nodes, node.id)).moved == ("scheduling", "booting")
    assert h.provider.calls_to("create") == [node.id]


async def test_scheduling_without_a_host_fails(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), host_id=None, phase="scheduling")
    outcome = await h.step(h.nodes, node.id)
    assert (outcome.kind, outcome.error) == ("fail", "no host assigned")


async def test_scheduling_permanent_provider_error_fails_the_node(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="scheduling")
    h.provider.script("create", PermanentProviderError("GPU type not on this host"))
    assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert (row.phase, row.message) == ("failed", "GPU type not on this host")
    assert "NodeFailed" in await events(h, node.id)


async def test_scheduling_temporary_error_is_recorded_with_backoff(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="scheduling")
    h.provider.script(
        "create", ProviderError("host agent unreachable"), ProviderError("host agent unreachable")
    )
    before = utcnow()
    assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert (row.phase, row.retries, row.last_error) == ("scheduling", 1, "host agent unreachable")
    assert row.next_attempt_at is not None
    assert 1.5 <= (row.next_attempt_at - before).total_seconds() <= 3  # base 2 s
    # Before its next attempt no replica may claim it.
    assert not await h.nodes.work_on(node.id)
    await h.skip_backoff(Node, node.id)
    assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert row.retries == 2
    assert 3.5 <= (row.next_attempt_at - utcnow()).total_seconds() <= 4.1  # doubled
    # A step that works clears the record.
    await h.skip_backoff(Node, node.id)
    assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert row.phase != "scheduling"
    assert (row.retries, row.last_error, row.next_attempt_at) == (0, None, None)


async def test_backoff_is_capped(tmp_path: Path) -> None:
    async with ControllerHarness.open(
        tmp_path, retry_backoff_base_s=1.0, retry_backoff_cap_s=5.0
    ) as h:
        node = await h.rows.node(await ready_cluster(h), phase="scheduling")
        h.provider.always("create", ProviderError("down"))
        for _ in range(6):
            await h.skip_backoff(Node, node.id)
            assert await h.nodes.work_on(node.id)
        row = await h.node(node.id)
        assert row.retries == 6
        assert (row.next_attempt_at - utcnow()).total_seconds() <= 5.0


async def test_booting_waits_then_bootstraps(h: ControllerHarness) -> None:
    h.provider.boot_polls = 1
    node = await h.rows.node(await ready_cluster(h), phase="scheduling")
    await h.step(h.nodes, node.id)  # created, booting
    assert (await h.step(h.nodes, node.id)).kind == "wait"
    assert (await h.step(h.nodes, node.id)).moved == ("booting", "bootstrapping")


async def test_booting_instance_failed_fails_the_node(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="booting")
    h.provider.script("status", Instance(node.id, "h", InstanceState.FAILED, "kernel panic"))
    outcome = await h.step(h.nodes, node.id)
    assert (outcome.kind, outcome.error) == ("fail", "kernel panic")


async def test_booting_instance_vanished_is_made_again(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="booting")
    assert (await h.step(h.nodes, node.id)).moved == ("booting", "scheduling")
    assert (await h.node(node.id)).message == "instance vanished while booting"


async def test_bootstrapping_joins_and_runs(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="bootstrapping")
    h.layer.script("join_node", False)
    assert (await h.step(h.nodes, node.id)).kind == "wait"
    assert (await h.step(h.nodes, node.id)).moved == ("bootstrapping", "running")
    row = await h.node(node.id)
    assert row.ready_at is not None and row.phase_deadline_at is None  # settled
    assert "NodeAdded" in await events(h, node.id)


async def test_the_move_to_running_gives_the_lease_back_in_its_write(
    h: ControllerHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pass's last write (to running) releases the lease in the fence's own
    # statement: the row is free the moment it commits, with a clean retry
    # record, and the engine has nothing left to release. A move that does
    # not end the pass keeps the lease, and the engine gives it back.
    cluster = await ready_cluster(h)
    joining = await h.rows.node(cluster, phase="bootstrapping", retries=2, last_error="earlier")
    async with h.rt.sessionmaker() as session:
        token = await leases.claim(session, Node, joining.id, owner="o", ttl_s=30)
    assert token is not None
    outcome = await h.nodes.step(joining.id, token)
    assert outcome.moved == ("bootstrapping", "running") and outcome.released
    row = await h.node(joining.id)
    assert (row.lock_owner, row.lock_token, row.lock_expires_at) == (None, None, None)
    assert (row.retries, row.last_error, row.next_attempt_at) == (0, None, None)

    booting = await h.rows.node(cluster, phase="scheduling")
    async with h.rt.sessionmaker() as session:
        token = await leases.claim(session, Node, booting.id, owner="o", ttl_s=30)
    outcome = await h.nodes.step(booting.id, token or "")
    assert outcome.moved == ("scheduling", "booting") and not outcome.released
    assert (await h.node(booting.id)).lock_token == token

    released: list[str] = []
    real_release = leases.release

    async def counting_release(session: Any, model: Any, row_id: str, **kw: Any) -> None:
        released.append(row_id)
        await real_release(session, model, row_id, **kw)

    monkeypatch.setattr(leases, "release", counting_release)
    again = await h.rows.node(cluster, phase="bootstrapping")
    assert await h.nodes.work_on(again.id)
    assert (await h.node(again.id)).phase == "running" and released == []
    waiting = await h.rows.node(cluster, phase="booting")
    h.provider.script("status", Instance(waiting.id, "h", InstanceState.BOOTING))
    assert await h.nodes.work_on(waiting.id)
    assert released == [waiting.id]  # still booting: the engine let go
    assert (await h.node(waiting.id)).lock_token is None


async def test_acceptance_results_are_written_with_the_move_to_running(tmp_path: Path) -> None:
    # Quick checks (here skipped: no shell on these nodes) are recorded in
    # the transaction that makes the node running, not one each.
    async with ControllerHarness.open(tmp_path, acceptance_checks=["gpu-burn", "nccl"]) as h:
        node = await h.rows.node(await ready_cluster(h), phase="bootstrapping")
        assert (await h.step(h.nodes, node.id)).moved == ("bootstrapping", "running")
        async with h.rt.sessionmaker() as session:
            runs = list(
                await session.scalars(select(HealthRun).where(HealthRun.node_id == node.id))
            )
        assert sorted((r.check, r.state) for r in runs) == [
            ("gpu-burn", "skipped"),
            ("nccl", "skipped"),
        ]
        assert all(r.finished_at is not None for r in runs)


async def test_bootstrapping_permanent_layer_error_fails(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="bootstrapping")
    h.layer.script("join_node", PermanentLayerError("account barslap exists with uid 1001"))
    assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert row.phase == "failed" and "barslap" in row.message


async def test_a_boot_that_keeps_failing_fails_at_the_deadline(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="scheduling")
    await h.step(h.nodes, node.id)  # -> booting, with its deadline
    h.provider.always("status", ProviderError("agent timed out"))
    assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert (row.phase, row.retries, row.last_error) == ("booting", 1, "agent timed out")
    await h.age(Node, node.id, h.rt.settings.node_phase_deadlines_s["booting"] + 1)
    await h.skip_backoff(Node, node.id)
    assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert row.phase == "failed"
    assert row.message == "still booting after its deadline (900 s); last error: agent timed out"


async def test_running_is_left_alone_unless_verified(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="running")
    assert (await h.step(h.nodes, node.id)).kind == "wait"
    assert h.provider.calls == []
    h.nodes._to_verify.add(node.id)  # a restart's first look
    assert (await h.step(h.nodes, node.id)).moved == ("running", "scheduling")  # lost


# -- the way out ----------------------------------------------------------------


async def test_delete_cordons_drains_and_releases(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="running", to_delete=True)
    assert (await h.step(h.nodes, node.id)).moved == ("running", "draining")
    h.layer.script("drain", False)
    assert (await h.step(h.nodes, node.id)).kind == "wait"  # work left, before the timeout
    assert (await h.step(h.nodes, node.id)).moved == ("draining", "releasing")
    assert (await h.step(h.nodes, node.id)).moved == ("releasing", "deleted")
    assert h.layer.calls_to("remove_node") == [node.name]
    assert h.provider.calls_to("delete") == [node.id]
    assert (await h.node(node.id)).deleted_at is not None


async def test_a_failed_node_goes_straight_to_releasing(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="failed", to_delete=True)
    assert (await h.step(h.nodes, node.id)).moved == ("failed", "releasing")


async def test_release_retries_a_failing_layer_of_a_cluster_that_came_up(
    h: ControllerHarness,
) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="releasing", to_delete=True)
    h.layer.script("remove_node", LayerError("slurmctld not answering"))
    with pytest.raises(StepFailed, match="slurmctld not answering"):
        await h.step(h.nodes, node.id)
    assert (await h.step(h.nodes, node.id)).moved == ("releasing", "deleted")


async def test_release_skips_the_layer_of_a_control_plane_that_never_came_up(
    h: ControllerHarness,
) -> None:
    # Seen on 2026-12-06: the Slurm controller was never configured, and
    # `scontrol delete` failed for ever.
    cluster = await h.rows.cluster(status="deleting")
    node = await h.rows.node(cluster, phase="failed", to_delete=True)
    h.layer.always("remove_node", LayerError("fetch_config: DNS SRV lookup failed"))
    assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert row.deleted_at is not None and row.retries == 0
    assert h.provider.calls_to("delete") == [node.id]
    skipped = (await events(h, node.id))["StepSkipped"]
    assert "control plane never came up" in skipped and "DNS SRV" in skipped


async def test_release_of_a_node_on_a_removed_host_skips_its_instance(
    h: ControllerHarness,
) -> None:
    host = await h.rows.host(agent_status=HostAgentStatus.REMOVED.value, in_fleet=False)
    node = await h.rows.node(await ready_cluster(h), host, phase="releasing", to_delete=True)
    h.provider.always("delete", ProviderError("host agent: connection refused"))
    assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert row.deleted_at is not None
    assert "was removed" in (await events(h, node.id))["StepSkipped"]


async def test_release_that_keeps_failing_finishes_at_its_deadline(h: ControllerHarness) -> None:
    cluster = await ready_cluster(h)
    node = await h.rows.node(cluster, phase="running", to_delete=True)
    await h.step(h.nodes, node.id)
    await h.step(h.nodes, node.id)  # draining -> releasing
    h.provider.always("delete", ProviderError("no route to host"))
    assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert (row.phase, row.retries) == ("releasing", 1)
    await h.age(Node, node.id, h.rt.settings.node_phase_deadlines_s["releasing"] + 1)
    await h.skip_backoff(Node, node.id)
    assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert row.deleted_at is not None
    got = await events(h, node.id)
    assert "passed its deadline" in got["StepSkipped"] and "no route" in got["StepSkipped"]
    # The instance may still be on its host: nothing new lands there.
    async with h.rt.sessionmaker() as session:
        host = await session.get_one(Host, row.host_id)
    assert host.state == HostState.CORDONED.value and "HostCordoned" in got


async def test_forced_delete_skips_failing_steps_at_once(h: ControllerHarness) -> None:
    cluster = await h.rows.cluster(
        status="deleting",
        control_plane_ready_at=utcnow() - timedelta(hours=1),
        force_delete_reason="by admin: controller disk lost",
    )
    node = await h.rows.node(cluster, phase="running", to_delete=True)
    for method in ("cordon", "drain", "remove_node"):
        h.layer.always(method, LayerError(f"{method}: connection refused"))
    for _ in range(3):
        assert await h.nodes.work_on(node.id)
    row = await h.node(node.id)
    assert row.deleted_at is not None
    assert (
        "delete forced: by admin: controller disk lost" in (await events(h, node.id))["StepSkipped"]
    )


async def test_preemption_notifies_then_releases(h: ControllerHarness) -> None:
    node = await h.rows.node(
        await ready_cluster(h),
        phase="running",
        compute_class="preemptible",
        to_delete=True,
        delete_reason="preempted",
    )
    assert (await h.step(h.nodes, node.id)).moved == ("running", "draining")
    assert (await h.node(node.id)).preempt_deadline is not None
    h.layer.script("preemption_done", False)
    assert (await h.step(h.nodes, node.id)).kind == "wait"
    assert h.layer.calls_to("preempt") == [node.name]
    assert (await h.step(h.nodes, node.id)).moved == ("draining", "releasing")
    assert "Preempted" in await events(h, node.id)


async def test_an_instance_up_at_once_skips_booting(h: ControllerHarness) -> None:
    node = await h.rows.node(await ready_cluster(h), phase="scheduling")
    h.provider.script("create", Instance(node.id, "h", InstanceState.RUNNING))
    assert (await h.step(h.nodes, node.id)).moved == ("scheduling", "bootstrapping")
