"""Typed Python SDK for the gpuclusters REST API (``/v1``).

Import :class:`Client` and the errors from here; the request and response
models are the shared ones in :mod:`gpuclusters.core.models`. The domain
errors of :mod:`gpuclusters.core.errors` are re-exported so that SDK users
need one import::

    from gpuclusters.client import Client, NotFoundError
"""

from gpuclusters.client.client import Client
from gpuclusters.client.config import ClientConfig
from gpuclusters.client.errors import (
    ClusterFailedError,
    ConnectionFailedError,
    UnexpectedResponseError,
    WaitTimeoutError,
)
from gpuclusters.core.clientconfig import ClientConfigError
from gpuclusters.core.errors import (
    AlreadyExistsError,
    AuthenticationError,
    CapacityUnavailableError,
    ConflictError,
    GpuClustersError,
    InvalidStateError,
    NotFoundError,
    PermissionDeniedError,
    ServerError,
    ValidationError,
)

__all__ = [
    "AlreadyExistsError",
    "AuthenticationError",
    "CapacityUnavailableError",
    "Client",
    "ClientConfig",
    "ClientConfigError",
    "ClusterFailedError",
    "ConflictError",
    "ConnectionFailedError",
    "GpuClustersError",
    "InvalidStateError",
    "NotFoundError",
    "PermissionDeniedError",
    "ServerError",
    "UnexpectedResponseError",
    "ValidationError",
    "WaitTimeoutError",
]
