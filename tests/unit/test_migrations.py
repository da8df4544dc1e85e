"""The Alembic migrations build exactly the schema the models describe."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from gpuclusters.server.db.engine import make_engine
from gpuclusters.server.db.migrate import upgrade_to_head
from gpuclusters.server.db.models import Base


async def test_migrations_match_models(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    engine = make_engine(f"sqlite+aiosqlite:///{db}")
    await upgrade_to_head(engine)
    await upgrade_to_head(engine)  # idempotent at every start
    await engine.dispose()
    sync = create_engine(f"sqlite:///{db}")
    try:
        with sync.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        sync.dispose()
    assert diff == []
