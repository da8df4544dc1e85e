"""What differs between the two databases the server runs on."""

from __future__ import annotations

from typing import Any

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession


def upsert_insert(session: AsyncSession, model: Any) -> Any:
    """An INSERT for ``model`` on the session's database that takes
    ``on_conflict_do_nothing`` / ``on_conflict_do_update`` (both dialects
    spell them the same way): one statement where a look-up and a write
    would be two."""
    dialect = session.get_bind().dialect.name
    return (pg_insert if dialect == "postgresql" else sqlite_insert)(model)
