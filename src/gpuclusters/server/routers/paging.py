"""Query parameters and response headers of paged lists (``core/paging.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Query, Request, Response

from gpuclusters.core.paging import DEFAULT_LIMIT, MAX_LIMIT, NEXT_CURSOR_HEADER, Page
from gpuclusters.server.routers.json import json_response


@dataclass(frozen=True, slots=True)
class PageParams:
    limit: int
    cursor: str | None


def page_params(
    limit: Annotated[
        int, Query(ge=1, le=MAX_LIMIT, description="Items per page (at most 1000).")
    ] = DEFAULT_LIMIT,
    cursor: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=512,
            description=f"Where the page starts: the {NEXT_CURSOR_HEADER} header of the "
            "previous page (omit for the first page).",
        ),
    ] = None,
) -> PageParams:
    return PageParams(limit=limit, cursor=cursor)


PageDep = Annotated[PageParams, Depends(page_params)]

# The headers a paged list answers with, for the OpenAPI document.
PAGED: dict[int | str, dict[str, Any]] = {
    200: {
        "headers": {
            NEXT_CURSOR_HEADER: {
                "description": "Cursor of the next page; absent on the last page.",
                "schema": {"type": "string"},
            },
            "Link": {
                "description": 'The next page\'s URL, `<...>; rel="next"`; absent on the last.',
                "schema": {"type": "string"},
            },
        }
    }
}


def link_next(request: Request, response: Response, next_cursor: str | None) -> None:
    """Point at the next page, if there is one."""
    if next_cursor is None:
        return
    url = request.url.include_query_params(cursor=next_cursor)
    response.headers[NEXT_CURSOR_HEADER] = next_cursor
    response.headers["Link"] = f'<{url}>; rel="next"'


def paged_response(request: Request, page: Page[Any], tp: Any) -> Response:
    """A page of ``tp`` (a ``list[...]`` type) as JSON, with the next page's
    cursor in the headers."""
    response = json_response(page.items, tp)
    link_next(request, response, page.next_cursor)
    return response
