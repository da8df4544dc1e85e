"""The audit log (``GET /v1/audit``): organization admins read all of it,
project admins their projects'."""

from __future__ import annotations

import builtins
from datetime import datetime
from typing import Any

from gpuclusters.client._session import Session
from gpuclusters.core.models import AuditEvent
from gpuclusters.core.paging import Page


class AuditAPI:
    def __init__(self, session: Session) -> None:
        self._s = session

    @staticmethod
    def _params(
        user: str | None,
        project: str | None,
        object_: str | None,
        since: datetime | None,
        until: datetime | None,
    ) -> dict[str, Any]:
        return {
            "user": user,
            "project": project,
            "object": object_,
            "since": since.isoformat() if since else None,
            "until": until.isoformat() if until else None,
        }

    def list(
        self,
        *,
        user: str | None = None,
        project: str | None = None,
        object_: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> builtins.list[AuditEvent]:
        """Every record that matches, newest first (all pages)."""
        params = self._params(user, project, object_, since, until)
        return self._s.get_all("/v1/audit", AuditEvent, params=params)

    def page(
        self,
        *,
        user: str | None = None,
        project: str | None = None,
        object_: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Page[AuditEvent]:
        """One page, newest first; pass ``next_cursor`` back for the next."""
        params = self._params(user, project, object_, since, until)
        return self._s.get_page("/v1/audit", AuditEvent, params=params, limit=limit, cursor=cursor)
