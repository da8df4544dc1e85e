"""A query parameter the document states as one value is refused when a
request repeats it.

Starlette keeps every value of a repeated key and FastAPI quietly takes the
last one, so ``?project=a&project=b`` would act on ``b`` although the
OpenAPI document says ``project`` is a string. The schema-driven fuzzer sends
exactly that as invalid input and expects a refusal; so would a user who
thought the list filtered by both. This app-wide dependency refuses it with
a 422 naming the parameter; parameters the document states as arrays (the
registry token's ``scope``) stay repeatable.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated

from fastapi import Request
from pydantic import BeforeValidator

from gpuclusters.core import errors as e
from gpuclusters.server import openapi


async def single_valued_query(request: Request) -> None:
    params = request.query_params
    if len(params.multi_items()) == len(params):
        return  # no key repeated: the common case costs one comparison
    route = request.scope.get("route")
    path = getattr(route, "path", request.url.path)
    repeatable = openapi.repeatable_query(request.app, path, request.method)
    for key in params:
        if key not in repeatable and len(params.getlist(key)) > 1:
            raise e.ValidationError(f"{key}: may be given only once", field=key)


_ISO_TIME = re.compile(r"\d{4}-\d{2}-\d{2}([T ].*)?")


def _iso_only(value: object) -> object:
    """The document says ``date-time``; pydantic would also take a number
    (Unix seconds), which the document rules out."""
    if isinstance(value, str) and not _ISO_TIME.fullmatch(value.strip()):
        raise ValueError("must be an ISO 8601 time, e.g. 2026-12-01T08:00:00Z")
    return value


# A time in a query string: ISO 8601 only.
IsoTime = Annotated[datetime, BeforeValidator(_iso_only)]
