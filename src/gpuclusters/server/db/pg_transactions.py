"""PostgreSQL transactions that begin at their first write.

SQLAlchemy's asyncpg adapter sends ``BEGIN`` before a session's first
statement and ``ROLLBACK`` or ``COMMIT`` at its end, each a round trip of its
own. Most of this server's sessions only read (a reconciler's candidates, a
step's load, every API ``GET``), so most of those round trips did nothing:
in the statement log of a 1,000-node bench, ``BEGIN`` and ``ROLLBACK`` were
two thirds of the simple statements, and each round trip costs the server
about as much CPU as the statement it wraps (asyncpg's protocol, the event
loop's wake-ups, SQLAlchemy's bookkeeping).

So the connection handed to SQLAlchemy (``connector``, an
``async_creator``) is asyncpg's, with ``transaction()`` made lazy:
``start()`` only notes that a transaction is wanted, and ``BEGIN`` is sent
just before the first statement that needs one: anything but a plain
``SELECT`` (``INSERT``, ``UPDATE``, ``DELETE``, DDL, ``SAVEPOINT``, ``WITH``)
and a ``SELECT`` that locks (``FOR UPDATE``/``FOR SHARE``, advisory
transaction locks). From there on every statement of the session runs in
it, as before. A session that never needed one ends without a round trip.

Why this changes nothing a session can see: PostgreSQL's default isolation,
READ COMMITTED, gives every statement its own snapshot, inside a
transaction or not, so a read before the first write sees what it would
have seen inside the transaction; what it cannot do outside one is hold a
lock, and the statements that lock begin it. Sessions asking for another
isolation level (REPEATABLE READ, SERIALIZABLE: one snapshot for the whole
transaction), read-only or deferrable transactions begin at once, as
asyncpg would.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import asyncpg
from asyncpg.transaction import Transaction

# A statement that may run outside a transaction: a SELECT that takes no lock
# (SHOW too: the adapter's own set-up). Anything else begins the transaction.
_READ = re.compile(r"\s*(SELECT|SHOW)\b", re.IGNORECASE)
_LOCKS = re.compile(
    r"\bFOR\s+(UPDATE|SHARE|NO\s+KEY\s+UPDATE|KEY\s+SHARE)\b|_xact_lock", re.IGNORECASE
)


def needs_transaction(query: str) -> bool:
    return _READ.match(query) is None or _LOCKS.search(query) is not None


class LazyTransaction:
    """What ``LazyBeginConnection.transaction()`` returns: asyncpg's
    ``Transaction`` interface (``start``, ``commit``, ``rollback``), its
    ``BEGIN`` held back until a statement needs it."""

    def __init__(self, conn: LazyBeginConnection, options: dict[str, Any]) -> None:
        self._conn = conn
        self._options = options
        self._real: Transaction | None = None

    @property
    def begun(self) -> bool:
        return self._real is not None

    async def start(self) -> None:
        pending = self._conn._lazy
        if pending is not None and pending.begun:
            raise asyncpg.InterfaceError("a transaction is already in progress on this connection")
        # A pending one that never began was dropped by its owner (its
        # connection broke): nothing to end.
        self._conn._lazy = self
        isolation = self._options.get("isolation")
        if (
            isolation not in (None, "read_committed")
            or self._options.get("readonly")
            or self._options.get("deferrable")
        ):
            await self.begin()

    async def begin(self) -> None:
        if self._real is None:
            real = self._conn._raw.transaction(**self._options)
            await real.start()
            self._real = real

    async def commit(self) -> None:
        await self._end("commit")

    async def rollback(self) -> None:
        await self._end("rollback")

    async def _end(self, how: str) -> None:
        try:
            if self._real is not None:
                await getattr(self._real, how)()
        finally:
            if self._conn._lazy is self:
                self._conn._lazy = None


class LazyStatement:
    """A prepared statement that begins its connection's pending
    transaction before it runs, if it needs one."""

    def __init__(self, conn: LazyBeginConnection, stmt: Any, transactional: bool) -> None:
        self._conn = conn
        self._stmt = stmt
        self._transactional = transactional

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stmt, name)

    async def fetch(self, *args: Any, **kwargs: Any) -> Any:
        if self._transactional:
            await self._conn._begin_pending()
        return await self._stmt.fetch(*args, **kwargs)

    async def cursor(self, *args: Any, **kwargs: Any) -> Any:
        # A server-side cursor lives in a transaction (the adapter awaits
        # this for one).
        await self._conn._begin_pending()
        return await self._stmt.cursor(*args, **kwargs)


class LazyBeginConnection:
    """An asyncpg connection whose transactions begin at their first write
    (see the module docstring); everything else is asyncpg's."""

    def __init__(self, raw: asyncpg.Connection) -> None:
        self._raw = raw
        self._lazy: LazyTransaction | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def transaction(self, **options: Any) -> LazyTransaction:
        return LazyTransaction(self, options)

    async def _begin_pending(self) -> None:
        if self._lazy is not None:
            await self._lazy.begin()

    async def prepare(self, query: str, **kwargs: Any) -> LazyStatement:
        stmt = await self._raw.prepare(query, **kwargs)
        return LazyStatement(self, stmt, needs_transaction(query))

    async def executemany(self, command: str, args: Any, **kwargs: Any) -> Any:
        await self._begin_pending()
        return await self._raw.executemany(command, args, **kwargs)

    async def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
        if needs_transaction(query):
            await self._begin_pending()
        return await self._raw.execute(query, *args, **kwargs)


def connector(
    connect_kwargs: Mapping[str, Any],
) -> Callable[[], Awaitable[LazyBeginConnection]]:
    """An ``async_creator`` for ``create_async_engine``: connects with the
    dialect's connect arguments."""
    kwargs = dict(connect_kwargs)

    async def connect() -> LazyBeginConnection:
        return LazyBeginConnection(await asyncpg.connect(**kwargs))

    return connect
