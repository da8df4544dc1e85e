"""``client.clusters``: create, read, scale, delete and wait for clusters.

Waiting is client-side polling of ``GET .../clusters/{name}`` (about once a
second): the API has no watch endpoint, and a poll loop survives server
restarts between polls. ``on_change`` is called with the first state seen and
then whenever something a human would notice changes: status, status message,
a new phase transition, or a node's phase.

Goals:

* ``until="ready"`` returns the cluster once it is ``ready`` (or ``degraded``,
  which the state machine only reaches from ``ready``, so a slow poll cannot
  miss the goal); raises :class:`ClusterFailedError` on ``failed`` and
  :class:`InvalidStateError` if the cluster starts being deleted instead.
* ``until="deleted"`` returns once ``GET`` answers 404 (or reports status
  ``deleted``), with the last state seen before that (``None`` if the cluster
  was already gone).

Create and update accept either the pydantic request model or a plain
mapping of the same fields; a mapping is sent as is and validated by the
server (that is what the CLI does, so users get the server's messages).
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Literal, overload

from gpuclusters.client._session import Session, body_of
from gpuclusters.client.errors import ClusterFailedError, WaitTimeoutError
from gpuclusters.core.enums import ClusterStatus
from gpuclusters.core.errors import InvalidStateError, NotFoundError
from gpuclusters.core.models import (
    Cluster,
    ClusterCreate,
    ClusterCredentials,
    ClusterToken,
    ClusterUpdate,
    SshCertificate,
    SshTarget,
)
from gpuclusters.core.paging import Page

WaitGoal = Literal["ready", "deleted"]
OnChange = Callable[[Cluster], None]

DEFAULT_WAIT_TIMEOUT_S = 3600.0
DEFAULT_POLL_INTERVAL_S = 1.0

_USABLE = frozenset({ClusterStatus.READY, ClusterStatus.DEGRADED})
_GOING_AWAY = frozenset({ClusterStatus.DELETING, ClusterStatus.DELETED})


def _fingerprint(cluster: Cluster) -> Hashable:
    return (
        cluster.status,
        cluster.status_message,
        len(cluster.phase_history),
        tuple((n.name, n.phase, n.cordoned) for n in cluster.nodes),
    )


class ClustersAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def create(self, spec: ClusterCreate | Mapping[str, Any]) -> Cluster:
        return self._s.send(
            "POST", self._s.project_path("clusters"), model=Cluster, json=body_of(spec)
        )

    def list(self) -> builtins.list[Cluster]:
        """Every live cluster of the project (all pages)."""
        return self._s.get_all(self._s.project_path("clusters"), Cluster)

    def page(self, *, limit: int | None = None, cursor: str | None = None) -> Page[Cluster]:
        """One page of clusters; pass ``next_cursor`` back for the next."""
        return self._s.get_page(
            self._s.project_path("clusters"), Cluster, limit=limit, cursor=cursor
        )

    def get(self, name: str) -> Cluster:
        return self._s.get(self._s.project_path("clusters", name), Cluster)

    def update(self, name: str, changes: ClusterUpdate | Mapping[str, Any]) -> Cluster:
        """PATCH; only the fields set on ``changes`` are sent."""
        return self._s.send(
            "PATCH",
            self._s.project_path("clusters", name),
            model=Cluster,
            json=body_of(changes, partial=True),
        )

    def delete(
        self, name: str, *, delete_volume: bool = False, force_reason: str | None = None
    ) -> Cluster:
        """Start deleting; the answer has status ``deleting``. See :meth:`wait`.
        ``force_reason`` (organization admins): steps that fail are skipped at
        once, with an event, instead of retried; the reason is recorded."""
        return self._s.send(
            "DELETE",
            self._s.project_path("clusters", name),
            model=Cluster,
            params={
                "delete_volume": True if delete_volume else None,
                "force": True if force_reason is not None else None,
                "reason": force_reason,
            },
        )

    def ssh_target(
        self,
        name: str,
        *,
        node: str | None = None,
        command: builtins.list[str] | None = None,
        as_root: bool = False,
    ) -> SshTarget:
        """The operator's path on the server machine: a local command line
        (``argv``) into the login node or ``node``, as the caller's own Unix
        account, or as root with ``as_root`` (organization admins). Users
        log in over SSH instead: :meth:`ssh_certificate`."""
        return self._s.send(
            "POST",
            self._s.project_path("clusters", name, "ssh"),
            model=SshTarget,
            params={"node": node},
            json={"command": command or [], "as_root": as_root},
        )

    def ssh_certificate(
        self, name: str, *, public_key: str, node: str | None = None
    ) -> SshCertificate:
        """Sign ``public_key`` (an OpenSSH public key line) for the caller's
        own Unix account on the cluster. The answer says where to connect
        (``host``, ``port``: the cluster's login node), the ``@cert-authority``
        known_hosts line that authenticates it, and, with ``node``, the
        ``node_host`` to jump on to from the login node. Raises
        :class:`InvalidStateError` while the cluster is not ready or has no
        SSH endpoint."""
        body: dict[str, str] = {"public_key": public_key}
        if node is not None:
            body["node"] = node
        return self._s.send(
            "POST",
            self._s.project_path("clusters", name, "ssh-certificate"),
            model=SshCertificate,
            json=body,
        )

    def token(self, name: str) -> ClusterToken:
        """A token of minutes for the caller on the cluster's Kubernetes API
        (what a kubeconfig's exec credential plugin hands kubectl)."""
        return self._s.send(
            "POST", self._s.project_path("clusters", name, "token"), model=ClusterToken
        )

    def credentials(self, name: str, *, context_name: str | None = None) -> ClusterCredentials:
        """A kubeconfig (YAML text in ``.kubeconfig``) for the caller on the
        cluster's Kubernetes API; its context is named ``context_name``
        (default: the cluster's name). Raises :class:`InvalidStateError`
        while the cluster is not ready or has no Kubernetes."""
        return self._s.send(
            "POST",
            self._s.project_path("clusters", name, "credentials"),
            model=ClusterCredentials,
            json={"context_name": context_name},
        )

    @overload
    def wait(
        self,
        name: str,
        *,
        until: Literal["ready"] = "ready",
        on_change: OnChange | None = None,
        timeout: float | None = DEFAULT_WAIT_TIMEOUT_S,
        interval: float = DEFAULT_POLL_INTERVAL_S,
    ) -> Cluster: ...

    @overload
    def wait(
        self,
        name: str,
        *,
        until: Literal["deleted"],
        on_change: OnChange | None = None,
        timeout: float | None = DEFAULT_WAIT_TIMEOUT_S,
        interval: float = DEFAULT_POLL_INTERVAL_S,
    ) -> Cluster | None: ...

    def wait(
        self,
        name: str,
        *,
        until: WaitGoal = "ready",
        on_change: OnChange | None = None,
        timeout: float | None = DEFAULT_WAIT_TIMEOUT_S,
        interval: float = DEFAULT_POLL_INTERVAL_S,
    ) -> Cluster | None:
        """Poll until the goal is reached (see the module docstring).

        ``timeout`` is in seconds (``None``: no limit) and raises
        :class:`WaitTimeoutError` when exceeded.
        """
        if until not in ("ready", "deleted"):
            raise ValueError(f"until must be 'ready' or 'deleted', got {until!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        last: Cluster | None = None
        last_fp: Hashable = None
        while True:
            try:
                cluster = self.get(name)
            except NotFoundError:
                if until == "deleted":
                    return last
                raise
            fp = _fingerprint(cluster)
            if on_change is not None and fp != last_fp:
                on_change(cluster)
            last, last_fp = cluster, fp
            if until == "ready":
                if cluster.status in _USABLE:
                    return cluster
                if cluster.status is ClusterStatus.FAILED:
                    reason = f": {cluster.status_message}" if cluster.status_message else ""
                    raise ClusterFailedError(f"cluster {name} failed{reason}", cluster=cluster)
                if cluster.status in _GOING_AWAY:
                    raise InvalidStateError(
                        f"cluster {name} is {cluster.status.value}; it will not become ready"
                    )
            elif cluster.status is ClusterStatus.DELETED:
                return cluster
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeoutError(
                        f"cluster {name} is still {cluster.status.value} after {timeout:g}s "
                        f"(waiting for {until})"
                    )
                time.sleep(min(interval, remaining))
            else:
                time.sleep(interval)
