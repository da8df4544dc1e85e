"""The async engine and session factory.

SQLite gets WAL mode, and its statements run on the event loop's thread
(``db/sqlite_inline.py``: no worker thread per connection), with a lock
held by another process waited for off the loop. On PostgreSQL, a
transaction begins at its first write, so a session that only reads costs
its statements and nothing more (``db/pg_transactions.py``); a connection
the server closed is replaced at checkout without a round trip; and
``db/statistics.py`` keeps the planner's statistics fresh. With
``slow_query_ms`` set, every statement slower than that is logged with its
time (``GPUCLUSTERS_SLOW_QUERY_MS``): how to find what a busy database
spends its time on.

SQLite allows one writer at a time. When a second connection wants to
write, SQLite's busy handler sleeps and retries (1, 2, 5 ... up to 100 ms
between tries), so under load most of a write's time was spent asleep after
the lock was already free: on the control-plane bench, 50 ms on average for
the first write of each transaction. So the writers of one process queue on
an asyncio lock instead (``WriteGate``): a transaction takes it just before
its first INSERT, UPDATE or DELETE (where the sqlite3 module begins the
transaction) and gives it back when it commits, rolls back or its
connection closes, and the next writer starts the moment it is free. Writers
in other processes (tools opening the file) are waited for by
``sqlite_inline``'s retries. Waiting longer than 30 s is an error, as it
was.

A server makes two engines: one for API requests and one for everything
else (controllers, housekeeping), so neither can starve the other of
connections (``server/runtime.py``). On PostgreSQL each pool keeps 20
connections open once a burst has needed them (no overflow connections to
open and close again): a replica holds at most 40, which with several
replicas must stay under the server's ``max_connections`` (100 by default).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

from sqlalchemy import event, exc, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.ext.asyncio import AsyncSession as AsyncSession
from sqlalchemy.util import await_only

from gpuclusters.server.db import pg_transactions, sqlite_inline

log = logging.getLogger(__name__)


def log_slow_queries(engine: AsyncEngine, threshold_ms: float) -> None:
    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _start(_c: Any, _cur: Any, _stmt: str, _p: Any, context: Any, _many: bool) -> None:
        context._gpuc_started = time.perf_counter()

    @event.listens_for(engine.sync_engine, "after_cursor_execute")
    def _end(_c: Any, _cur: Any, statement: str, _p: Any, context: Any, _many: bool) -> None:
        took = (time.perf_counter() - context._gpuc_started) * 1000
        if took >= threshold_ms:
            log.warning("slow query (%.1f ms): %s", took, " ".join(statement.split()))


SQLITE_BUSY_TIMEOUT_S = 30.0
_WRITES = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE"})


class WriteGate:
    """One writer at a time among a process's connections to one SQLite
    database (see the module docstring). A lock per event loop: tests run
    several loops one after another in one process."""

    def __init__(self) -> None:
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        # DBAPI connections (by id) holding the lock, with the lock they hold.
        self._holders: dict[int, asyncio.Lock] = {}

    def _lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        lock = self._locks.get(loop)
        if lock is None:
            lock = self._locks[loop] = asyncio.Lock()
        return lock

    async def enter(self, dbapi_conn: Any, statement: str) -> None:
        """Before a statement: a first write of a transaction waits its turn."""
        key = id(dbapi_conn)
        if key in self._holders or _first_word(statement) not in _WRITES:
            return
        lock = self._lock()
        try:
            # Not ``asyncio.wait_for``: on Python 3.11 it loses a cancellation
            # that arrives as the lock is granted (the caller then runs on as
            # if never cancelled: a server's shutdown waited for ever on a
            # housekeeping task that had gone back to sleep).
            async with asyncio.timeout(SQLITE_BUSY_TIMEOUT_S):
                await lock.acquire()
        except TimeoutError:
            raise exc.OperationalError(
                statement, None, TimeoutError("database is locked (waited for another writer)")
            ) from None
        self._holders[key] = lock

    def leave(self, dbapi_conn: Any) -> None:
        """After a commit or rollback (or a close): the next writer may go."""
        lock = self._holders.pop(id(dbapi_conn), None)
        if lock is not None:
            lock.release()


def _first_word(statement: str) -> str:
    head = statement.lstrip()[:8]
    return head.split(None, 1)[0].upper() if head else ""


def _raw(conn: Any) -> Any:
    """The DBAPI connection behind a pool's proxy (or itself)."""
    return getattr(conn, "dbapi_connection", conn)


