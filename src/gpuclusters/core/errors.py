"""One domain-error hierarchy with stable codes.

The server maps these to HTTP in exactly one place
(``gpuclusters.server.errors``); the client turns error bodies back into the
same classes, so SDK users can ``except NotFoundError``.

    GpuClustersError                      code            HTTP
    ├── ValidationError                   invalid_input   422
    ├── AuthenticationError               unauthenticated 401
    ├── PermissionDeniedError             forbidden       403
    ├── NotFoundError                     not_found       404
    ├── ConflictError                     conflict        409
    │   ├── AlreadyExistsError            already_exists  409
    │   ├── InvalidStateError             invalid_state   409
    │   ├── CapacityUnavailableError      capacity_unavailable 409
    │   └── QuotaExceededError            quota_exceeded  409
    └── ServerError                       internal        500
"""

from __future__ import annotations

from typing import ClassVar


class GpuClustersError(Exception):
    code: ClassVar[str] = "error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def to_dict(self) -> dict[str, str | None]:
        return {"code": self.code, "message": self.message, "field": self.field}


class ValidationError(GpuClustersError):
    code = "invalid_input"


class AuthenticationError(GpuClustersError):
    code = "unauthenticated"


class PermissionDeniedError(GpuClustersError):
    code = "forbidden"


class NotFoundError(GpuClustersError):
    code = "not_found"


class ConflictError(GpuClustersError):
    code = "conflict"


class AlreadyExistsError(ConflictError):
    code = "already_exists"


class InvalidStateError(ConflictError):
    code = "invalid_state"


class CapacityUnavailableError(ConflictError):
    code = "capacity_unavailable"


class QuotaExceededError(ConflictError):
    """A create, scale or resize would take the project above a quota; the
    message names the quota, its limit and the use, and ``field`` the quota."""

    code = "quota_exceeded"


class BudgetExhaustedError(ConflictError):
    """The project's budget is spent and its policy holds new nodes back
    (docs/budgets.md); the message says since when and how it lifts."""

    code = "budget_exhausted"


class ServerError(GpuClustersError):
    code = "internal"


class UnavailableError(ServerError):
    """A service the server relies on does not answer (503)."""

    code = "unavailable"


ERRORS_BY_CODE: dict[str, type[GpuClustersError]] = {
    cls.code: cls
    for cls in (
        GpuClustersError,
        ValidationError,
        AuthenticationError,
        PermissionDeniedError,
        NotFoundError,
        ConflictError,
        AlreadyExistsError,
        InvalidStateError,
        CapacityUnavailableError,
        QuotaExceededError,
        ServerError,
        UnavailableError,
    )
}


def error_from_dict(body: dict[str, object]) -> GpuClustersError:
    """Rebuild a domain error from an API error body (used by the client)."""
    code = str(body.get("code", "error"))
    cls = ERRORS_BY_CODE.get(code, GpuClustersError)
    field = body.get("field")
    err = cls(str(body.get("message", "")), field=str(field) if field is not None else None)
    if cls is GpuClustersError:
        err.code = code  # type: ignore[misc]  # keep an unknown server code visible
    return err
