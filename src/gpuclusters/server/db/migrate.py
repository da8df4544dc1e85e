"""Apply Alembic migrations at server start (``upgrade head``).

The migration scripts live next to this module, so an installed package can
migrate its own database without an alembic.ini on disk.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


async def upgrade_to_head(engine: AsyncEngine) -> None:
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))

    def _run(conn: Connection) -> None:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")

    async with engine.begin() as conn:
        await conn.run_sync(_run)
