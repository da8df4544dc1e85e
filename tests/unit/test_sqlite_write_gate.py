"""The SQLite write gate (``db/engine.py``): a process's writers queue on one
asyncio lock, taken at a transaction's first write and given back however
the transaction ends. A gate left held would stop every writer, so each way
out is checked, and so is the order: a second writer waits for the first's
commit, while readers never wait."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from gpuclusters.server.db import engine as engine_module
from gpuclusters.server.db.engine import make_engine


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    eng = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'gate.sqlite'}")
    async with eng.begin() as conn:
        await conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)"))
    yield eng
    await eng.dispose()


def gate_held(eng: AsyncEngine) -> bool:
    gate = engine_module._GATES[str(eng.url)]
    return bool(gate._holders)


async def test_a_write_holds_the_gate_until_commit(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        await conn.execute(text("SELECT count(*) FROM t"))
        assert not gate_held(engine)  # reads take nothing
        await conn.execute(text("INSERT INTO t (v) VALUES ('a')"))
        assert gate_held(engine)
        await conn.execute(text("UPDATE t SET v = 'b'"))  # the same transaction
        await conn.commit()
        assert not gate_held(engine)


async def test_every_way_out_gives_the_gate_back(engine: AsyncEngine) -> None:
    # Rolled back.
    async with engine.connect() as conn:
        await conn.execute(text("INSERT INTO t (id, v) VALUES (1, 'a')"))
        await conn.rollback()
    assert not gate_held(engine)
    # A failed statement, then the rollback the error leads to.
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO t (id, v) VALUES (1, 'a')"))
    with pytest.raises(IntegrityError):
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO t (id, v) VALUES (1, 'again')"))
    assert not gate_held(engine)
    # Given back to the pool without a commit (reset on return).
    async with engine.connect() as conn:
        await conn.execute(text("UPDATE t SET v = 'c'"))
    assert not gate_held(engine)
    # The connection itself closed.
    async with engine.connect() as conn:
        await conn.execute(text("UPDATE t SET v = 'd'"))
        await conn.invalidate()
    assert not gate_held(engine)
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT v FROM t"))).scalar_one() == "a"


async def test_a_second_writer_waits_for_the_first_commit_and_readers_do_not(
    engine: AsyncEngine,
) -> None:
    order: list[str] = []
    async with engine.connect() as first:
        await first.execute(text("INSERT INTO t (id, v) VALUES (1, 'first')"))

        async def second() -> None:
            async with engine.begin() as conn:
                await conn.execute(text("UPDATE t SET v = 'second' WHERE id = 1"))
                order.append("second wrote")

        waiting = asyncio.create_task(second())
        # A reader goes on meanwhile (it sees the last committed state).
        async with engine.connect() as reader:
            assert (await reader.execute(text("SELECT count(*) FROM t"))).scalar_one() == 0
        await asyncio.sleep(0.2)
        assert not waiting.done()
        order.append("first commits")
        await first.commit()
        await waiting
    assert order == ["first commits", "second wrote"]
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT v FROM t"))).scalar_one() == "second"


async def test_waiting_longer_than_the_busy_timeout_is_an_error(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "SQLITE_BUSY_TIMEOUT_S", 0.3)
    async with engine.connect() as first:
        await first.execute(text("INSERT INTO t (v) VALUES ('held')"))
        with pytest.raises(OperationalError, match="waited for another writer"):
            async with engine.begin() as conn:
                await conn.execute(text("INSERT INTO t (v) VALUES ('late')"))
        await first.commit()
    assert not gate_held(engine)


async def test_a_writer_cancelled_as_the_gate_is_granted_stays_cancelled() -> None:
    # The race that hung a server's shutdown: the gate is given to a waiting
    # writer in the same loop iteration as that writer's task is cancelled.
    # The cancellation must win (the task ends, the gate is not left held);
    # with asyncio.wait_for on Python 3.11 the grant won and the cancelled
    # task ran on.
    gate = engine_module.WriteGate()
    first, second = object(), object()
    await gate.enter(first, "INSERT INTO t VALUES (1)")
    waiter = asyncio.create_task(gate.enter(second, "INSERT INTO t VALUES (2)"))
    await asyncio.sleep(0)  # the second writer now waits for the gate
    gate.leave(first)  # grants it...
    waiter.cancel()  # ...as the task is cancelled
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not gate._holders  # nobody holds it
    await asyncio.wait_for(gate.enter(first, "UPDATE t SET v = 1"), 1)  # and it is free
    gate.leave(first)
