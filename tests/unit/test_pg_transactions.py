"""PostgreSQL sessions begin their transaction at the first write
(``db/pg_transactions.py``), and a pooled connection the server closed is
replaced at checkout without a ping (``db/engine.py``).

Whether a session is inside a transaction block is read from PostgreSQL
itself: another session sees it ``idle in transaction`` between statements,
not ``idle``. Each claim is also shown to fail on a plain engine (SQLAlchemy's
asyncpg adapter as it comes), so the tests can fail."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from sqlalchemy import exc, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from gpuclusters.server.db.engine import POOL_SIZE, PREPARED_STATEMENT_CACHE, make_engine
from gpuclusters.server.db.pg_transactions import needs_transaction
from support.postgres import PostgresServer

pytestmark = pytest.mark.postgres


@pytest.fixture
def url(postgres_server: PostgresServer) -> Iterator[str]:
    with postgres_server.temporary_database() as u:
        yield u


@pytest.fixture
async def engine(url: str) -> AsyncIterator[AsyncEngine]:
    eng = make_engine(url)
    async with eng.begin() as conn:
        await conn.execute(text("CREATE TABLE t (id int PRIMARY KEY, v text)"))
        await conn.execute(text("INSERT INTO t VALUES (1, 'one')"))
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def plain(url: str, engine: AsyncEngine) -> AsyncIterator[AsyncEngine]:
    """The adapter as it comes (after ``engine`` made the table)."""
    eng = create_async_engine(url)
    try:
        yield eng
    finally:
        await eng.dispose()


async def _in_a_transaction(conn: AsyncConnection) -> bool:
    """Whether ``conn``'s session is in a transaction block between
    statements, as another session sees it (``idle in transaction``)."""
    pid = await conn.scalar(text("SELECT pg_backend_pid()"))
    observer = create_async_engine(conn.engine.url.render_as_string(hide_password=False))
    try:
        async with observer.connect() as o:
            state = await o.scalar(
                text("SELECT state FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
            )
    finally:
        await observer.dispose()
    assert state in ("idle", "idle in transaction"), state
    return bool(state == "idle in transaction")


async def test_reads_run_outside_a_transaction(engine: AsyncEngine, plain: AsyncEngine) -> None:
    async with engine.connect() as conn:
        assert await conn.scalar(text("SELECT v FROM t WHERE id = 1")) == "one"
        assert not await _in_a_transaction(conn)
        # The adapter's own argument reached it (``async_creator`` drops it).
        adapter: Any = (await conn.get_raw_connection()).dbapi_connection
        assert adapter._prepared_statement_cache.capacity == PREPARED_STATEMENT_CACHE
    # The adapter as it comes runs them in one (BEGIN ... ROLLBACK).
    async with plain.connect() as conn:
        assert await _in_a_transaction(conn)


async def test_a_write_begins_the_transaction_and_stays_atomic(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
        await conn.execute(text("INSERT INTO t VALUES (2, 'two')"))
        assert await _in_a_transaction(conn)  # reads after the write are in it
        await conn.execute(text("UPDATE t SET v = 'uno' WHERE id = 1"))
        # Another connection sees none of it before the commit.
        async with engine.connect() as other:
            rows = (await other.execute(text("SELECT id, v FROM t ORDER BY id"))).all()
            assert [tuple(r) for r in rows] == [(1, "one")]
        await conn.rollback()
        rows = (await conn.execute(text("SELECT id, v FROM t ORDER BY id"))).all()
        assert [tuple(r) for r in rows] == [(1, "one")]
        assert not await _in_a_transaction(conn)  # the next one begins lazily too
        await conn.execute(text("INSERT INTO t VALUES (3, 'three')"))
        await conn.commit()
    async with engine.connect() as conn:
        assert await conn.scalar(text("SELECT count(*) FROM t")) == 2


async def test_a_locking_read_begins_the_transaction(engine: AsyncEngine) -> None:
    async with engine.connect() as conn, engine.connect() as other:
        await conn.execute(text("SELECT v FROM t WHERE id = 1 FOR UPDATE"))
        # The row lock is held until this transaction ends.
        with pytest.raises(exc.DBAPIError, match="could not obtain lock"):
            await other.execute(text("SELECT v FROM t WHERE id = 1 FOR UPDATE NOWAIT"))
        await other.rollback()
        await conn.rollback()
        await other.execute(text("SELECT v FROM t WHERE id = 1 FOR UPDATE NOWAIT"))
        await other.rollback()
        # A transaction-scoped advisory lock, likewise.
        await conn.execute(text("SELECT pg_advisory_xact_lock(42)"))
        assert not await other.scalar(text("SELECT pg_try_advisory_xact_lock(42)"))
        await conn.commit()


async def test_savepoints_and_other_isolation_levels(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("INSERT INTO t VALUES (4, 'four')"))
        nested = await conn.begin_nested()
        await conn.execute(text("INSERT INTO t VALUES (5, 'five')"))
        await nested.rollback()
        await conn.commit()
        assert await conn.scalar(text("SELECT count(*) FROM t")) == 2
    # One snapshot for the whole transaction: it begins at once.
    serializable = engine.execution_options(isolation_level="REPEATABLE READ")
    async with serializable.connect() as conn:
        await conn.execute(text("SELECT 1"))
        assert await _in_a_transaction(conn)


@pytest.mark.parametrize(
    ("query", "needs"),
    [
        ("SELECT nodes.id FROM nodes", False),
        ("  select pg_catalog.version()", False),
        ("SHOW transaction isolation level", False),
        ("SELECT id FROM projects WHERE id = $1 FOR UPDATE", True),
        ("SELECT id FROM t FOR NO KEY UPDATE SKIP LOCKED", True),
        ("SELECT pg_advisory_xact_lock($1)", True),
        ("UPDATE nodes SET phase = $1", True),
        ("INSERT INTO t VALUES ($1)", True),
        ("WITH x AS (DELETE FROM t RETURNING id) SELECT id FROM x", True),
        ("SAVEPOINT sa_savepoint_1", True),
    ],
)
def test_what_needs_a_transaction(query: str, needs: bool) -> None:
    assert needs_transaction(query) is needs


async def _closed_by_the_server(eng: AsyncEngine) -> Any:
    """Pool one connection, have the server terminate it, and wait until
    asyncpg has seen the close; returns the driver connection."""
    async with eng.connect() as conn:
        await conn.execute(text("SELECT 1"))
        raw = await conn.get_raw_connection()
        driver = raw.driver_connection
        pid = await conn.scalar(text("SELECT pg_backend_pid()"))
    closed = asyncio.Event()
    driver.add_termination_listener(lambda _conn: closed.set())
    killer = create_async_engine(eng.url.render_as_string(hide_password=False))
    try:
        async with killer.connect() as k:
            assert await k.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    finally:
        await killer.dispose()
    async with asyncio.timeout(10):
        await closed.wait()
    assert driver.is_closed()
    return driver


async def test_a_connection_the_server_closed_is_replaced(
    engine: AsyncEngine, plain: AsyncEngine
) -> None:
    old = await _closed_by_the_server(engine)
    async with engine.connect() as conn:
        assert await conn.scalar(text("SELECT v FROM t WHERE id = 1")) == "one"
        assert (await conn.get_raw_connection()).driver_connection is not old
    # Without the check (and without a pre-ping), the pooled dead connection
    # is handed out and the statement fails.
    await _closed_by_the_server(plain)
    with pytest.raises(exc.DBAPIError):
        async with plain.connect() as conn:
            await conn.execute(text("SELECT 1"))


async def _backends_of_two_waves(eng: AsyncEngine, size: int) -> set[int]:
    """The backends that served two waves of ``size`` sessions, each wave
    holding all its connections at once."""
    pids: set[int] = set()
    for _ in range(2):
        barrier = asyncio.Barrier(size)

        async def one(barrier: asyncio.Barrier = barrier) -> None:
            async with eng.connect() as conn:
                pids.add(await conn.scalar(text("SELECT pg_backend_pid()")))
                await barrier.wait()

        await asyncio.gather(*(one() for _ in range(size)))
    return pids


async def test_connections_stay_pooled(engine: AsyncEngine, url: str) -> None:
    assert len(await _backends_of_two_waves(engine, POOL_SIZE)) == POOL_SIZE
    # With overflow connections (the previous pool: 10 kept, 10 more closed
    # as they come back), the second wave starts 10 backends again.
    overflowing = create_async_engine(url, pool_size=10, max_overflow=10)
    try:
        assert len(await _backends_of_two_waves(overflowing, 20)) == 30
    finally:
        await overflowing.dispose()


async def test_a_server_side_cursor_begins_the_transaction(engine: AsyncEngine) -> None:
    # asyncpg refuses a cursor outside a transaction; a plain SELECT streamed
    # through one must begin it.
    async with engine.connect() as conn:
        result = await conn.stream(text("SELECT v FROM t ORDER BY id"))
        assert [row.v async for row in result] == ["one"]
        assert await _in_a_transaction(conn)
