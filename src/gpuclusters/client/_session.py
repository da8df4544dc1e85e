"""The one place that speaks HTTP: requests, error mapping, model parsing.

Resource groups (``clusters``, ``volumes``, ...) share one :class:`Session`
and never touch httpx themselves, so the rules below hold everywhere:

* a non-2xx answer with an API error body ``{code, message, field}`` is
  rebuilt with :func:`gpuclusters.core.errors.error_from_dict`; anything else
  (a proxy's HTML page, FastAPI's default ``{"detail": ...}``) is mapped by
  HTTP status onto the same hierarchy;
* transport failures become :class:`ConnectionFailedError`, raised ``from``
  the httpx exception and naming the URL that could not be reached; a
  server certificate that does not verify becomes :class:`UntrustedServerError`,
  which says how to trust the server's CA;
* 2xx bodies are validated into the pydantic models of
  :mod:`gpuclusters.core.models`; a body that does not fit raises
  :class:`UnexpectedResponseError` instead of a pydantic error.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import pydantic
from pydantic import BaseModel

from gpuclusters import __version__
from gpuclusters.client.errors import ConnectionFailedError, UnexpectedResponseError
from gpuclusters.core.clientconfig import ClientConfigError
from gpuclusters.core.errors import (
    AuthenticationError,
    ConflictError,
    GpuClustersError,
    NotFoundError,
    PermissionDeniedError,
    ServerError,
    ValidationError,
    error_from_dict,
)
from gpuclusters.core.paging import MAX_LIMIT, NEXT_CURSOR_HEADER, Page

M = TypeVar("M", bound=BaseModel)

Query = Mapping[str, str | int | bool | None]
"""Query parameters; ``None`` values are dropped before sending."""

_BY_STATUS: dict[int, type[GpuClustersError]] = {
    400: ValidationError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: ValidationError,
}


TRUST_HINT = (
    "trust its CA with `gpuclusters login --ca-file FILE` or `--ca-fingerprint SHA256`, "
    "or set GPUCLUSTERS_CA_FILE"
)


class UntrustedServerError(ConnectionFailedError):
    """The server's TLS certificate does not verify (unknown CA, another
    name), or its CA is not the one the user was told about."""

    code = "untrusted_server"


def ssl_context(ca_file: str | Path | None) -> ssl.SSLContext:
    """How https servers are verified: against the CA certificate(s) in
    ``ca_file`` alone, or the system's trust store when it is ``None``."""
    if ca_file is None:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=str(ca_file))
    except FileNotFoundError as exc:
        raise ClientConfigError(f"ca_file {ca_file}: no such file", field="ca_file") from exc
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ClientConfigError(
            f"ca_file {ca_file} is not a PEM CA certificate: {exc}", field="ca_file"
        ) from exc


def _tls_failure(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind an httpx transport error, if any."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def quote_name(name: str) -> str:
    """A path segment; names are DNS labels, but never trust that blindly."""
    return quote(name, safe="")


def body_of(payload: BaseModel | Mapping[str, Any], *, partial: bool = False) -> Any:
    """JSON for a request body: a model (``partial``: only the fields set) or a
    plain mapping, sent as is so that the server does the validating."""
    if isinstance(payload, BaseModel):
        return payload.model_dump(mode="json", exclude_unset=partial)
    return dict(payload)


def error_from_response(response: httpx.Response) -> GpuClustersError:
    try:
        data = response.json()
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("code"), str):
        return error_from_dict(data)
    detail = data.get("detail") if isinstance(data, dict) else None
    if isinstance(detail, str) and detail:
        message = detail
    else:
        text = response.text.strip()
        message = f"HTTP {response.status_code} {response.reason_phrase}" + (
            f": {text[:200]}" if text else ""
        )
    cls = _BY_STATUS.get(response.status_code)
    if cls is None:
        cls = ServerError if response.status_code >= 500 else GpuClustersError
    return cls(message)


