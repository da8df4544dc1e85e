"""Keyset pagination of list endpoints.

Lists are ordered by (created_at, name, id) and cut into pages of ``limit``
items; the server answers a page with the array itself (the ``/v1`` list
shape is unchanged) and, when more follow, the cursor of the next page in
the ``X-Next-Cursor`` header and a ``Link: <...>; rel="next"`` header. A
cursor is the position of the last item given, opaque to clients
(URL-safe base64 of a small JSON array), so pages stay correct while rows
are added or removed, and each page costs one index range scan however deep
it is.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from gpuclusters.core.errors import ValidationError

T = TypeVar("T")

DEFAULT_LIMIT = 20
MAX_LIMIT = 1000
NEXT_CURSOR_HEADER = "X-Next-Cursor"


@dataclass(frozen=True, slots=True)
class Position:
    """Where a page ends: the sort key of its last item."""

    created_at: datetime
    name: str
    id: str


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    items: list[T]
    next_cursor: str | None = None


def encode_cursor(pos: Position) -> str:
    raw = json.dumps([pos.created_at.isoformat(), pos.name, pos.id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> Position:
    """The position a cursor names; ``ValidationError`` (field ``cursor``)
    for anything this server did not hand out."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, name, row_id = json.loads(raw)
        if not (isinstance(name, str) and isinstance(row_id, str)):
            raise TypeError
        when = datetime.fromisoformat(created_at)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise ValidationError(
            "cursor: not a cursor this server handed out (take it from the "
            f"{NEXT_CURSOR_HEADER} header of the previous page)",
            field="cursor",
        ) from None
    if when.tzinfo is None:
        raise ValidationError("cursor: not a cursor this server handed out", field="cursor")
    return Position(created_at=when, name=name, id=row_id)
