"""Alembic environment. The server passes a live connection in
``config.attributes["connection"]``; the ``alembic`` command line (used to
write new migrations) gets a URL and runs through a sync engine."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from gpuclusters.server.db.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite needs batch mode for ALTER TABLE
    )
    with context.begin_transaction():
        context.run_migrations()


conn = config.attributes.get("connection")
if conn is not None:
    _run(conn)
else:
    url = config.get_main_option("sqlalchemy.url") or ""
    url = url.replace("+aiosqlite", "").replace("+asyncpg", "+psycopg")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as c:
        _run(c)
        c.commit()
