"""SQLite statements on the event loop's thread (``db/sqlite_inline.py``).

The claim: statements run without a thread hop, yet a write lock held by
another process is waited for off the loop (the loop keeps serving), up to
the timeout, after which the statement fails as SQLite's busy handler would
have made it fail. The counter-test shows the same wait inside SQLite's
busy handler (a long busy slice) does freeze the loop, so the first test
can fail."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from gpuclusters.server.db import sqlite_inline
from gpuclusters.server.db.engine import make_engine


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "inline.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    yield path


def hold_write_lock(path: Path, seconds: float) -> threading.Thread:
    """Another connection (as another process would) holds the write lock
    for ``seconds``; returns once it holds it."""
    held = threading.Event()

    def run() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        held.set()
        threading.Event().wait(seconds)
        conn.execute("ROLLBACK")
        conn.close()

    thread = threading.Thread(target=run)
    thread.start()
    held.wait()
    return thread


async def ticks_during(work: asyncio.Future[object] | asyncio.Task[object]) -> int:
    """How many 10 ms ticks the loop ran while ``work`` was pending."""
    ticks = 0
    while not work.done():
        await asyncio.sleep(0.01)
        ticks += 1
    await work
    return ticks


async def write(engine: AsyncEngine, value: str) -> object:
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO t (v) VALUES (:v)"), {"v": value})
    return value


async def test_a_lock_held_elsewhere_is_waited_for_off_the_loop(db: Path) -> None:
    engine = make_engine(f"sqlite+aiosqlite:///{db}")
    try:
        other = hold_write_lock(db, 0.5)
        ticks = await ticks_during(asyncio.ensure_future(write(engine, "after the lock")))
        other.join()
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT v FROM t"))).scalars().all() == [
                "after the lock"
            ]
        # 0.5 s of waiting at 10 ms a tick: the loop ran throughout.
        assert ticks >= 20, ticks
    finally:
        await engine.dispose()


async def test_a_wait_in_the_busy_handler_would_freeze_the_loop(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same wait spent inside SQLite's busy handler (as with a long busy
    # timeout) holds the loop: hardly a tick runs.
    monkeypatch.setattr(sqlite_inline, "BUSY_SLICE_MS", 2000)
    engine = make_engine(f"sqlite+aiosqlite:///{db}")
    try:
        other = hold_write_lock(db, 0.5)
        ticks = await ticks_during(asyncio.ensure_future(write(engine, "late")))
        other.join()
        assert ticks <= 5, ticks
    finally:
        await engine.dispose()


async def test_a_lock_held_past_the_timeout_fails_the_statement(db: Path) -> None:
    connect = sqlite_inline.connector([str(db)], {}, timeout_s=0.2)
    conn = await connect()
    try:
        other = hold_write_lock(db, 1.0)
        cursor = conn.cursor()
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            await cursor.execute("INSERT INTO t (v) VALUES ('x')")
        other.join()
        await conn.rollback()
        await cursor.execute("INSERT INTO t (v) VALUES ('y')")  # free again: it goes
        await conn.commit()
        rows = await (await conn.execute("SELECT v FROM t")).fetchall()
        assert rows == [("y",)]
    finally:
        await conn.close()


@pytest.mark.parametrize(("slice_s", "yields"), [(0.0, True), (float("inf"), False)])
async def test_a_run_of_statements_lets_the_loop_run(
    db: Path, monkeypatch: pytest.MonkeyPatch, slice_s: float, yields: bool
) -> None:
    """Statements back to back yield to the loop once a slice has run out
    (``SLICE_S``; 0 here: at every statement), so another task runs between
    them. The counter-case, a slice that never runs out, is what a
    coroutine that never suspends does: the other task never runs."""
    monkeypatch.setattr(sqlite_inline, "SLICE_S", slice_s)
    engine = make_engine(f"sqlite+aiosqlite:///{db}")
    turns = 0

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))  # connected
            task = asyncio.create_task(other())
            await asyncio.sleep(0)  # it has started
            before = turns
            for _ in range(200):
                await conn.execute(text("SELECT v FROM t"))
            during = turns - before
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        await engine.dispose()
    if yields:
        assert during >= 200
    else:
        assert during == 0
