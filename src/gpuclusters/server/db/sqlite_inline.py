"""SQLite for the async engine without a thread per statement.

SQLAlchemy's async SQLite dialect uses aiosqlite, which runs every call on
a worker thread: the statement goes to the thread through a queue, and its
result comes back through ``call_soon_threadsafe``, which wakes the event
loop through its self-pipe. A statement on a local SQLite file takes
microseconds; the two thread hand-offs around it (and the GIL passed back
and forth) cost more. Measured on this project's 2-core machine with
SQLAlchemy's ORM: a session with two statements and a commit took 1.5-1.8
ms of CPU through aiosqlite and 0.75 ms with the same work done inline.

This module is a connection with aiosqlite's interface (the part SQLAlchemy
calls) whose coroutines do their work at once, on the event loop's thread,
and never suspend; SQLAlchemy's aiosqlite adapter takes it through
``create_async_engine(async_creator=...)``. The trade: a statement runs on
the loop's thread, so a slow one holds the loop. On this project's
database, statements are short (indexed look-ups, pages of rows), and the
one wait SQLite can impose, for the write lock another process holds, is
not spent blocking: the connection's busy timeout is a few milliseconds,
and a statement refused with "database is locked" is tried again after an
``asyncio.sleep`` (backing off to 100 ms) until ``timeout_s`` has passed,
as SQLite's own busy handler would have done, without holding the loop.
Writers of one process never meet that wait: they queue on the write gate
(``db/engine.py``) before their first write.

A coroutine that never suspends never lets the loop run anything else, so
a task with many statements in a row (a pass over every cluster, a page of
thousands of rows loaded one by one) would hold the loop for all of them,
and every API request arriving meanwhile would wait that long. So a
statement first yields to the loop (``asyncio.sleep(0)``) once statements
have run for ``SLICE_S`` since the last yield: the loop is held at most a
slice and a statement at a time, as with a database over the network,
where every statement suspends.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

# How long one try may block the loop inside SQLite's busy handler before
# the statement is retried from the loop (milliseconds).
BUSY_SLICE_MS = 5
# How long statements may run back to back on the loop before one yields.
SLICE_S = 0.002


class _Slice:
    """When statements last let the loop run (one loop, one thread)."""

    started = 0.0


async def _yield_if_due() -> None:
    if time.perf_counter() - _Slice.started >= SLICE_S:
        await asyncio.sleep(0)
        _Slice.started = time.perf_counter()


class InlineCursor:
    """An aiosqlite ``Cursor`` look-alike over a ``sqlite3.Cursor``."""

    def __init__(self, cursor: sqlite3.Cursor, timeout_s: float) -> None:
        self._cursor = cursor
        self._timeout_s = timeout_s

    async def __aenter__(self) -> InlineCursor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _retrying(self, call: Callable[[], object]) -> None:
        """Run ``call``; while SQLite says the database is locked (by
        another process), try again after a sleep on the loop."""
        await _yield_if_due()
        deadline = time.monotonic() + self._timeout_s
        delay = 0.001
        while True:
            try:
                call()
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def execute(self, sql: str, parameters: Any = None) -> InlineCursor:
        if parameters is None:
            await self._retrying(lambda: self._cursor.execute(sql))
        else:
            await self._retrying(lambda: self._cursor.execute(sql, parameters))
        return self

    async def executemany(self, sql: str, parameters: Iterable[Any]) -> InlineCursor:
        rows = list(parameters)  # a retry needs them again
        await self._retrying(lambda: self._cursor.executemany(sql, rows))
        return self

    async def fetchone(self) -> Any:
        return self._cursor.fetchone()

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        return self._cursor.fetchmany(size if size is not None else self._cursor.arraysize)

    async def fetchall(self) -> list[Any]:
        return self._cursor.fetchall()

    async def close(self) -> None:
        self._cursor.close()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._rows()

    async def _rows(self) -> AsyncIterator[Any]:
        for row in self._cursor:
            yield row

    @property
    def description(self) -> Any:
        return self._cursor.description

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def lastrowid(self) -> int | None:
        return self._cursor.lastrowid

    @property
    def arraysize(self) -> int:
        return self._cursor.arraysize

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        self._cursor.arraysize = value


class _RunNow:
    """Stands in for aiosqlite's queue of calls for its thread: SQLAlchemy
    puts ``(future, function)`` on it to set the isolation level."""

    def put_nowait(self, item: tuple[asyncio.Future[Any], Callable[[], Any]]) -> None:
        future, function = item
        try:
            future.set_result(function())
        except Exception as exc:
            future.set_exception(exc)


class InlineConnection:
    """An aiosqlite ``Connection`` look-alike over a ``sqlite3.Connection``."""

    def __init__(self, conn: sqlite3.Connection, timeout_s: float) -> None:
        self._conn = conn
        # aiosqlite's name for the live connection (None once closed).
        self._connection: sqlite3.Connection | None = conn
        self._timeout_s = timeout_s
        self._tx = _RunNow()

    def cursor(self) -> InlineCursor:
        return InlineCursor(self._conn.cursor(), self._timeout_s)

    async def execute(self, sql: str, parameters: Any = None) -> InlineCursor:
        return await self.cursor().execute(sql, parameters)

    async def executemany(self, sql: str, parameters: Iterable[Any]) -> InlineCursor:
        return await self.cursor().executemany(sql, parameters)

    async def commit(self) -> None:
        self._conn.commit()

    async def rollback(self) -> None:
        self._conn.rollback()

    async def close(self) -> None:
        self.stop()

    def stop(self) -> None:
        """Close at once (SQLAlchemy's terminate; also what ``close`` does,
        there being nothing to wait for)."""
        if self._connection is not None:
            self._connection = None
            self._conn.close()

    async def create_function(self, *args: Any, **kw: Any) -> None:
        self._conn.create_function(*args, **kw)

    @property
    def isolation_level(self) -> str | None:
        return self._conn.isolation_level

    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction


def connector(
    args: Sequence[Any], kwargs: Mapping[str, Any], *, timeout_s: float
) -> Callable[[], Any]:
    """An ``async_creator`` for ``create_async_engine``: opens the database
    with the dialect's connect arguments (``args``, ``kwargs``)."""

    async def connect() -> InlineConnection:
        conn = sqlite3.connect(*args, **{**kwargs, "timeout": BUSY_SLICE_MS / 1000})
        return InlineConnection(conn, timeout_s)

    return connect
