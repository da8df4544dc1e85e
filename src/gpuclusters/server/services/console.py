"""The web console's sessions (server/routers/console.py).

Signing in exchanges an API key for a session: a random 256-bit token in
an HttpOnly cookie (Secure when the console is served over TLS), of which
the database keeps only the SHA-256, beside the API key it acts with and a
CSRF token. Every request of the console resolves the cookie to the key's
principal again, so the console sees exactly what the API would show that
key, and a revoked key (or a deleted user) ends its sessions at once.

CSRF: the token is per session, rendered into every form (and into the
page for htmx requests, which send it as a header); a mutating request
must echo it (compared in constant time). The cookie is ``SameSite=Lax``
besides, so another site's form post carries no session at all.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncSession

from gpuclusters.core.errors import AuthenticationError, PermissionDeniedError
from gpuclusters.server.db.models import ApiKey, ConsoleSession, utcnow
from gpuclusters.server.security.keys import hash_key
from gpuclusters.server.security.principal import Principal
from gpuclusters.server.services import tenancy

SESSION_TTL = timedelta(hours=12)


@dataclass(frozen=True, slots=True)
class SignedIn:
    principal: Principal
    csrf_token: str
    session_id: str


async def sign_in(session: AsyncSession, *, key: str) -> tuple[str, SignedIn]:
    """A new session for the API key ``key``; returns the cookie's token and
    the session. Raises AuthenticationError for a bad or revoked key."""
    principal, key_row = await tenancy.principal_for_key(
        session, ApiKey.key_hash == hash_key(key.strip())
    )
    token = secrets.token_urlsafe(32)
    row = ConsoleSession(
        id=hash_key(token),
        api_key_id=key_row.id,
        csrf_token=secrets.token_urlsafe(32),
        expires_at=utcnow() + SESSION_TTL,
    )
    session.add(row)
    # Expired sessions go as new ones come (no separate sweeper needed).
    await session.execute(delete(ConsoleSession).where(ConsoleSession.expires_at < utcnow()))
    await session.commit()
    return token, SignedIn(principal, row.csrf_token, row.id)


async def resolve(session: AsyncSession, *, token: str | None) -> SignedIn:
    """The signed-in caller behind a cookie token; AuthenticationError if
    there is none, it expired, or its key no longer works."""
    if not token:
        raise AuthenticationError("not signed in")
    row = await session.get(ConsoleSession, hash_key(token))
    if row is None or row.expires_at < utcnow():
        raise AuthenticationError("the session expired: sign in again")
    principal, _ = await tenancy.principal_for_key(session, ApiKey.id == row.api_key_id)
    return SignedIn(principal, row.csrf_token, row.id)


def check_csrf(signed_in: SignedIn, presented: str | None) -> None:
    if not presented or not hmac.compare_digest(presented, signed_in.csrf_token):
        raise PermissionDeniedError("missing or wrong CSRF token: reload the page and retry")


async def sign_out(session: AsyncSession, *, signed_in: SignedIn) -> str | None:
    """End the console session; the id of the API key it acted with."""
    row = await session.get(ConsoleSession, signed_in.session_id)
    key_id = row.api_key_id if row is not None else None
    await session.execute(delete(ConsoleSession).where(ConsoleSession.id == signed_in.session_id))
    await session.commit()
    return key_id
