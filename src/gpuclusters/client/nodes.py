"""``client.nodes`` and ``client.events``: read-only views of a project's nodes.

Nodes are owned by clusters (scale the cluster to change them); events are the
node lifecycle log (``ScaledUp``, ``Preempted``, ...), newest first.
"""

from __future__ import annotations

import builtins

from gpuclusters.client._session import Session
from gpuclusters.core.models import Node, NodeEvent


class NodesAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(
        self, cluster: str | None = None, *, include_deleted: bool = False
    ) -> builtins.list[Node]:
        """Nodes of the project, or of one cluster; deleted ones only on request."""
        return self._s.get_list(
            self._s.project_path("nodes"),
            Node,
            params={"cluster": cluster, "include_deleted": True if include_deleted else None},
        )

    def get(self, name: str) -> Node:
        return self._s.get(self._s.project_path("nodes", name), Node)


class EventsAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(
        self, cluster: str | None = None, *, node: str | None = None
    ) -> builtins.list[NodeEvent]:
        """Node events, newest first, optionally for one cluster and/or node."""
        return self._s.get_list(
            self._s.project_path("events"), NodeEvent, params={"cluster": cluster, "node": node}
        )
