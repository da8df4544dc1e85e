"""The async engine and session factory.

SQLite gets WAL mode and a busy timeout so API requests and controllers can
write concurrently without "database is locked" errors; PostgreSQL needs
nothing special. With ``slow_query_ms`` set, every statement slower than
that is logged with its time (``GPUCLUSTERS_SLOW_QUERY_MS``): how to find
what a busy database spends its time on.

A server makes two engines: one for API requests and one for everything
else (controllers, housekeeping), so neither can starve the other of
connections (``server/runtime.py``). On PostgreSQL each pool holds up to
20 connections: a replica opens at most 40, which with several replicas
must stay under the server's ``max_connections`` (100 by default).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.ext.asyncio import AsyncSession as AsyncSession

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


def make_engine(url: str, *, slow_query_ms: float | None = None) -> AsyncEngine:
    engine = _make_engine(url)
    if slow_query_ms is not None:
        log_slow_queries(engine, slow_query_ms)
    return engine


def _make_engine(url: str) -> AsyncEngine:
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_async_engine(url, pool_size=10, max_overflow=10, pool_pre_ping=True)


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
