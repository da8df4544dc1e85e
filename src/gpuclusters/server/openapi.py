"""The OpenAPI document states what every operation can answer.

FastAPI documents the success response and a 422 in its own shape. Every
error the server sends is the ``{code, message, field}`` body of
`server.errors`, so this hook rewrites the generated document once:

* ``ErrorBody`` becomes a component and replaces FastAPI's validation error;
* operations that authenticate the caller (FastAPI marks those that depend
  on `deps.get_principal` with its bearer scheme) answer 401 (no key or a bad
  one) and 403 (no role that allows it); the other ``/v1`` operations that
  take input check a token in their body or query, and answer 401 and 403 too;
* operations that name something (a path parameter, or a project, cluster
  or volume in the query or body) answer 404 when it does not exist or the
  caller may not see it;
* operations that change things answer 409 (already exists, wrong state,
  capacity unavailable);
* operations that take parameters or a body answer 422 naming the field,
  and 400 for a body that is not JSON at all.

The fuzzer (tests/e2e/test_api_fuzz.py) checks the server against this
document with every schemathesis check, so a status the document omits
fails CI.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gpuclusters.core.models import ErrorBody

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}

_DESCRIPTIONS = {
    "400": "the body could not be parsed as JSON",
    "401": "no API key, or one the server does not know",
    "403": "the key's user has no role that allows this",
    "404": "a named resource does not exist (or the caller may not see it)",
    "409": "conflict: already exists, wrong state, or capacity unavailable",
    "422": "invalid input; `field` names the field and `message` the rule",
}
_MUTATING = {"post", "put", "patch", "delete"}


def _takes_input(operation: dict[str, Any]) -> bool:
    return bool(operation.get("parameters")) or "requestBody" in operation


def error_statuses(path: str, method: str, operation: dict[str, Any]) -> list[str]:
    """The error statuses one operation can answer (see the module doc)."""
    statuses = ["400"] if "requestBody" in operation else []
    if "security" in operation or (path.startswith("/v1/") and _takes_input(operation)):
        statuses += ["401", "403"]
    if "{" in path or _takes_input(operation):
        statuses.append("404")
    if method in _MUTATING:
        statuses.append("409")
    if _takes_input(operation):
        statuses.append("422")
    return statuses


def _error_response(status: str) -> dict[str, Any]:
    return {
        "description": _DESCRIPTIONS[status],
        "content": {"application/json": {"schema": ERROR_REF}},
    }


def document(app: FastAPI) -> dict[str, Any]:
    schema = get_openapi(
        title=app.title,
        version=app.version,
        description=app.description,
        routes=app.routes,
    )
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorBody"] = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
    # FastAPI's own validation error shape is never sent (server/errors.py).
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status in error_statuses(path, method, operation):
                responses[status] = _error_response(status)
            # Errors a route documents itself are JSON too, whatever its
            # success type (ca.pem is text).
            for status, response in responses.items():
                if status.isdigit() and int(status) >= 400:
                    response["content"] = {"application/json": {"schema": ERROR_REF}}
    return schema


@cache
def _templates(app: FastAPI) -> list[tuple[re.Pattern[str], int, frozenset[str]]]:
    """Each documented path as a pattern, its number of parameters, and its
    methods."""
    out = []
    for path, operations in app.openapi().get("paths", {}).items():
        pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(path))
        methods = frozenset(m.upper() for m in operations)
        out.append((re.compile(f"^{pattern}$"), path.count("{"), methods))
    return out


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The methods the document lists for a request path, for ``Allow`` on a
    405 (Starlette's own lists only one route's, and a path has a route per
    method)."""
    matches = [(n, ops) for pattern, n, ops in _templates(app) if pattern.match(path)]
    # The most literal template wins: /v1/hosts/join-tokens, not /v1/hosts/{name}.
    fewest = min((n for n, _ in matches), default=0)
    methods = {m for n, ops in matches if n == fewest for m in ops}
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented hook


def _is_array(schema: dict[str, Any]) -> bool:
    options = schema.get("anyOf") or schema.get("oneOf") or [schema]
    return any(option.get("type") == "array" for option in options)


@cache
def _repeatable(app: FastAPI) -> dict[tuple[str, str], frozenset[str]]:
    out: dict[tuple[str, str], frozenset[str]] = {}
    for path, operations in app.openapi().get("paths", {}).items():
        for method, operation in operations.items():
            out[(path, method.upper())] = frozenset(
                p["name"]
                for p in operation.get("parameters", [])
                if p.get("in") == "query" and _is_array(p.get("schema", {}))
            )
    return out


def repeatable_query(app: FastAPI, path: str, method: str) -> frozenset[str]:
    """The query parameters of one operation (by its path template) that the
    document states as arrays: the only ones that may appear more than once."""
    return _repeatable(app).get((path, "GET" if method == "HEAD" else method), frozenset())
