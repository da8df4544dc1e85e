"""Keyset pages of rows ordered by (created_at, name, id): see
``core/paging.py`` for the cursor. One range scan of an index per page,
however deep, and rows added or removed between pages shift nothing."""

from __future__ import annotations

from typing import TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.paging import Position, decode_cursor, encode_cursor
from gpuclusters.server.db.models import Cluster, Node

Row = TypeVar("Row", Cluster, Node)


async def page_of(
    session: AsyncSession,
    query: Select[Row],
    model: type[Row],
    *,
    limit: int | None,
    cursor: str | None,
) -> tuple[list[Row], str | None]:
    """Up to ``limit`` rows after ``cursor`` (all of them if ``limit`` is
    None) and the cursor of the next page, if there is one."""
    if cursor is not None:
        pos = decode_cursor(cursor)
        query = query.where(
            or_(
                model.created_at > pos.created_at,
                and_(model.created_at == pos.created_at, model.name > pos.name),
                and_(model.created_at == pos.created_at, model.name == pos.name, model.id > pos.id),
            )
        )
    query = query.order_by(model.created_at, model.name, model.id)
    if limit is not None:
        query = query.limit(limit + 1)
    rows = list(await session.scalars(query))
    if limit is None or len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    last = rows[-1]
    return rows, encode_cursor(Position(created_at=last.created_at, name=last.name, id=last.id))
