"""The audit log: every mutating API call and console action, who made it,
from which address, what, on which object, and the outcome.

Rows are written by ``server/audit_log.py`` (a middleware around the whole
app, so no route can forget) and read here. Who may read what:

* organization admins: every record of their organization, and the
  attempts nobody was authenticated for (a refused key, a failed sign-in);
* project admins: the records of their projects;
* anyone else: nothing (403).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import models as api
from gpuclusters.core.enums import ProjectRole
from gpuclusters.core.errors import PermissionDeniedError, ValidationError
from gpuclusters.core.paging import Page
from gpuclusters.server.db.models import AuditEvent, Project
from gpuclusters.server.db.paging import page_of
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services.tenancy import resolve_project


@dataclass(frozen=True, slots=True)
class Entry:
    """What the middleware saw of one request."""

    principal: Principal | None
    via: str
    address: str
    method: str
    action: str
    route: str
    project_name: str
    object: str
    status: int
    outcome: str  # outcome_of(status), or "refused" for a console form sent back
    detail: str


def outcome_of(status: int) -> str:
    if status >= 500:
        return "failed"
    if status >= 400:
        return "refused"
    return "ok"


async def record(session: AsyncSession, entry: Entry) -> AuditEvent:
    """Add one record (the caller commits)."""
    who = entry.principal
    project_id = None
    if entry.project_name and who is not None:
        project_id = await session.scalar(
            select(Project.id).where(
                Project.organization_id == who.organization_id,
                Project.name == entry.project_name,
            )
        )
    row = AuditEvent(
        organization_id=who.organization_id if who else None,
        user_id=who.user_id if who else None,
        user_name=who.user_name if who else "",
        via=entry.via,
        address=entry.address[:64],
        method=entry.method[:8],
        action=entry.action[:64],
        route=entry.route[:200],
        project_id=project_id,
        project_name=entry.project_name[:64],
        object=entry.object[:300],
        status=entry.status,
        outcome=entry.outcome,
        detail=entry.detail[:1000],
    )
    session.add(row)
    return row


def _like_prefix(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "/%"


def _admin_projects(principal: Principal) -> list[str]:
    return [pid for pid, role in principal.roles.items() if role == ProjectRole.ADMIN]


async def list_audit(
    session: AsyncSession,
    *,
    principal: Principal,
    user: str | None = None,
    project_name: str | None = None,
    object_: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int | None = None,
    cursor: str | None = None,
) -> Page[api.AuditEvent]:
    """The records the caller may read, newest first, a page at a time."""
    if since is not None and until is not None and since > until:
        raise ValidationError("since: must not be after until", field="since")
    q = select(AuditEvent)
    if project_name is not None:
        project = await resolve_project(
            session, principal=principal, name=project_name, need=ProjectRole.ADMIN
        )
        q = q.where(AuditEvent.project_id == project.id)
    elif principal.is_admin:
        q = q.where(
            or_(
                AuditEvent.organization_id == principal.organization_id,
                AuditEvent.organization_id.is_(None),
            )
        )
    else:
        mine = _admin_projects(principal)
        if not mine:
            raise PermissionDeniedError(
                "the audit log is for organization admins and project admins"
            )
        q = q.where(AuditEvent.project_id.in_(mine))
    if user is not None:
        q = q.where(AuditEvent.user_name == user)
    if object_ is not None:
        target = object_.strip("/")
        q = q.where(
            or_(AuditEvent.object == target, AuditEvent.object.like(_like_prefix(target), "\\"))
        )
    if since is not None:
        q = q.where(AuditEvent.timestamp >= since)
    if until is not None:
        q = q.where(AuditEvent.timestamp < until)
    rows, next_cursor = await page_of(
        session, q, AuditEvent, limit=limit, cursor=cursor, newest_first=True
    )
    items = [
        api.AuditEvent(
            timestamp=r.timestamp,
            user=r.user_name,
            via=r.via,
            address=r.address,
            action=r.action,
            method=r.method,
            route=r.route,
            project=r.project_name or None,
            object=r.object,
            status=r.status,
            outcome=r.outcome,
            detail=r.detail,
        )
        for r in rows
    ]
    return Page(items, next_cursor)
