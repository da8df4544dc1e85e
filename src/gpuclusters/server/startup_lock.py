"""One replica at a time prepares the shared state at start.

Several servers may share one database and one home (docs/ha.md). What a
server does once at start (migrate the schema, load the fleet file into the
hosts table, create the first admin and write its key to ``config.toml``,
make the PKI for host agents) must not run in two of them at once: two
migrations would race, two bootstraps would both make an admin, two
processes writing a CA would leave a key that matches neither certificate.

The lock is both a PostgreSQL advisory lock (held on one connection for the
duration; every replica shares the database) and an exclusive ``flock`` on
``HOME/.startup.lock`` (replicas share the home). SQLite needs no database
lock: it serves one process (docs/ha.md), and its own write lock already
serializes two.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

# Any fixed 64-bit number, the same in every replica ("gpuc-st").
ADVISORY_KEY = int.from_bytes(b"gpuc-st", "big")


@contextlib.asynccontextmanager
async def home_lock(home: Path) -> AsyncIterator[None]:
    fd = os.open(home / ".startup.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        # flock blocks; a thread keeps the event loop free meanwhile.
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextlib.asynccontextmanager
async def database_lock(engine: AsyncEngine) -> AsyncIterator[None]:
    if engine.dialect.name != "postgresql":
        yield
        return
    async with engine.connect() as conn:
        await conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": ADVISORY_KEY})
        await conn.commit()
        try:
            yield
        finally:
            await conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": ADVISORY_KEY})
            await conn.commit()


@contextlib.asynccontextmanager
async def startup_lock(engine: AsyncEngine, home: Path) -> AsyncIterator[None]:
    async with home_lock(home), database_lock(engine):
        yield
