"""Cursors of the paged list endpoints (core/paging.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpuclusters.core.errors import ValidationError
from gpuclusters.core.paging import Position, decode_cursor, encode_cursor


def test_cursor_round_trips() -> None:
    pos = Position(datetime(2026, 12, 5, 8, 0, 1, 123456, tzinfo=UTC), "b0001", "abc123")
    cursor = encode_cursor(pos)
    assert "=" not in cursor and "/" not in cursor and "+" not in cursor  # URL-safe
    assert decode_cursor(cursor) == pos


@pytest.mark.parametrize(
    "cursor",
    [
        "",
        "not base64!",
        "bm90IGpzb24",  # "not json"
        "WzEsMiwzXQ",  # [1,2,3]
        "WyJ4IiwiYSIsImIiXQ",  # ["x","a","b"]: not a time
        "WyIyMDI2LTAxLTAxVDAwOjAwOjAwIiwiYSIsImIiXQ",  # a time with no zone
    ],
)
def test_foreign_cursors_are_refused_naming_the_field(cursor: str) -> None:
    with pytest.raises(ValidationError) as err:
        decode_cursor(cursor)
    assert err.value.field == "cursor"
    assert "cursor" in str(err.value)
