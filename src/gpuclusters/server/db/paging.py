"""Keyset pages of rows: see ``core/paging.py`` for the cursor.

Most lists run oldest first by (created_at, name, id); node events run
newest first by (timestamp, node_name, id), the audit log by (timestamp,
user_name, id). One range scan of an index per
page, however deep, and rows added or removed between pages shift nothing.
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute

from gpuclusters.core.paging import Position, decode_cursor, encode_cursor
from gpuclusters.server.db.models import AuditEvent, Cluster, Host, Node, NodeEvent

Row = TypeVar("Row", Cluster, Node, Host, NodeEvent, AuditEvent)


def _sort_key(
    model: type[Row],
) -> tuple[InstrumentedAttribute[Any], InstrumentedAttribute[Any], InstrumentedAttribute[Any]]:
    """The three columns a model's pages are ordered by (a total order:
    the last is the primary key)."""
    if issubclass(model, NodeEvent):
        return NodeEvent.timestamp, NodeEvent.node_name, NodeEvent.id
    if issubclass(model, AuditEvent):
        return AuditEvent.timestamp, AuditEvent.user_name, AuditEvent.id
    return model.created_at, model.name, model.id


def _position(row: Row) -> Position:
    if isinstance(row, NodeEvent):
        return Position(created_at=row.timestamp, name=row.node_name, id=row.id)
    if isinstance(row, AuditEvent):
        return Position(created_at=row.timestamp, name=row.user_name, id=row.id)
    return Position(created_at=row.created_at, name=row.name, id=row.id)


async def page_of(
    session: AsyncSession,
    query: Select[Row],
    model: type[Row],
    *,
    limit: int | None,
    cursor: str | None,
    newest_first: bool = False,
) -> tuple[list[Row], str | None]:
    """Up to ``limit`` rows after ``cursor`` (all of them if ``limit`` is
    None) and the cursor of the next page, if there is one."""
    first, second, third = _sort_key(model)
    if cursor is not None:
        pos = decode_cursor(cursor)

        def after(column: InstrumentedAttribute[Any], value: Any) -> Any:
            return column < value if newest_first else column > value

        query = query.where(
            or_(
                after(first, pos.created_at),
                and_(first == pos.created_at, after(second, pos.name)),
                and_(first == pos.created_at, second == pos.name, after(third, pos.id)),
            )
        )
    if newest_first:
        query = query.order_by(first.desc(), second.desc(), third.desc())
    else:
        query = query.order_by(first, second, third)
    if limit is not None:
        query = query.limit(limit + 1)
    rows = list(await session.scalars(query))
    if limit is None or len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    return rows, encode_cursor(_position(rows[-1]))
