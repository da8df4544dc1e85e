"""Errors only the client raises, on top of the shared domain hierarchy.

Everything the server answers becomes one of the classes in
:mod:`gpuclusters.core.errors` (``except NotFoundError`` works the same on
both sides). The classes here cover what happens on the client's side of the
wire: the server cannot be reached, it answered something that is not the API,
or a wait ended without the cluster becoming usable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpuclusters.core.errors import GpuClustersError

if TYPE_CHECKING:
    from gpuclusters.core.models import Cluster


class ConnectionFailedError(GpuClustersError):
    """The server URL could not be reached (refused, DNS, TLS, timeout)."""

    code = "connection_failed"


class UnexpectedResponseError(GpuClustersError):
    """The server answered, but not with what the API documents."""

    code = "bad_response"


class ClusterFailedError(GpuClustersError):
    """A waited-for cluster ended in status ``failed``; ``cluster`` is its last state."""

    code = "cluster_failed"

    def __init__(self, message: str, *, cluster: Cluster, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.cluster = cluster


class WaitTimeoutError(GpuClustersError):
    """A wait did not reach its goal within its timeout."""

    code = "timeout"
