"""Answer with models serialised once, for the hottest read endpoints.

FastAPI turns a returned model into a dict, validates it again against the
``response_model`` and then serialises it: for a page of clusters with their
nodes that is a third of the request. The views the services build are
already models of the documented type, so these routes serialise them
straight to JSON (pydantic's Rust serialiser) and keep ``response_model``
for the OpenAPI document alone.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from fastapi import Response
from pydantic import TypeAdapter


@cache
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


def json_response(value: Any, tp: Any, *, status_code: int = 200) -> Response:
    """``value`` (an instance of ``tp``) as the JSON FastAPI would send."""
    return Response(
        _adapter(tp).dump_json(value), status_code=status_code, media_type="application/json"
    )