_GATES: dict[str, WriteGate] = {}


def serialize_sqlite_writes(engine: AsyncEngine, gate: WriteGate) -> None:
    """Make the engine's writers queue on ``gate`` (see ``WriteGate``)."""

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _wait_turn(conn: Any, _cur: Any, statement: str, _p: Any, _ctx: Any, _many: bool) -> None:
        await_only(gate.enter(_raw(conn.connection), statement))

    dialect = engine.sync_engine.dialect
    for name in ("do_commit", "do_rollback", "do_close", "do_terminate"):
        original = getattr(dialect, name)

        def wrapped(dbapi_conn: Any, _original: Any = original) -> None:
            try:
                _original(dbapi_conn)
            finally:
                gate.leave(_raw(dbapi_conn))

        setattr(dialect, name, wrapped)


def make_engine(url: str, *, slow_query_ms: float | None = None) -> AsyncEngine:
    engine = _make_engine(url)
    if slow_query_ms is not None:
        log_slow_queries(engine, slow_query_ms)
    return engine


def _make_engine(url: str) -> AsyncEngine:
    if url.startswith("sqlite"):
        # Statements run on the loop's thread, not aiosqlite's
        # (``db/sqlite_inline.py``), with the dialect's connect arguments.
        sa_url = make_url(url)
        args, kwargs = sa_url.get_dialect()().create_connect_args(sa_url)
        engine = create_async_engine(
            url,
            async_creator=sqlite_inline.connector(args, kwargs, timeout_s=SQLITE_BUSY_TIMEOUT_S),
        )
        # One gate per database for every engine of this process on it.
        serialize_sqlite_writes(engine, _GATES.setdefault(url, WriteGate()))

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            # Short: a lock another process holds is waited for off the loop.
            cur.execute(f"PRAGMA busy_timeout={sqlite_inline.BUSY_SLICE_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return _make_postgresql_engine(url)


# Prepared statements each pooled connection keeps (asyncpg's adapter keeps
# 100 by default): a statement whose IN list has another length is another
# statement, and a miss costs a round trip to prepare it again.
PREPARED_STATEMENT_CACHE = 500
POOL_SIZE = 20


def _make_postgresql_engine(url: str) -> AsyncEngine:
    sa_url = make_url(url)
    _, kwargs = sa_url.get_dialect()().create_connect_args(sa_url)
    cache_size = int(kwargs.pop("prepared_statement_cache_size", PREPARED_STATEMENT_CACHE))
    dbapi = sa_url.get_dialect().import_dbapi()
    connect = pg_transactions.connector(kwargs)

    def creator() -> Any:
        # ``async_creator`` would drop the adapter's own arguments; this is
        # the form SQLAlchemy's asyncpg docs give for passing them.
        return dbapi.connect(async_creator_fn=connect, prepared_statement_cache_size=cache_size)

    # Transactions begin at their first write (``pg_transactions``). All 20
    # connections stay pooled: an overflow connection (closed when it comes
    # back to a full pool) cost a PostgreSQL backend's start, asyncpg's
    # handshake and every statement prepared again; under a burst the bench
    # opened 700 in two minutes.
    engine = create_async_engine(url, pool_size=POOL_SIZE, max_overflow=0, creator=creator)

    # No ``pool_pre_ping``: the adapter's ping is BEGIN, a statement and
    # ROLLBACK on every checkout, which on the bench was as many round trips
    # as all the statements. A connection the server closed while it sat in
    # the pool (a restart, a failover, an idle timeout) is known to asyncpg
    # already (its socket saw the close), and is replaced at checkout; one
    # that breaks in use fails that use, and SQLAlchemy then recycles the
    # pool's other connections.
    @event.listens_for(engine.sync_engine, "checkout")
    def _closed_by_the_server(_dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        if record.driver_connection.is_closed():
            raise exc.DisconnectionError("the server closed this connection")

    return engine


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