class Session:
    """An httpx client bound to one server, key and (mutable) project."""

    def __init__(self, http: httpx.Client, *, project: str) -> None:
        self.http = http
        self.project = project

    @property
    def url(self) -> str:
        return str(self.http.base_url).rstrip("/")

    def project_path(self, *parts: str) -> str:
        """``/v1/projects/{project}/part/...`` with every segment quoted."""
        segments = [quote_name(self.project), *(quote_name(p) for p in parts)]
        return "/v1/projects/" + "/".join(segments)

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Query | None = None,
        json: Any = None,
    ) -> httpx.Response:
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            response = self.http.request(method, path, params=clean or None, json=json)
        except httpx.TimeoutException as exc:
            raise ConnectionFailedError(
                f"the gpuclusters server at {self.url} did not answer in time ({method} {path})"
            ) from exc
        except httpx.TransportError as exc:
            tls_error = _tls_failure(exc)
            # reason and verify_message are set by OpenSSL's errors only.
            reason = getattr(tls_error, "verify_message", None) or getattr(
                tls_error, "reason", None
            )
            if isinstance(tls_error, ssl.SSLCertVerificationError):
                raise UntrustedServerError(
                    f"the server at {self.url} has a TLS certificate this client does not "
                    f"trust ({reason or tls_error}); {TRUST_HINT}"
                ) from exc
            if tls_error is not None:
                raise ConnectionFailedError(
                    f"TLS with {self.url} failed ({reason or tls_error}): "
                    "is it an https:// address of a gpuclusters server?"
                ) from exc
            raise ConnectionFailedError(
                f"could not reach the gpuclusters server at {self.url}: "
                f"{str(exc) or type(exc).__name__}"
                " (is it running? set GPUCLUSTERS_URL or url in config.toml)"
            ) from exc
        except httpx.RequestError as exc:  # decoding, redirects: it answered, but badly
            raise UnexpectedResponseError(
                f"{method} {path}: {str(exc) or type(exc).__name__}"
            ) from exc
        if not response.is_success:
            raise error_from_response(response)
        return response

    def _json(self, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError as exc:
            raise UnexpectedResponseError(
                f"{response.request.method} {response.request.url.path}: answer is not JSON"
            ) from exc

    def parse(self, response: httpx.Response, model: type[M]) -> M:
        try:
            return model.model_validate(self._json(response))
        except pydantic.ValidationError as exc:
            raise UnexpectedResponseError(
                f"{response.request.method} {response.request.url.path}: answer is not a "
                f"{model.__name__}: {exc.error_count()} validation error(s), first: "
                f"{exc.errors()[0]['msg']}"
            ) from exc

    def parse_list(self, response: httpx.Response, model: type[M]) -> list[M]:
        data = self._json(response)
        if not isinstance(data, list):
            raise UnexpectedResponseError(
                f"{response.request.method} {response.request.url.path}: expected a JSON array"
            )
        try:
            return [model.model_validate(item) for item in data]
        except pydantic.ValidationError as exc:
            raise UnexpectedResponseError(
                f"{response.request.method} {response.request.url.path}: an item is not a "
                f"{model.__name__}: {exc.errors()[0]['msg']}"
            ) from exc

    # Shorthands used by the resource groups.

    def get(
        self,
        path: str,
        model: type[M],
        *,
        params: Query | None = None,
    ) -> M:
        return self.parse(self.request("GET", path, params=params), model)

    def get_list(
        self,
        path: str,
        model: type[M],
        *,
        params: Query | None = None,
    ) -> list[M]:
        return self.parse_list(self.request("GET", path, params=params), model)

    def get_page(
        self,
        path: str,
        model: type[M],
        *,
        params: Query | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page[M]:
        """One page of a paged list (``core/paging.py``) and the next cursor."""
        query: dict[str, Any] = {**(params or {}), "limit": limit, "cursor": cursor}
        response = self.request("GET", path, params=query)
        return Page(self.parse_list(response, model), response.headers.get(NEXT_CURSOR_HEADER))

    def get_all(self, path: str, model: type[M], *, params: Query | None = None) -> list[M]:
        """Every item of a paged list, following the cursors page by page."""
        items: list[M] = []
        cursor: str | None = None
        while True:
            page = self.get_page(path, model, params=params, limit=MAX_LIMIT, cursor=cursor)
            items += page.items
            if page.next_cursor is None:
                return items
            cursor = page.next_cursor

    def send(
        self,
        method: str,
        path: str,
        *,
        model: type[M],
        json: Any = None,
        params: Query | None = None,
    ) -> M:
        return self.parse(self.request(method, path, params=params, json=json), model)


def make_http(
    url: str,
    api_key: str | None,
    *,
    timeout: float,
    transport: httpx.BaseTransport | None,
    ca_file: str | Path | None = None,
    verify: bool = True,
) -> httpx.Client:
    """An httpx client for ``url``. https is verified with :func:`ssl_context`
    (``ca_file``, else the system store) unless ``verify`` is false (used only
    to fetch a CA whose fingerprint is then checked)."""
    headers = {"Accept": "application/json", "User-Agent": f"gpuclusters-client/{__version__}"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    tls: ssl.SSLContext | bool = verify
    if verify and transport is None and url.lower().startswith("https:"):
        tls = ssl_context(ca_file)
    return httpx.Client(
        base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport, verify=tls
    )


__all__ = [
    "TRUST_HINT",
    "Query",
    "Session",
    "UntrustedServerError",
    "body_of",
    "error_from_response",
    "make_http",
    "quote_name",
    "ssl_context",
]
