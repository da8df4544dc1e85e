"""Leases, event deduplication, the fake provider's idempotency and the
fleet-file loader, on a real (SQLite) database."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gpuclusters.core.enums import ClusterStatus
from gpuclusters.providers.base import HostSpec, InstanceState, NodeSpec, PermanentProviderError
from gpuclusters.providers.fake.provider import FakeNodeProvider, FakeProviderConfig
from gpuclusters.providers.fleet import FleetFileError, load_fleet
from gpuclusters.server.controllers import leases
from gpuclusters.server.db.engine import make_engine, make_sessionmaker
from gpuclusters.server.db.migrate import upgrade_to_head
from gpuclusters.server.db.models import (
    Cluster,
    ClusterPhase,
    ControllerLease,
    Node,
    NodeEvent,
    Organization,
    Project,
    utcnow,
)
from gpuclusters.server.db.records import record_event, set_cluster_status


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}")
    await upgrade_to_head(engine)
    yield make_sessionmaker(engine)
    await engine.dispose()


async def _cluster(db: async_sessionmaker[AsyncSession]) -> tuple[str, str]:
    async with db() as s:
        org = Organization(name="o")
        s.add(org)
        await s.flush()
        proj = Project(organization_id=org.id, name="p", id_block=0)
        s.add(proj)
        await s.flush()
        c = Cluster(
            project_id=proj.id,
            name="c",
            cluster_type="slurm",
            gpu_type="H100_SXM",
            region="r",
            num_gpus=8,
            billing_type="on_demand",
            status="",
        )
        s.add(c)
        await s.flush()
        n = Node(
            cluster_id=c.id,
            project_id=proj.id,
            name="c-standard-x",
            compute_class="standard",
            phase="pending",
        )
        s.add(n)
        await s.commit()
        return c.id, n.id


async def test_lease_claim_is_exclusive_and_fenced(db: async_sessionmaker[AsyncSession]) -> None:
    cid, _ = await _cluster(db)
    async with db() as s:
        tok = await leases.claim(s, Cluster, cid, owner="a", ttl_s=30)
    async with db() as s:
        assert await leases.claim(s, Cluster, cid, owner="b", ttl_s=30) is None
    assert tok is not None
    async with db() as s:
        with pytest.raises(leases.LeaseLost):
            await leases.fence(s, Cluster, cid, token="wrong", ttl_s=30)
        await s.rollback()
    async with db() as s:
        await leases.fence(s, Cluster, cid, token=tok, ttl_s=30)
        await s.commit()
    # An expired lease can be taken over, and the old holder is fenced out.
    async with db() as s:
        await s.execute(update(Cluster).values(lock_expires_at=utcnow() - timedelta(seconds=1)))
        await s.commit()
    async with db() as s:
        tok_b = await leases.claim(s, Cluster, cid, owner="b", ttl_s=30)
    assert tok_b is not None and tok_b != tok
    async with db() as s:
        with pytest.raises(leases.LeaseLost):
            await leases.fence(s, Cluster, cid, token=tok, ttl_s=30)
        await s.rollback()
    async with db() as s:
        await leases.release(s, Cluster, cid, token=tok_b)
        row = await s.get_one(Cluster, cid)
        assert row.lock_token is None


async def test_claim_many_takes_only_free_rows_that_are_due(
    db: async_sessionmaker[AsyncSession],
) -> None:
    cid, nid = await _cluster(db)
    async with db() as s:
        project_id = (await s.get_one(Node, nid)).project_id
        more = [
            Node(cluster_id=cid, project_id=project_id, name=f"c-x-{i}", compute_class="standard",
                 phase="pending")
            for i in range(3)
        ]  # fmt: skip
        s.add_all(more)
        await s.commit()
        held, waiting, free = (n.id for n in more)
    async with db() as s:
        assert await leases.claim(s, Node, held, owner="other", ttl_s=30)
        await s.execute(
            update(Node)
            .where(Node.id == waiting)
            .values(next_attempt_at=utcnow() + timedelta(seconds=60))
        )
        await s.commit()
    async with db() as s:
        claimed = await leases.claim_many(s, Node, [nid, held, waiting, free], owner="a", ttl_s=30)
    assert set(claimed) == {nid, free}
    assert len(set(claimed.values())) == 1
    async with db() as s:
        rows = {n.id: n for n in await s.scalars(select(Node))}
    assert rows[held].lock_owner == "other" and rows[waiting].lock_owner is None
    assert rows[nid].lock_owner == rows[free].lock_owner == "a"
    # Each is fenced and released by its own id with the shared token.
    async with db() as s:
        await leases.release(s, Node, nid, token=claimed[nid])
    async with db() as s:
        assert (await s.get_one(Node, nid)).lock_token is None
        assert (await s.get_one(Node, free)).lock_token == claimed[free]
    async with db() as s:
        assert await leases.claim_many(s, Node, [], owner="a", ttl_s=30) == {}


async def test_leases_of_dead_local_processes_are_freed(
    db: async_sessionmaker[AsyncSession],
) -> None:
    cid, nid = await _cluster(db)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await proc.wait()
    dead_pid = proc.pid  # exited and reaped: no such process any more
    host = socket.gethostname()
    async with db() as s:
        assert await leases.claim(s, Cluster, cid, owner=f"{host}:{dead_pid}:x", ttl_s=300)
        assert await leases.claim(s, Node, nid, owner=f"otherhost:{os.getpid()}:x", ttl_s=300)
    async with db() as s:
        assert await leases.release_dead_owners(s) == 1
    async with db() as s:
        assert (await s.get_one(Cluster, cid)).lock_token is None
        assert (await s.get_one(Node, nid)).lock_token is not None  # another machine's: kept


async def test_named_lease_has_one_holder_until_it_expires_or_is_released(
    db: async_sessionmaker[AsyncSession],
) -> None:
    async with db() as s:
        assert await leases.hold_named(s, "housekeeping", owner="a", ttl_s=30)
    async with db() as s:
        assert not await leases.hold_named(s, "housekeeping", owner="b", ttl_s=30)
    async with db() as s:  # the holder renews
        assert await leases.hold_named(s, "housekeeping", owner="a", ttl_s=30)
    # Expired: the next claimant takes it and the old holder cannot renew.
    async with db() as s:
        await s.execute(update(ControllerLease).values(expires_at=utcnow() - timedelta(seconds=1)))
        await s.commit()
    async with db() as s:
        assert await leases.hold_named(s, "housekeeping", owner="b", ttl_s=30)
    async with db() as s:
        assert not await leases.hold_named(s, "housekeeping", owner="a", ttl_s=30)
    # Releasing by someone else changes nothing; by the holder frees it.
    async with db() as s:
        await leases.release_named(s, "housekeeping", owner="a")
    async with db() as s:
        assert not await leases.hold_named(s, "housekeeping", owner="c", ttl_s=30)
    async with db() as s:
        await leases.release_named(s, "housekeeping", owner="b")
    async with db() as s:
        assert await leases.hold_named(s, "housekeeping", owner="c", ttl_s=30)
        rows = (await s.scalars(select(ControllerLease))).all()
        assert [(r.name, r.owner) for r in rows] == [("housekeeping", "c")]


async def test_named_leases_of_dead_local_processes_are_freed(
    db: async_sessionmaker[AsyncSession],
) -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await proc.wait()
    async with db() as s:
        owner = f"{socket.gethostname()}:{proc.pid}:x"
        assert await leases.hold_named(s, "housekeeping", owner=owner, ttl_s=300)
    async with db() as s:
        assert await leases.release_dead_owners(s) == 1
    async with db() as s:
        assert await leases.hold_named(s, "housekeeping", owner="b", ttl_s=30)


async def test_events_are_deduplicated_by_node_and_reason(
    db: async_sessionmaker[AsyncSession],
) -> None:
    _, nid = await _cluster(db)
    async with db() as s:
        node = await s.get_one(Node, nid)
        await record_event(s, node, "NodeAdded", "first")
        await s.commit()
        await record_event(s, node, "NodeAdded", "second")
        await record_event(s, node, "ScaledUp", "other")
        await s.commit()
        rows = list(await s.scalars(select(NodeEvent).order_by(NodeEvent.reason)))
    assert [(e.reason, e.count, e.message) for e in rows] == [
        ("NodeAdded", 2, "second"),
        ("ScaledUp", 1, "other"),
    ]
    assert rows[0].timestamp >= rows[0].first_timestamp


async def test_phase_history_records_only_changes(db: async_sessionmaker[AsyncSession]) -> None:
    cid, _ = await _cluster(db)
    async with db() as s:
        c = await s.get_one(Cluster, cid)
        assert await set_cluster_status(s, c, ClusterStatus.QUEUED.value)
        assert not await set_cluster_status(s, c, ClusterStatus.QUEUED.value)
        assert await set_cluster_status(s, c, ClusterStatus.WAITING_FOR_NODES.value, "0/1")
        assert await set_cluster_status(s, c, ClusterStatus.WAITING_FOR_NODES.value, "1/1")
        await s.commit()
        phases = list(await s.scalars(select(ClusterPhase).order_by(ClusterPhase.seq)))
    assert [(p.seq, p.phase) for p in phases] == [(1, "queued"), (2, "waiting_for_nodes")]


def _provider(tmp_path: Path, **kw: object) -> FakeNodeProvider:
    fleet = [HostSpec("h1", "H100_SXM", "r", "a"), HostSpec("h2", "H100_SXM", "r", "a")]
    return FakeNodeProvider(
        FakeProviderConfig(fleet=fleet, state_file=tmp_path / "fake.sqlite", **kw)
    )  # type: ignore[arg-type]


def _spec(node_id: str, host: str) -> NodeSpec:
    return NodeSpec(node_id, f"n-{node_id}", "c", "c", host, "H100_SXM", "standard")


async def test_fake_provider_is_idempotent_and_persistent(tmp_path: Path) -> None:
    p = _provider(tmp_path, boot_delay_s=0)
    a = await p.create(_spec("n1", "h1"))
    again = await p.create(_spec("n1", "h1"))
    assert a.state is again.state is InstanceState.RUNNING
    assert [i.node_id for i in await p.list_instances()] == ["n1"]
    with pytest.raises(PermanentProviderError):
        await p.create(_spec("n2", "h1"))  # one node per host
    with pytest.raises(PermanentProviderError):
        await p.create(_spec("n3", "nowhere"))
    # A new provider object (a restarted server) sees the same instances.
    p2 = _provider(tmp_path, boot_delay_s=0)
    assert (await p2.status("n1")).state is InstanceState.RUNNING
    await p2.delete("n1")
    await p2.delete("n1")  # missing is not an error
    assert (await p2.status("n1")).state is InstanceState.MISSING
    assert await p2.list_instances() == []


async def test_fake_provider_boot_delay_and_failures(tmp_path: Path) -> None:
    p = _provider(tmp_path, boot_delay_s=3600, fail_hosts=frozenset({"h2"}))
    assert (await p.create(_spec("n1", "h1"))).state is InstanceState.BOOTING
    assert (await p.create(_spec("n2", "h2"))).state is InstanceState.FAILED
    assert (await p.reboot("n1")).state is InstanceState.BOOTING


def test_fleet_loader_validates(tmp_path: Path) -> None:
    f = tmp_path / "fleet.yaml"
    f.write_text("hosts:\n  - {name: a, gpu_type: H100_SXM, region: r, ib_island: i}\n")
    assert load_fleet(f) == [HostSpec("a", "H100_SXM", "r", "i")]
    for text, words in [
        ("hosts: 3\n", "'hosts' list"),
        ("hosts:\n  - {name: a, gpu_type: H100_SXM, region: r}\n", "missing field ib_island"),
        ("hosts:\n  - {name: a, gpu_type: K80, region: r, ib_island: i}\n", "unknown GPU type"),
        (
            "hosts:\n  - {name: a, gpu_type: H100_SXM, region: r, ib_island: i}\n"
            "  - {name: a, gpu_type: H100_SXM, region: r, ib_island: i}\n",
            "duplicate host name",
        ),
    ]:
        f.write_text(text)
        with pytest.raises(FleetFileError, match=words):
            load_fleet(f)
