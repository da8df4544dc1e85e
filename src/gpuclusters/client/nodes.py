"""``client.nodes``, ``client.events`` and ``client.usage``: read-only views
of a project's nodes, their lifecycle and what they cost.

Nodes are owned by clusters (scale the cluster to change them); events are the
node lifecycle log (``ScaledUp``, ``Preempted``, ...), newest first.
"""

from __future__ import annotations

import builtins
from datetime import datetime

from gpuclusters.client._session import Session
from gpuclusters.core.models import Node, NodeEvent, UsageReport
from gpuclusters.core.paging import Page


class NodesAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(
        self, cluster: str | None = None, *, include_deleted: bool = False
    ) -> builtins.list[Node]:
        """Nodes of the project, or of one cluster; deleted ones only on
        request (all pages)."""
        return self._s.get_all(
            self._s.project_path("nodes"),
            Node,
            params={"cluster": cluster, "include_deleted": True if include_deleted else None},
        )

    def page(
        self,
        cluster: str | None = None,
        *,
        include_deleted: bool = False,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page[Node]:
        """One page of nodes; pass ``next_cursor`` back for the next."""
        return self._s.get_page(
            self._s.project_path("nodes"),
            Node,
            params={"cluster": cluster, "include_deleted": True if include_deleted else None},
            limit=limit,
            cursor=cursor,
        )

    def get(self, name: str) -> Node:
        return self._s.get(self._s.project_path("nodes", name), Node)

    def set_auto_repair(self, name: str, enabled: bool) -> Node:
        """Turn automatic repair on or off for one node (project admins)."""
        return self._s.send(
            "PATCH", self._s.project_path("nodes", name), model=Node, json={"auto_repair": enabled}
        )


class EventsAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def list(
        self, cluster: str | None = None, *, node: str | None = None
    ) -> builtins.list[NodeEvent]:
        """Node events, newest first, optionally for one cluster and/or node
        (all pages)."""
        return self._s.get_all(
            self._s.project_path("events"), NodeEvent, params={"cluster": cluster, "node": node}
        )

    def page(
        self,
        cluster: str | None = None,
        *,
        node: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page[NodeEvent]:
        """One page of events, newest first; pass ``next_cursor`` back for the next."""
        return self._s.get_page(
            self._s.project_path("events"),
            NodeEvent,
            params={"cluster": cluster, "node": node},
            limit=limit,
            cursor=cursor,
        )


class UsageAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    def report(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        by: str | None = None,
    ) -> UsageReport:
        """GPU-hours and cost per cluster and class (default: the last 30
        days); ``by`` ("user" or "cluster") adds totals per user or cluster."""
        params = {
            "since": since.isoformat() if since else None,
            "until": until.isoformat() if until else None,
            "by": by,
        }
        return self._s.get(self._s.project_path("usage"), UsageReport, params=params)
