"""PostgreSQL's planner statistics follow the fleet (``db/statistics.py``).

The attack on the claim: a table analyzed while empty, then filled by a
burst, as a fresh fleet is. Without a refresh the planner keeps believing
the table is empty and plans placement's free-host count as a nested loop
that reads every node for every host (9 s a query at 10,000 hosts); after
``analyze_stale`` the same query is a hash join. Asserted on the plan, which
is deterministic given the statistics, not on a time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from gpuclusters.server.db.allocation import host_is_free
from gpuclusters.server.db.migrate import upgrade_to_head
from gpuclusters.server.db.models import Host
from gpuclusters.server.db.statistics import analyze_stale
from support.postgres import PostgresServer

HOSTS = 2000


@pytest.fixture
async def engine(postgres_server: PostgresServer) -> AsyncIterator[AsyncEngine]:
    with postgres_server.temporary_database() as url:
        eng = create_async_engine(url)
        try:
            await upgrade_to_head(eng)
            yield eng
        finally:
            await eng.dispose()


async def _fill(engine: AsyncEngine) -> None:
    """HOSTS hosts, all but a tenth holding a live node (foreign keys off:
    only the two tables' sizes matter here)."""
    async with engine.begin() as conn:
        await conn.execute(text("SET LOCAL session_replication_role = replica"))
        await conn.execute(
            text(
                "INSERT INTO hosts (id, name, region, gpu_type, num_gpus, nvme_gib, ib_island,"
                " state, in_fleet, created_at) SELECT 'h' || i, 'host' || i, 'r', 'H100_SXM', 8,"
                " 100, 'island' || (i % 4), 'available', true, now()"
                " FROM generate_series(1, :n) i"
            ),
            {"n": HOSTS},
        )
        await conn.execute(
            text(
                "INSERT INTO nodes (id, cluster_id, project_id, name, host_id, compute_class,"
                " phase, message, cordoned, to_delete, created_at, phase_changed_at,"
                " preempt_signalled, auto_repair, retries) SELECT 'n' || i, 'c', 'p',"
                " 'node' || i, 'h' || i, 'standard', 'running', '', false, false, now(), now(),"
                " false, false, 0 FROM generate_series(1, :n) i"
            ),
            {"n": HOSTS * 9 // 10},
        )


async def _plan(engine: AsyncEngine) -> str:
    query = (
        select(Host.ib_island, func.count())
        .where(Host.gpu_type == "H100_SXM", Host.region == "r", host_is_free())
        .group_by(Host.ib_island)
    )
    sql = str(query.compile(engine.sync_engine, compile_kwargs={"literal_binds": True}))
    async with engine.connect() as conn:
        return "\n".join(row[0] for row in await conn.execute(text("EXPLAIN " + sql)))


@pytest.mark.postgres
async def test_stale_statistics_are_refreshed_and_placement_is_planned_as_a_hash_join(
    engine: AsyncEngine,
) -> None:
    async with engine.connect() as conn:  # as autovacuum would, while the tables were empty
        await conn.execute(text("ANALYZE hosts"))
        await conn.execute(text("ANALYZE nodes"))
        await conn.commit()
    await _fill(engine)
    before = await _plan(engine)
    assert "Nested Loop Anti Join" in before, before  # the bad plan, without the refresh

    # A backend's counters reach the shared statistics when flushed (PG 15+:
    # at most a second after its transaction, or when asked to).
    for _ in range(50):
        analyzed = await analyze_stale(engine)
        if {"hosts", "nodes"} <= set(analyzed):
            break
        async with engine.connect() as conn:
            await conn.execute(text("SELECT pg_stat_force_next_flush()"))
        await asyncio.sleep(0.1)
    assert {"hosts", "nodes"} <= set(analyzed)
    after = await _plan(engine)
    assert "Hash Anti Join" in after and "Nested Loop" not in after, after
    # Nothing changed since: nothing is analyzed again.
    assert not {"hosts", "nodes"} & set(await analyze_stale(engine))


async def test_nothing_is_done_on_sqlite(tmp_path: Path) -> None:
    eng = create_async_engine(f"sqlite+aiosqlite:///{tmp_path}/db.sqlite")
    try:
        assert await analyze_stale(eng) == []
    finally:
        await eng.dispose()
