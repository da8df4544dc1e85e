"""Single sign-on sessions kept honest (housekeeping; docs/identity.md):
each open session is refreshed at the identity provider every
``sso_recheck_interval_s``, its groups applied again, and a user the
provider no longer vouches for is locked out. ``services/sso.py`` opens
the sessions and shares the rules here (roles from groups, ending a
session, locking out)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core import sso
from gpuclusters.server.controllers import hints
from gpuclusters.server.db.models import (
    ApiKey,
    Project,
    ProjectMember,
    SsoLogin,
    SsoSession,
    User,
    utcnow,
)
from gpuclusters.server.runtime import Runtime
from gpuclusters.server.security.oidc import (
    InvalidGrantError,
    OidcClient,
    OidcError,
    OidcUnavailableError,
)

log = logging.getLogger(__name__)

RECHECK_BATCH = 200
LOGIN_TTL = timedelta(minutes=10)  # a console sign-in's round trip to the provider


async def apply_grants(session: AsyncSession, rt: Runtime, user: User, grants: sso.Grants) -> bool:
    """Make the user's roles exactly ``grants`` (projects that do not exist
    are skipped, with a warning); whether anything changed."""
    changed = user.is_admin != grants.org_admin
    user.is_admin = grants.org_admin
    projects = {
        p.name: p
        for p in await session.scalars(
            select(Project).where(
                Project.organization_id == user.organization_id,
                Project.name.in_(list(grants.projects)),
            )
        )
    }
    for missing in sorted(set(grants.projects) - set(projects)):
        log.warning("single sign-on: the group mapping names project %r, which does not exist",
                    missing)  # fmt: skip
    held = {
        m.project_id: m
        for m in await session.scalars(
            select(ProjectMember).where(ProjectMember.user_id == user.id)
        )
    }
    wanted = {projects[name].id: role for name, role in grants.projects.items() if name in projects}
    for project_id, member in held.items():
        if project_id not in wanted:
            await session.delete(member)
            changed = True
        elif member.role != wanted[project_id].value:
            member.role = wanted[project_id].value
            changed = True
    for project_id, role in wanted.items():
        if project_id not in held:
            session.add(ProjectMember(project_id=project_id, user_id=user.id, role=role.value))
            changed = True
    return changed


def grants_from_claims(rt: Runtime, claims: dict[str, Any]) -> sso.Grants:
    groups = sso.groups_of(claims, rt.settings.sso_groups_claim)
    return sso.grants_for(groups, rt.settings.sso_grants)


async def end_session(session: AsyncSession, row: SsoSession, reason: str, now: datetime) -> None:
    row.ended_at = now
    row.end_reason = reason
    await session.execute(
        update(ApiKey)
        .where(ApiKey.id == row.api_key_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now)
    )


async def lock_out(session: AsyncSession, rt: Runtime, user: User, reason: str) -> None:
    """The provider no longer vouches for ``user``: end every session,
    revoke every key (console sessions go with them), take every role."""
    now = utcnow()
    for row in await session.scalars(
        select(SsoSession).where(SsoSession.user_id == user.id, SsoSession.ended_at.is_(None))
    ):
        await end_session(session, row, reason, now)
    await session.execute(
        update(ApiKey)
        .where(ApiKey.user_id == user.id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    await apply_grants(session, rt, user, sso.Grants())
    await session.commit()
    rt.hints.notify(hints.ACCESS)
    log.warning("single sign-on: %s locked out: %s", user.name, reason)


async def recheck_sessions(rt: Runtime) -> int:
    """Refresh the sessions due at the provider (housekeeping); how many
    were checked. A provider that cannot be reached ends the pass: the
    others would wait for it the same way."""
    if rt.oidc is None:
        return 0
    now = utcnow()
    due_before = now - timedelta(seconds=rt.settings.sso_recheck_interval_s)
    async with rt.sessionmaker() as session:
        ids = list(
            await session.scalars(
                select(SsoSession.id)
                .where(SsoSession.ended_at.is_(None), SsoSession.checked_at <= due_before)
                .order_by(SsoSession.checked_at)
                .limit(RECHECK_BATCH)
            )
        )
    checked = 0
    for session_id in ids:
        if not await _recheck_one(rt, rt.oidc, session_id):
            break
        checked += 1
    async with rt.sessionmaker() as session:
        # Console sign-ins nobody finished.
        await session.execute(delete(SsoLogin).where(SsoLogin.created_at < now - LOGIN_TTL))
        await session.commit()
    return checked


async def _recheck_one(rt: Runtime, oidc: OidcClient, session_id: str) -> bool:
    """One session against the provider; False if the provider could not
    be reached. No transaction is held while the provider answers: the
    session is read, then written if it is still the one that was read."""
    async with rt.sessionmaker() as session:
        row = await session.get(SsoSession, session_id)
        if row is None or row.ended_at is not None:
            return True
        now = utcnow()
        if row.expires_at <= now:
            await end_session(session, row, "expired", now)
            await session.commit()
            return True
        refresh_token, user_id = row.refresh_token, row.user_id
    tokens = None
    try:
        tokens = await oidc.refresh(refresh_token)
        refused = None
    except OidcUnavailableError as exc:
        log.warning("single sign-on: cannot recheck sessions now: %s", exc)
        return False
    except InvalidGrantError as exc:
        refused = f"the identity provider refused: {exc}"
    except OidcError as exc:
        refused = f"the identity provider's answer: {exc}"
    other: str | None = None
    changed = False
    async with rt.sessionmaker() as session:
        row = await session.get(SsoSession, session_id)
        if row is None or row.ended_at is not None or row.refresh_token != refresh_token:
            return True  # ended, or rechecked by someone else, meanwhile
        user = await session.get_one(User, user_id)
        if refused is not None:
            # A provider may keep one refresh token per user and client
            # (Dex does): the user's newer sign-in supersedes this
            # session's. So a refusal ends this session; whether the user
            # is still vouched for is the newest other session's answer,
            # and with none left the user is locked out.
            other = await session.scalar(
                select(SsoSession.id)
                .where(
                    SsoSession.user_id == user_id,
                    SsoSession.ended_at.is_(None),
                    SsoSession.id != session_id,
                )
                .order_by(SsoSession.created_at.desc())
                .limit(1)
            )
            if other is None:
                await lock_out(session, rt, user, refused)
                return True
            await end_session(session, row, refused, utcnow())
            await session.commit()
        else:
            assert tokens is not None
            if str(tokens.claims.get("sub")) != user.sso_subject:
                await lock_out(session, rt, user, "the identity provider answered for someone else")
                return True
            row.refresh_token = tokens.refresh_token or row.refresh_token
            row.checked_at = utcnow()
            changed = await apply_grants(session, rt, user, grants_from_claims(rt, tokens.claims))
            await session.commit()
    if other is not None:
        log.info("single sign-on: a session of %s ended: %s", user.name, refused)
        return await _recheck_one(rt, oidc, other)
    if changed:
        rt.hints.notify(hints.ACCESS)
        log.info("single sign-on: %s's roles changed at the identity provider", user.name)
    return True
