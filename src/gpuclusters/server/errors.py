"""The one place domain errors become HTTP responses.

Every 4xx body is ``{code, message, field}``. Request validation failures
(pydantic) become ``invalid_input`` naming the field and the rule; anything
unexpected becomes a logged 500 with code ``internal`` and no stack trace.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpuclusters.core import errors as e
from gpuclusters.server import openapi

log = logging.getLogger(__name__)

HTTP_STATUS: dict[type[e.GpuClustersError], int] = {
    e.ValidationError: 422,
    e.AuthenticationError: 401,
    e.PermissionDeniedError: 403,
    e.NotFoundError: 404,
    e.ConflictError: 409,
    e.ServerError: 500,
    e.UnavailableError: 503,
}


def status_for(exc: e.GpuClustersError) -> int:
    for cls in type(exc).__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return 400


def _field_of(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    return ".".join(parts)


def validation_error(exc: RequestValidationError) -> e.ValidationError:
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    field = _field_of(tuple(err.get("loc", ())))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    # Model-level validators name their field as "field: rule".
    head, sep, rest = msg.partition(": ")
    if not field and sep and head.isidentifier():
        field, msg = head, rest
    elif field and msg.startswith(f"{field}: "):
        msg = msg.removeprefix(f"{field}: ")
    if err.get("type") == "missing":
        msg = "is required"
    text = f"{field}: {msg}" if field else msg
    extra = len(exc.errors()) - 1
    if extra > 0:
        text += f" (and {extra} more problem{'s' if extra > 1 else ''})"
    return e.ValidationError(text, field=field or None)


def install(app: FastAPI) -> None:
    @app.exception_handler(e.GpuClustersError)
    async def _domain(_: Request, exc: e.GpuClustersError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=status_for(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        return JSONResponse(err.to_dict(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            methods = openapi.allowed_methods(request.app, request.url.path)
            headers["Allow"] = ", ".join(methods)
        # 400: a body that is not JSON at all (FastAPI cannot parse it).
        code = {400: "invalid_input", 404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "error"
        )
        return JSONResponse(
            {"code": code, "message": str(exc.detail), "field": None},
            status_code=exc.status_code,
            headers=headers,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            e.ServerError("internal server error; see the server log").to_dict(), status_code=500
        )
